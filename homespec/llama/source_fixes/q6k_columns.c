// homespec (Q6K_COLUMNS_FIX): a Q6_K weight row against several Q8_K activation rows at once.
// x86 has no repacked Q6_K layout in this ggml, so below the tiled matmul (passes of 2-7 rows:
// verify steps, several requests decoding together) each of a pass's rows took ggml's dot
// product on its own, unpacking every 6-bit block again for each. Here a block is unpacked once
// for all of a chunk's rows; each row's integer sums and float steps are those of
// ggml_vec_dot_q6_K_q8_K's AVX2 kernel, in its order, so every result is bitwise the one that
// kernel gives (a pass of one row, exact mode's batch invariance).
#if defined(__AVX2__)
#include <immintrin.h>

#define HOMESPEC_Q6K_COLS_MAX 16  // one chunk's block of activation rows (mul_mat_one_chunk's blck_1)

static inline float homespec_hsum_float_8(const __m256 x) {  // as quants.c sums its accumulator
    __m128 res = _mm256_extractf128_ps(x, 1);
    res = _mm_add_ps(res, _mm256_castps256_ps128(x));
    res = _mm_add_ps(res, _mm_movehl_ps(res, res));
    res = _mm_add_ss(res, _mm_movehdup_ps(res));
    return _mm_cvtss_f32(res);
}

// Sub-block scales 2i and 2i + 1, each spread over 8 bytes: quants.c's get_scale_shuffle(i).
static inline __m128i homespec_scale_shuffle(int i) {
    static const uint8_t k_shuffle[128] = {
         0, 0, 0, 0, 0, 0, 0, 0,  1, 1, 1, 1, 1, 1, 1, 1,   2, 2, 2, 2, 2, 2, 2, 2,  3, 3, 3, 3, 3, 3, 3, 3,
         4, 4, 4, 4, 4, 4, 4, 4,  5, 5, 5, 5, 5, 5, 5, 5,   6, 6, 6, 6, 6, 6, 6, 6,  7, 7, 7, 7, 7, 7, 7, 7,
         8, 8, 8, 8, 8, 8, 8, 8,  9, 9, 9, 9, 9, 9, 9, 9,  10,10,10,10,10,10,10,10, 11,11,11,11,11,11,11,11,
        12,12,12,12,12,12,12,12, 13,13,13,13,13,13,13,13,  14,14,14,14,14,14,14,14, 15,15,15,15,15,15,15,15,
    };
    return _mm_loadu_si128((const __m128i *) k_shuffle + i);
}

// s[c*bs] = the dot product of the Q6_K row vx with the Q8_K row at vy + c*by, for c < nc
// (nc <= HOMESPEC_Q6K_COLS_MAX); n values each.
static void homespec_vec_dot_q6_K_q8_K_cols(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx,
                                            const char * GGML_RESTRICT vy, size_t by, int nc) {
    const block_q6_K * GGML_RESTRICT x = (const block_q6_K *) vx;
    const int nb = n / QK_K;

    const __m256i m3 = _mm256_set1_epi8(3);
    const __m256i m15 = _mm256_set1_epi8(15);

    __m256 acc[HOMESPEC_Q6K_COLS_MAX];  // [nc] each row's float accumulator, as the kernel's acc
    for (int c = 0; c < nc; ++c) {
        acc[c] = _mm256_setzero_ps();
    }

    for (int i = 0; i < nb; ++i) {
        // the next weight row's block i into L2, for the dispatch's next call: with several rows to
        // compute per block, the hardware prefetcher fell behind (target passes of 4-5 rows ~10 %
        // cheaper with it on a 2-core AVX-512 EPYC, processes taking turns, 2026-12-07). An address
        // past the weight's end is never read, and a prefetch does not fault.
        const uintptr_t next = (uintptr_t) (x + i) + (uintptr_t) nb * sizeof(block_q6_K);
        for (size_t line = 0; line < sizeof(block_q6_K); line += 64) {
            _mm_prefetch((const char *) (next + line), _MM_HINT_T1);
        }
        const float xd = GGML_CPU_FP16_TO_FP32(x[i].d);
        const __m128i scales = _mm_loadu_si128((const __m128i *) x[i].scales);
        const __m256i scales_16 = _mm256_cvtepi8_epi16(scales);

        // the block's 256 weights as 6-bit values, and the scale of each 16, once (the kernel's steps)
        __m256i q[8];   // [8] 32 weights each, in the order of the activations they meet
        __m256i sc[8];  // [8] each 16-bit pair's sub-block scale
        for (int j = 0; j < QK_K/128; ++j) {
            const __m256i q4bits1 = _mm256_loadu_si256((const __m256i *) (x[i].ql + 64*j));
            const __m256i q4bits2 = _mm256_loadu_si256((const __m256i *) (x[i].ql + 64*j + 32));
            const __m256i q4bitsH = _mm256_loadu_si256((const __m256i *) (x[i].qh + 32*j));

            const __m256i q4h_0 = _mm256_slli_epi16(_mm256_and_si256(q4bitsH, m3), 4);
            const __m256i q4h_1 = _mm256_slli_epi16(_mm256_and_si256(q4bitsH, _mm256_set1_epi8(12)), 2);
            const __m256i q4h_2 = _mm256_and_si256(q4bitsH, _mm256_set1_epi8(48));
            const __m256i q4h_3 = _mm256_srli_epi16(_mm256_and_si256(q4bitsH, _mm256_set1_epi8(-64)), 2);

            q[4*j + 0] = _mm256_or_si256(_mm256_and_si256(q4bits1, m15), q4h_0);
            q[4*j + 1] = _mm256_or_si256(_mm256_and_si256(q4bits2, m15), q4h_1);
            q[4*j + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4bits1, 4), m15), q4h_2);
            q[4*j + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4bits2, 4), m15), q4h_3);
            for (int k = 0; k < 4; ++k) {
                sc[4*j + k] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, homespec_scale_shuffle(4*j + k)));
            }
        }

        for (int c = 0; c < nc; ++c) {
            const block_q8_K * GGML_RESTRICT y = (const block_q8_K *) (vy + c*by) + i;
            // int32 sums: their order does not change them
            __m256i sumi = _mm256_setzero_si256();
            for (int k = 0; k < 8; ++k) {
                const __m256i q8 = _mm256_loadu_si256((const __m256i *) (y->qs + 32*k));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(sc[k], _mm256_maddubs_epi16(q[k], q8)));
            }
            const float d = y->d * xd;
            const __m256i q8sums = _mm256_loadu_si256((const __m256i *) y->bsums);
            const __m256i q8sclsub = _mm256_slli_epi32(_mm256_madd_epi16(q8sums, scales_16), 5);
            acc[c] = _mm256_fmadd_ps(_mm256_broadcast_ss(&d), _mm256_cvtepi32_ps(_mm256_sub_epi32(sumi, q8sclsub)), acc[c]);
        }
    }
    for (int c = 0; c < nc; ++c) {
        s[c*bs] = homespec_hsum_float_8(acc[c]);
    }
}
#endif

// Exact mode reads a prompt's rows as they come out of any pass of 8+ rows, ggml's tiled matmul
// giving a row the same result in every such pass: a prefix borrowed or saved must equal the same
// prefix read in a pass of another length (homespec/llama/kernels.py). Its target sets this around
// its prompt passes, which then leave 8+ rows to the tiled matmul as ggml does.
static atomic_bool homespec_q6k_tiled_from_8 = false;
GGML_BACKEND_API void homespec_cpu_set_q6k_tiled_from_8(bool on);
GGML_BACKEND_API void homespec_cpu_set_q6k_tiled_from_8(bool on) {
    atomic_store(&homespec_q6k_tiled_from_8, on);
}

#if defined(__AVX2__)
// The passes this kernel takes: a Q6_K weight (2-D) against 2-65 activation rows (f32, which ggml
// quantizes to Q8_K): every verify pass of a draft of up to 64 tokens (speculation.k_max's default),
// or 2-7 while homespec_q6k_tiled_from_8 is set. ggml's tiled matmul would take those of 8+ rows;
// for a Q6_K weight against 8-32 rows it ran 1.1-2.8x slower than this on a 2-core AVX-512 EPYC
// (ggml_mul_mat, the 1.5B target's output layer; 33 rows 52-57 against 76 ms, 64 rows 97-104
// against 87-90, and whole target passes of 33-65 rows 0.95-1.01x with this), and the results
// stay bitwise those of one row.
#define HOMESPEC_Q6K_COLS_MAX_ROWS 65
#define HOMESPEC_Q6K_BELOW_TILED 7  // tiled.cpp's ggml_tiled_min_batch: 8+ rows
static bool homespec_q6k_columns_take(const struct ggml_tensor * dst) {
    const struct ggml_tensor * w = dst->src[0];
    const struct ggml_tensor * a = dst->src[1];
    const int64_t max_rows = atomic_load_explicit(&homespec_q6k_tiled_from_8, memory_order_relaxed)
        ? HOMESPEC_Q6K_BELOW_TILED : HOMESPEC_Q6K_COLS_MAX_ROWS;
    return w->type == GGML_TYPE_Q6_K && a->type == GGML_TYPE_F32 && w->ne[2] == 1 && w->ne[3] == 1 &&
           a->ne[2] == 1 && a->ne[3] == 1 && a->ne[1] >= 2 && a->ne[1] <= max_rows;
}
#else
static bool homespec_q6k_columns_take(const struct ggml_tensor * dst) {  // (a build without AVX2: ggml's paths)
    (void) dst;
    return false;
}
#endif

