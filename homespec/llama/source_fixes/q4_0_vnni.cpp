// homespec (cpu_build.py, Q4_0_VNNI_FIX): ggml's repacked Q4_0 weights (block_q4_0x8) against rows
// of activations with AVX-512 VNNI, 1-3 rows (block_q8_0) or fours (block_q8_0x4): a draft model's passes.
//
// A draft step's first pass reads two tokens (the last accepted one and the bonus), and ggml ran its
// gemv once per row for rows below a multiple of four: the 0.5B Q4_0 draft's pass over 2 tokens
// cost 1.5x one over 1, over 3 tokens 2x (2-core AVX-512 EPYC, 2026-12-07), so every draft step
// paid half a pass more than it read. ggml's gemv also multiplies signed bytes by signed bytes
// through AVX2's sign tricks (six instructions per four products a lane).
//
// Here each 64 weight bytes are unpacked once for all rows, as unsigned nibbles (value + 8), a
// column's 4 values in each 32-bit lane, and each row adds its products with vpdpbusd, 8 activation
// bytes broadcast from memory; the + 8 comes off as 8 x the block's activation sum. Every result is
// bitwise ggml's gemv's for that row alone: each column's integer sum over a block is exact on both
// paths, and the float steps are ggml's, in its order (one fused multiply-add per block, the sum x
// (column d x row d)).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define HOMESPEC_Q4_0_VNNI 1
#include <atomic>
static std::atomic<bool> homespec_q4_0_vnni{true};

// Blocks of 32 values a row may have here (the activation sums live on the stack): 32,768 values,
// past any draft's width; a wider weight takes ggml's gemv.
#define HOMESPEC_Q4_0_MAX_BLOCKS 1024

// R rows of activations against the same weights, 8 columns at a time: s[r*bs + col] as ggml's gemv
// writes each row alone. Row r's block ib starts at qs[r] + ib * block_bytes (its scale likewise at
// d[r]), and its 8-byte chunk j at STRIDE * j past that: 8 for rows of block_q8_0, 32 for the four
// rows a block_q8_0x4 interleaves.
template <int R, int STRIDE>
static void homespec_q4_0_8x8_rows_vnni(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx,
                                        const int8_t * const qs[R], const ggml_half * const d[R], size_t block_bytes, int nc) {
    const int nb = n / QK8_0;  // blocks of 32 values per row
    const block_q4_0x8 * b_start = (const block_q4_0x8 *) vx;
    int32_t asum[R][HOMESPEC_Q4_0_MAX_BLOCKS];  // [R][nb] each block's activation sum x 8: the nibbles' + 8
    for (int r = 0; r < R; r++) {
        for (int ib = 0; ib < nb; ib++) {
            const int8_t * qa = qs[r] + (size_t) ib * block_bytes;
            int32_t sum = 0;
            for (int j = 0; j < QK8_0; j++) {
                sum += qa[(j / 8) * STRIDE + j % 8];
            }
            asum[r][ib] = 8 * sum;
        }
    }
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i flip = _mm512_set1_epi8((char) 0x88);  // undoes make_block_q4_0x8's xor: nibble = value + 8
    // A 64-byte load holds 8 columns x 8 bytes, two 32-bit lanes per column: the sums of a column's
    // two lanes, first lanes then second lanes
    const __m512i pairs = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    for (int x = 0; x < nc / 8; x++) {
        const block_q4_0x8 * b = b_start + (size_t) x * nb;
        __m256 acc[R];  // [R] x 8 columns
        for (int r = 0; r < R; r++) {
            acc[r] = _mm256_setzero_ps();
        }
        for (int ib = 0; ib < nb; ib++) {
            if constexpr (R > 1) {  // one row streams at the memory's pace without it
                if (x + 1 < nc / 8) {
                    _mm_prefetch((const char *) (b + nb + ib), _MM_HINT_T1);  // the next column group's, 144 bytes
                    _mm_prefetch((const char *) (b + nb + ib) + 64, _MM_HINT_T1);
                    _mm_prefetch((const char *) (b + nb + ib) + 128, _MM_HINT_T1);
                }
            }
            // values 0-7 and 16-23 of each column (low and high nibbles), then 8-15 and 24-31
            const __m512i raw0 = _mm512_xor_si512(_mm512_loadu_si512((const void *) b[ib].qs), flip);
            const __m512i raw1 = _mm512_xor_si512(_mm512_loadu_si512((const void *) (b[ib].qs + 64)), flip);
            const __m512i w0 = _mm512_and_si512(raw0, m4);
            const __m512i w1 = _mm512_and_si512(raw1, m4);
            const __m512i w2 = _mm512_and_si512(_mm512_srli_epi16(raw0, 4), m4);
            const __m512i w3 = _mm512_and_si512(_mm512_srli_epi16(raw1, 4), m4);
            const __m256 col_d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) b[ib].d));
            for (int r = 0; r < R; r++) {
                const int8_t * qa = qs[r] + (size_t) ib * block_bytes;
                int64_t a0, a1, a2, a3;  // values 0-7, 8-15, 16-23, 24-31
                memcpy(&a0, qa, 8);
                memcpy(&a1, qa + STRIDE, 8);
                memcpy(&a2, qa + 2 * STRIDE, 8);
                memcpy(&a3, qa + 3 * STRIDE, 8);
                __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w0, _mm512_set1_epi64(a0));
                dot = _mm512_dpbusd_epi32(dot, w1, _mm512_set1_epi64(a1));
                dot = _mm512_dpbusd_epi32(dot, w2, _mm512_set1_epi64(a2));
                dot = _mm512_dpbusd_epi32(dot, w3, _mm512_set1_epi64(a3));
                const __m512i split = _mm512_permutexvar_epi32(pairs, dot);
                const __m256i col_sum = _mm256_sub_epi32(
                    _mm256_add_epi32(_mm512_castsi512_si256(split), _mm512_extracti64x4_epi64(split, 1)),
                    _mm256_set1_epi32(asum[r][ib]));  // [8 columns] ggml's integer sums
                const ggml_half row_half = *(const ggml_half *) ((const char *) d[r] + (size_t) ib * block_bytes);
                const __m256 row_d = _mm256_set1_ps(GGML_CPU_FP16_TO_FP32(row_half));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(col_sum), _mm256_mul_ps(col_d, row_d), acc[r]);
            }
        }
        for (int r = 0; r < R; r++) {
            _mm256_storeu_ps(s + (size_t) r * bs + (size_t) x * 8, acc[r]);
        }
    }
}

// Rows 1..R, block_q8_0 each, one after another (as ggml quantizes a gemv's rows)
template <int R>
static void homespec_gemv_q4_0_8x8_q8_0_vnni(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx,
                                             const void * GGML_RESTRICT vy, int nc) {
    const int8_t * qs[R];
    const ggml_half * d[R];
    for (int r = 0; r < R; r++) {
        const block_q8_0 * a = (const block_q8_0 *) vy + (size_t) r * (n / QK8_0);
        qs[r] = a->qs;
        d[r] = &a->d;
    }
    homespec_q4_0_8x8_rows_vnni<R, 8>(n, s, bs, vx, qs, d, sizeof(block_q8_0), nc);
}

// Rows in fours (nr % 4 == 0), each four interleaved in block_q8_0x4 (as ggml quantizes a gemm's rows)
static void homespec_gemm_q4_0_8x8_q8_0_vnni(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx,
                                             const void * GGML_RESTRICT vy, int nr, int nc) {
    for (int y = 0; y < nr / 4; y++) {
        const block_q8_0x4 * a = (const block_q8_0x4 *) vy + (size_t) y * (n / QK8_0);
        const int8_t * qs[4];
        const ggml_half * d[4];
        for (int r = 0; r < 4; r++) {
            qs[r] = a->qs + 8 * r;
            d[r] = &a->d[r];
        }
        homespec_q4_0_8x8_rows_vnni<4, 32>(n, s + (size_t) y * 4 * bs, bs, vx, qs, d, sizeof(block_q8_0x4), nc);
    }
}
#endif

extern "C" {
// Whether ggml_gemv_q4_0_8x8_q8_0 takes 2-3 rows of n values in one call now (its `nr`; ggml's own
// takes one): the row loop ggml's repack.cpp runs after the gemm asks before it calls
// (q4k_vnni_rows.cpp, the hook of both layouts).
bool homespec_q4_0_gemv_takes_rows(int n);
bool homespec_q4_0_gemv_takes_rows(int n) {
#if defined(HOMESPEC_Q4_0_VNNI)
    return homespec_q4_0_vnni.load(std::memory_order_relaxed) && n / QK8_0 <= HOMESPEC_Q4_0_MAX_BLOCKS;
#else
    (void) n;
    return false;
#endif
}
// bool (bool): ggml's own gemv and gemm while off, for the op-level check and paired timing (default on);
// returns whether this build has the kernels at all (AVX-512 with VNNI), the switch's effect.
GGML_BACKEND_API bool homespec_cpu_set_q4_0_vnni(bool on);
GGML_BACKEND_API bool homespec_cpu_set_q4_0_vnni(bool on) {
#if defined(HOMESPEC_Q4_0_VNNI)
    homespec_q4_0_vnni.store(on);
    return true;
#else
    (void) on;
    return false;
#endif
}
}

