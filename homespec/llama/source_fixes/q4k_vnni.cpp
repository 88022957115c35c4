// homespec (cpu_build.py, Q4K_VNNI_FIX): ggml's repacked Q4_K weights (block_q4_Kx8) against rows
// of activations in fours (block_q8_Kx4), the 1-3 after them in the same call, and 1-3 rows alone
// (block_q8_K), with AVX-512 VNNI.
//
// ggml 0.25.3's gemm for this layout multiplies with AVX2's maddubs, then widens, shuffles and
// adds the 16-bit products of every row; on a 2-core EPYC a 4-row product cost as much as four
// one-row products (perf, 2026-12-06), so the first rows of every verify pass paid full price. Here
// the weights of two column groups are unpacked once per 64 values, a column in each 32-bit lane,
// and each row adds its products with vpdpbusd straight into 32-bit sums, four bytes of its
// activations broadcast from memory.
//
// Every row's result is bitwise the one ggml's gemv gives that row alone (a one-token pass): the
// integer sums are exact on every path (ggml's 16-bit partial sums hold at most 16 products of
// 15 x 127), and the float steps are the gemv's, in its order: per super-block of 256 values, sum x
// (column d x row d) into one accumulator and min-sum x (column dmin x row d) into another, one
// fused multiply-add each, their difference stored at the end. ggml's own gemm rounds every 64
// values instead, so a row's logits depended on how many rows shared its pass (up to 0.56 apart
// at 4-17 rows against one, the 1.5B target after 30 tokens, 2026-12-07), and greedy speculation
// left plain decoding's text at near-ties; with this gemm they were 0 apart at 2-17 rows.
#if defined(__AVX2__)
// Eight 6-bit scales then eight 6-bit mins, one per column, from the 12 bytes make_block_q4_Kx8
// packs them in (ggml's own decode, as its gemm does it).
static inline __m128i homespec_q4k_scales_mins(const uint8_t * packed) {
    uint32_t u[4];
    memcpy(u, packed, 12);
    u[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
    const uint32_t aux = u[1] & 0x3f3f3f3f;
    u[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
    u[2] = aux;
    u[0] &= 0x3f3f3f3f;
    return _mm_loadu_si128((const __m128i *) u);
}

// One repacked super-block of 8 columns (1152 bytes) into L2. The gemm computes while it reads, and
// the hardware prefetcher kept too little of the stream ahead of it: prefetching the next column
// pair one pair ahead made target passes of 4-8 rows 15-25 % cheaper on a 2-core AVX-512 EPYC
// (processes taking turns, 2026-12-07); into L1 it gained a fifth as much.
static inline void homespec_prefetch_q4_Kx8(const block_q4_Kx8 * p) {
    for (size_t line = 0; line < sizeof(block_q4_Kx8); line += 64) {
        _mm_prefetch((const char *) p + line, _MM_HINT_T1);
    }
}

#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define HOMESPEC_Q4K_VNNI 1

// Four activation bytes in every 32-bit lane, read as one 4-byte load that GCC broadcasts from
// memory (a load); a 64-bit load split in registers cost a shift and a broadcast from a general
// register per product (0.63 against 0.50 ms for 4 rows of a 1536 x 8960 weight).
static inline __m512i homespec_bcast4(const int8_t * p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

// 8 values of each column of a column pair (64 weight bytes of each group), unpacked: the low nibbles
// of each column's first and second 32-bit lanes, then the high nibbles of both, a column in each lane.
static inline void homespec_q4k_unpack(const uint8_t * q0, const uint8_t * q1, __m512i even, __m512i odd, __m512i m4, __m512i * w) {
    const __m512i raw0 = _mm512_loadu_si512((const void *) q0);
    const __m512i raw1 = _mm512_loadu_si512((const void *) q1);
    const __m512i first = _mm512_permutex2var_epi32(raw0, even, raw1);
    const __m512i second = _mm512_permutex2var_epi32(raw0, odd, raw1);
    w[0] = _mm512_and_si512(first, m4);
    w[1] = _mm512_and_si512(second, m4);
    w[2] = _mm512_and_si512(_mm512_srli_epi16(first, 4), m4);
    w[3] = _mm512_and_si512(_mm512_srli_epi16(second, 4), m4);
}

// One super-block of a column pair, decoded: each sub-block pair's scales and mins, and where the
// rows share it, its weights unpacked.
struct homespec_q4k_block {
    __m512i scale_lo[QK_K / 64], scale_hi[QK_K / 64];  // [sub-block pair] x 16 columns int32
    __m512i mins[QK_K / 64];  // [sub-block pair] 16-bit pairs (low sub-block's min, high's), one per column lane
    __m512i w[QK_K / 64][4][4];  // [sub-block pair][8 values][homespec_q4k_unpack's four] (4 KiB, in L1)
    __m512 col_d, col_dmin;  // [16 columns]
    const uint8_t * q0, * q1;  // the two column groups' packed weights, for rows that unpack them as they go
};

// ROWS rows' products with one decoded super-block of a column pair, added to their accumulators
// (acc, acc_min: [ROWS] x 16 columns). The first FOURS rows (0 or 4) are four rows interleaved 8
// values at a time (block_q8_Kx4): row r's value k of the super-block at qs[r] + (k / 8) * 32 + k %
// 8, its 16-value sums at bsums[r] + (k / 16) % 4 + (k / 64) * 16; the other rows are rows of their
// own (block_q8_K): qs[r] + k, bsums[r] + k / 16. Row r's scale is d[r]. Every row's integer sums are exact
// and its float steps the gemv's, in its order (the mins, then the sums, one fused multiply-add each
// per super-block): so its result is bitwise the gemv's for it alone, in either layout.
template <int ROWS, int FOURS, bool UNPACK>
static inline void homespec_q4k_rows(const homespec_q4k_block & blk, const int8_t * const * qs, const int16_t * const * bsums,
                                     const float * d, __m512 * acc, __m512 * acc_min, __m512i even, __m512i odd, __m512i m4) {
    __m512i imin[ROWS];  // [row] x 16 columns int32: exact sums of min x activation sum
    for (int r = 0; r < ROWS; r++) {
        imin[r] = _mm512_setzero_si512();
    }
    for (int sb = 0; sb < QK_K / 64; sb++) {
        for (int r = 0; r < ROWS; r++) {
            // The row's sums over each 32-value sub-block, from its four 16-value sums
            const int16_t * bs4 = bsums[r] + (r < FOURS ? 16 : 4) * sb;
            const uint32_t bsum_pair = (uint16_t) (bs4[0] + bs4[1]) | ((uint32_t) (uint16_t) (bs4[2] + bs4[3]) << 16);
            imin[r] = _mm512_add_epi32(imin[r], _mm512_madd_epi16(_mm512_set1_epi32((int32_t) bsum_pair), blk.mins[sb]));
        }
    }
    __m512i isum[ROWS];  // [row] x 16 columns: exact sums of scale x weight x activation
    for (int r = 0; r < ROWS; r++) {
        isum[r] = _mm512_setzero_si512();
    }
    for (int sb = 0; sb < QK_K / 64; sb++) {  // a pair of 32-value sub-blocks: low nibbles, high nibbles
        __m512i dot_lo[ROWS], dot_hi[ROWS];  // [row] x 16 columns int32
        for (int r = 0; r < ROWS; r++) {
            dot_lo[r] = _mm512_setzero_si512();
            dot_hi[r] = _mm512_setzero_si512();
        }
        for (int q = 0; q < 4; q++) {  // 8 values of each column: 4 in the first lane, 4 in the second
            __m512i unpacked[4];
            const __m512i * wq = blk.w[sb][q];
            if constexpr (UNPACK) {
                homespec_q4k_unpack(blk.q0 + 256 * sb + 64 * q, blk.q1 + 256 * sb + 64 * q, even, odd, m4, unpacked);
                wq = unpacked;
            }
            for (int r = 0; r < ROWS; r++) {
                const int step = r < FOURS ? 32 : 8;
                const int8_t * qa_lo = qs[r] + (8 * sb + q) * step;      // k = 64 sb + 8 q + ...
                const int8_t * qa_hi = qs[r] + (8 * sb + 4 + q) * step;  // k = 64 sb + 32 + 8 q + ...
                dot_lo[r] = _mm512_dpbusd_epi32(dot_lo[r], wq[0], homespec_bcast4(qa_lo));
                dot_lo[r] = _mm512_dpbusd_epi32(dot_lo[r], wq[1], homespec_bcast4(qa_lo + 4));
                dot_hi[r] = _mm512_dpbusd_epi32(dot_hi[r], wq[2], homespec_bcast4(qa_hi));
                dot_hi[r] = _mm512_dpbusd_epi32(dot_hi[r], wq[3], homespec_bcast4(qa_hi + 4));
            }
        }
        for (int r = 0; r < ROWS; r++) {
            isum[r] = _mm512_add_epi32(isum[r], _mm512_add_epi32(_mm512_mullo_epi32(dot_lo[r], blk.scale_lo[sb]),
                                                                 _mm512_mullo_epi32(dot_hi[r], blk.scale_hi[sb])));
        }
    }
    for (int r = 0; r < ROWS; r++) {
        const __m512 row_d = _mm512_set1_ps(d[r]);
        acc_min[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(imin[r]), _mm512_mul_ps(blk.col_dmin, row_d), acc_min[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(blk.col_d, row_d), acc[r]);
    }
}

// Rows of a super-block as homespec_q4k_rows takes them: FOURS interleaved ones from a (none where
// null), then REST rows of their own (block_q8_K each, rest[r][ib]).
template <int FOURS, int REST, bool UNPACK>
static inline void homespec_q4k_gather(const homespec_q4k_block & blk, const block_q8_Kx4 * a, const block_q8_K * const * rest, int ib,
                                       __m512 * acc, __m512 * acc_min, __m512i even, __m512i odd, __m512i m4) {
    const int8_t * qs[FOURS + REST];
    const int16_t * bsums[FOURS + REST];
    float d[FOURS + REST];
    for (int r = 0; r < FOURS; r++) {
        qs[r] = a->qs + 8 * r;
        bsums[r] = a->bsums + 4 * r;
        d[r] = a->d[r];
    }
    for (int r = 0; r < REST; r++) {
        qs[FOURS + r] = rest[r][ib].qs;
        bsums[FOURS + r] = rest[r][ib].bsums;
        d[FOURS + r] = rest[r][ib].d;
    }
    homespec_q4k_rows<FOURS + REST, FOURS, UNPACK>(blk, qs, bsums, d, acc, acc_min, even, odd, m4);
}

// Rows in fours, and the 1-3 left over after them (nr % 4; only from the row hook before ggml's
// gemm call, q4k_vnni_rest.cpp, where the 4 rows of each group are interleaved as block_q8_Kx4 and
// the rest follow as block_q8_K each, as ggml quantizes them), columns in groups of 8 (nc % 8 == 0),
// two groups at a time: s[row*bs + col] as ggml's gemm and gemv write it.
//
// Up to GROUPS groups of four rows, and the rest, take each super-block of a column pair in turn,
// its scales decoded and its weights unpacked once for all of them. Done per group, the decode
// (scalar work on 12 packed bytes per column group and sub-block pair) and the unpacking (permutes,
// masks, shifts) took about a third of the gemm at 16 rows (perf, 2026-12-07: 29 % of its samples
// on scalar instructions); and ggml's gemv read the whole weight again for each row left over (a
// 9-row pass cost 1.18x one of 8). One group (passes of 4-7 rows) unpacks the weights where its
// rows and the rest use them, in one loop: storing them for one group cost 10 % more.
template <int GROUPS>
static void homespec_gemm_q4_K_8x8_q8_K_vnni(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx,
                                             const void * GGML_RESTRICT vy, int nr, int nc) {
    const int nb = n / QK_K;  // super-blocks of 256 values per row
    const block_q4_Kx8 * b_start = (const block_q4_Kx8 *) vx;
    const block_q8_Kx4 * a_start = (const block_q8_Kx4 *) vy;
    const int ngroups = nc / 8;
    const int nfours = nr / 4, nrest = nr % 4;
    const block_q8_K * rest[3];  // [row] the rows after the fours, each its nb blocks
    for (int r = 0; r < nrest; r++) {
        rest[r] = (const block_q8_K *) (a_start + (size_t) nfours * nb) + (size_t) r * nb;
    }
    // A load of 64 weight bytes holds 8 columns x 8 values, two 32-bit lanes per column; these
    // gather the first (even) and second (odd) lane of each column of two groups into 16 lanes.
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    alignas(64) homespec_q4k_block blk;

    for (int y0 = 0; y0 < nfours; y0 += GROUPS) {
        const int groups = std::min(GROUPS, nfours - y0);
        const int rows = 4 * groups + (y0 + groups >= nfours ? nrest : 0);  // the rest go with the last fours
        for (int x = 0; x < ngroups; x += 2) {
            const bool pair = x + 1 < ngroups;  // an odd last group runs beside itself, half stored
            const block_q4_Kx8 * b0 = b_start + (size_t) x * nb;
            const block_q4_Kx8 * b1 = pair ? b0 + nb : b0;
            __m512 acc[4 * GROUPS + 3], acc_min[4 * GROUPS + 3];  // [row] x 16 columns
            for (int r = 0; r < 4 * GROUPS + 3; r++) {  // all: a constant count is stores, a variable one a `rep stos` (5 % of the gemm)
                acc[r] = _mm512_setzero_ps();
                acc_min[r] = _mm512_setzero_ps();
            }
            for (int ib = 0; ib < nb; ib++) {
                // the next pair's super-block ib, on the first rows only: the later ones find the
                // weights in cache (prefetching for them too was no faster)
                if (y0 == 0 && x + 2 < ngroups) {
                    homespec_prefetch_q4_Kx8(b0 + 2 * nb + ib);
                    if (x + 3 < ngroups) {
                        homespec_prefetch_q4_Kx8(b1 + 2 * nb + ib);
                    }
                }
                blk.col_d = _mm512_cvtph_ps(_mm256_inserti128_si256(
                    _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *) b0[ib].d)), _mm_loadu_si128((const __m128i *) b1[ib].d), 1));
                blk.col_dmin = _mm512_cvtph_ps(_mm256_inserti128_si256(
                    _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *) b0[ib].dmin)), _mm_loadu_si128((const __m128i *) b1[ib].dmin), 1));
                blk.q0 = b0[ib].qs;
                blk.q1 = b1[ib].qs;
                for (int sb = 0; sb < QK_K / 64; sb++) {
                    const __m128i sm_lo0 = homespec_q4k_scales_mins(b0[ib].scales + 24 * sb);
                    const __m128i sm_lo1 = homespec_q4k_scales_mins(b1[ib].scales + 24 * sb);
                    const __m128i sm_hi0 = homespec_q4k_scales_mins(b0[ib].scales + 12 + 24 * sb);
                    const __m128i sm_hi1 = homespec_q4k_scales_mins(b1[ib].scales + 12 + 24 * sb);
                    blk.scale_lo[sb] = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(sm_lo0, sm_lo1));
                    blk.scale_hi[sb] = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(sm_hi0, sm_hi1));
                    const __m128i min_lo = _mm_unpackhi_epi64(sm_lo0, sm_lo1);  // [16 columns] bytes
                    const __m128i min_hi = _mm_unpackhi_epi64(sm_hi0, sm_hi1);
                    blk.mins[sb] = _mm512_cvtepu8_epi16(_mm256_inserti128_si256(
                        _mm256_castsi128_si256(_mm_unpacklo_epi8(min_lo, min_hi)), _mm_unpackhi_epi8(min_lo, min_hi), 1));
                    if constexpr (GROUPS > 1) {
                        for (int q = 0; q < 4; q++) {
                            homespec_q4k_unpack(b0[ib].qs + 256 * sb + 64 * q, b1[ib].qs + 256 * sb + 64 * q, even, odd, m4, blk.w[sb][q]);
                        }
                    }
                }
                if constexpr (GROUPS == 1) {  // the fours and the rest in one loop, unpacking as it goes
                    const block_q8_Kx4 * a = a_start + ib;
                    switch (nrest) {
                        case 0: homespec_q4k_gather<4, 0, true>(blk, a, rest, ib, acc, acc_min, even, odd, m4); break;
                        case 1: homespec_q4k_gather<4, 1, true>(blk, a, rest, ib, acc, acc_min, even, odd, m4); break;
                        case 2: homespec_q4k_gather<4, 2, true>(blk, a, rest, ib, acc, acc_min, even, odd, m4); break;
                        default: homespec_q4k_gather<4, 3, true>(blk, a, rest, ib, acc, acc_min, even, odd, m4); break;
                    }
                } else {
                    for (int g = 0; g < groups; g++) {
                        const block_q8_Kx4 * a = a_start + (size_t) (y0 + g) * nb + ib;
                        homespec_q4k_gather<4, 0, false>(blk, a, rest, ib, acc + 4 * g, acc_min + 4 * g, even, odd, m4);
                    }
                    switch (rows - 4 * groups) {
                        case 1: homespec_q4k_gather<0, 1, false>(blk, nullptr, rest, ib, acc + 4 * groups, acc_min + 4 * groups, even, odd, m4); break;
                        case 2: homespec_q4k_gather<0, 2, false>(blk, nullptr, rest, ib, acc + 4 * groups, acc_min + 4 * groups, even, odd, m4); break;
                        case 3: homespec_q4k_gather<0, 3, false>(blk, nullptr, rest, ib, acc + 4 * groups, acc_min + 4 * groups, even, odd, m4); break;
                        default: break;
                    }
                }
            }
            for (int r = 0; r < rows; r++) {
                float * out = s + (size_t) (y0 * 4 + r) * bs + (size_t) x * 8;
                _mm512_mask_storeu_ps(out, pair ? (__mmask16) 0xFFFF : (__mmask16) 0x00FF, _mm512_sub_ps(acc[r], acc_min[r]));
            }
        }
    }
}

// One row, or the two or three a gemm leaves over (block_q8_K each, one after the other, as ggml
// quantizes them), against the same weights, 8 columns at a time. The weights are unpacked once per
// 64 values for all rows, and each row's steps are those of ggml's AVX2 gemv for one row: exact
// integer sums per super-block, then one fused multiply-add each for the sums and the mins. So
// every result is bitwise ggml's gemv's for that row alone. ggml ran its gemv once per row, and a
// pass of 3 rows cost more than one of 4 (2-core AVX-512 EPYC: 59 against 45 ms, `homespec bench`'s
// warm-up curve, 2026-12-07).
template <int R>
static void homespec_gemv_q4_K_8x8_q8_K_vnni(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx,
                                             const void * GGML_RESTRICT vy, int nc) {
    const int nb = n / QK_K;  // super-blocks of 256 values
    const block_q4_Kx8 * b_start = (const block_q4_Kx8 *) vx;
    const block_q8_K * a[R];  // [R] each row's blocks
    for (int r = 0; r < R; r++) {
        a[r] = (const block_q8_K *) vy + (size_t) r * nb;
    }
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    // A load of 64 weight bytes holds 8 columns x 8 values, two 32-bit lanes per column:
    // the sums of a column's two lanes, first lanes then second lanes
    const __m512i pairs = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    for (int x = 0; x < nc / 8; x++) {
        const block_q4_Kx8 * b = b_start + (size_t) x * nb;
        __m256 acc[R], acc_min[R];  // [R] x 8 columns
        for (int r = 0; r < R; r++) {
            acc[r] = _mm256_setzero_ps();
            acc_min[r] = _mm256_setzero_ps();
        }
        for (int ib = 0; ib < nb; ib++) {
            if constexpr (R > 1) {  // one row streams at the memory's pace without it
                if (x + 1 < nc / 8) {
                    homespec_prefetch_q4_Kx8(b + nb + ib);  // the next column group's, as the gemm does
                }
            }
            __m512i isum[R];  // [R] x (8 columns x 2 lanes) int32, exact
            __m256i imin[R];  // [R] x 8 columns int32, exact
            for (int r = 0; r < R; r++) {
                isum[r] = _mm512_setzero_si512();
                imin[r] = _mm256_setzero_si256();
            }
            for (int sb = 0; sb < QK_K / 64; sb++) {
                const __m128i sm_lo = homespec_q4k_scales_mins(b[ib].scales + 24 * sb);
                const __m128i sm_hi = homespec_q4k_scales_mins(b[ib].scales + 12 + 24 * sb);
                const __m512i scale_lo = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(sm_lo, sm_lo));
                const __m512i scale_hi = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(sm_hi, sm_hi));
                const __m256i mins = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(sm_lo, sm_hi));
                __m512i dot_lo[R], dot_hi[R];  // [R] x (8 columns x 2 lanes) int32
                for (int r = 0; r < R; r++) {
                    const int16_t * bsums = a[r][ib].bsums + 4 * sb;
                    const int32_t bsum_pair = (int32_t) ((uint16_t) (bsums[0] + bsums[1]) | ((uint32_t) (uint16_t) (bsums[2] + bsums[3]) << 16));
                    imin[r] = _mm256_add_epi32(imin[r], _mm256_madd_epi16(mins, _mm256_set1_epi32(bsum_pair)));
                    dot_lo[r] = _mm512_setzero_si512();
                    dot_hi[r] = _mm512_setzero_si512();
                }
                const uint8_t * q = b[ib].qs + 256 * sb;
                for (int j = 0; j < 4; j++) {
                    const __m512i raw = _mm512_loadu_si512((const void *) (q + 64 * j));
                    const __m512i w_lo = _mm512_and_si512(raw, m4);
                    const __m512i w_hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
                    for (int r = 0; r < R; r++) {
                        const int8_t * qa = a[r][ib].qs + 64 * sb;
                        int64_t a_lo, a_hi;
                        memcpy(&a_lo, qa + 8 * j, 8);
                        memcpy(&a_hi, qa + 32 + 8 * j, 8);
                        dot_lo[r] = _mm512_dpbusd_epi32(dot_lo[r], w_lo, _mm512_set1_epi64(a_lo));
                        dot_hi[r] = _mm512_dpbusd_epi32(dot_hi[r], w_hi, _mm512_set1_epi64(a_hi));
                    }
                }
                for (int r = 0; r < R; r++) {
                    isum[r] = _mm512_add_epi32(isum[r], _mm512_add_epi32(_mm512_mullo_epi32(dot_lo[r], scale_lo), _mm512_mullo_epi32(dot_hi[r], scale_hi)));
                }
            }
            const __m256 col_d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) b[ib].d));
            const __m256 col_dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) b[ib].dmin));
            for (int r = 0; r < R; r++) {
                const __m512i split = _mm512_permutexvar_epi32(pairs, isum[r]);
                const __m256i col_sum = _mm256_add_epi32(_mm512_castsi512_si256(split), _mm512_extracti64x4_epi64(split, 1));
                const __m256 row_d = _mm256_set1_ps(a[r][ib].d);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(col_sum), _mm256_mul_ps(col_d, row_d), acc[r]);
                acc_min[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(imin[r]), _mm256_mul_ps(col_dmin, row_d), acc_min[r]);
            }
        }
        for (int r = 0; r < R; r++) {
            _mm256_storeu_ps(s + (size_t) r * bs + (size_t) x * 8, _mm256_sub_ps(acc[r], acc_min[r]));
        }
    }
}
#endif
