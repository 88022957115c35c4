// homespec (cpu_build.py, Q4K_VNNI_FIX, builds without AVX-512 VNNI): the same products as
// q4k_vnni.cpp with AVX2 alone (maddubs), for CPUs such as AVX2-only EPYCs: rows in fours
// (block_q8_Kx4), the 1-3 after them in the same call, and 2-3 rows alone (block_q8_K). One row
// stays with ggml's AVX2 gemv, which is the reference every row here matches.
//
// ggml's AVX2 gemm for this layout rounds every 64 values and widens and shuffles every row's
// 16-bit products; with it a pass of 4 rows cost 1.7x one of 1 and 17 rows 5.4x (2-core Xeon
// limited to AVX2, scripts/as_cpu.sh, 2026-12-07), and greedy speculation left plain decoding's
// text at near-ties (0 of 3 chat prompts). Here 4 columns x 8 values are one 32-byte load, used
// as loaded: a row's 8 values are one 64-bit broadcast, maddubs gives 16-bit pair sums that add
// up in 16 bits over a 32-value sub-block (8 products of 15 x 128 at most: 15,360), and one
// madd by the sub-block's scales turns them into 32-bit sums. Every sum is exact and the float
// steps are the gemv's, in its order (q4k_vnni.cpp's header): every row's result is bitwise what
// ggml's gemv gives that row alone.
#if !defined(HOMESPEC_Q4K_VNNI) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HOMESPEC_Q4K_AVX2 1

// A sub-block's 8 column scales (bytes 0-7 of homespec_q4k_scales_mins), each in the four 16-bit
// lanes its column's 8 values fill after maddubs: columns 0-3 in one register, 4-7 in the other.
static inline void homespec_q4k_avx2_scales(__m128i scales, __m256i * s0123, __m256i * s4567) {
    const __m128i s16 = _mm_cvtepu8_epi16(scales);      // [8 columns] int16
    const __m128i lo = _mm_unpacklo_epi16(s16, s16);    // c0 c0 c1 c1 c2 c2 c3 c3
    const __m128i hi = _mm_unpackhi_epi16(s16, s16);    // c4 c4 ... c7 c7
    *s0123 = _mm256_set_m128i(_mm_unpackhi_epi32(lo, lo), _mm_unpacklo_epi32(lo, lo));
    *s4567 = _mm256_set_m128i(_mm_unpackhi_epi32(hi, hi), _mm_unpacklo_epi32(hi, hi));
}

// One super-block of a column group, decoded once for all of a pass's rows (2.2 KiB, in L1): its
// weights unpacked, its scales in the lanes they multiply, its mins, its columns' d and dmin.
struct homespec_q4k_avx2_block {
    __m256i w[QK_K / 64][2][4][2];      // [sub-block pair][low, high nibbles][8 values j][columns 0-3, 4-7] bytes
    __m256i scale[QK_K / 64][2][2];     // [sub-block pair][low, high][columns 0-3, 4-7] int16, 4 lanes per column
    __m256i mins[QK_K / 64];            // [sub-block pair] (low's, high's) int16 pair per column
    __m256 col_d, col_dmin;             // [8 columns]
};

static inline void homespec_q4k_avx2_decode(const block_q4_Kx8 * b, homespec_q4k_avx2_block * blk) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int sb = 0; sb < QK_K / 64; sb++) {
        const __m128i sm_lo = homespec_q4k_scales_mins(b->scales + 24 * sb);
        const __m128i sm_hi = homespec_q4k_scales_mins(b->scales + 12 + 24 * sb);
        blk->mins[sb] = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(sm_lo, sm_hi));
        homespec_q4k_avx2_scales(sm_lo, &blk->scale[sb][0][0], &blk->scale[sb][0][1]);
        homespec_q4k_avx2_scales(sm_hi, &blk->scale[sb][1][0], &blk->scale[sb][1][1]);
        const uint8_t * q = b->qs + 256 * sb;
        for (int j = 0; j < 4; j++) {
            for (int c = 0; c < 2; c++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *) (q + 64 * j + 32 * c));
                blk->w[sb][0][j][c] = _mm256_and_si256(raw, m4);
                blk->w[sb][1][j][c] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
            }
        }
    }
    blk->col_d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) b->d));
    blk->col_dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) b->dmin));
}

// ROWS (1-4) rows' products with one decoded super-block of a column group, added to their
// accumulators (acc, acc_min: [ROWS] x 8 columns). Row r's value k of the super-block is at
// qs[r] + (k / 8) * step + k % 8, step 32 for the first FOURS rows (interleaved, block_q8_Kx4) and 8
// for the others (block_q8_K); its 16-value sums at bsums[r] + (k / 64) * (16 or 4) + (k / 16) % 4.
template <int ROWS, int FOURS>
static inline void homespec_q4k_avx2_rows(const homespec_q4k_avx2_block & blk, const int8_t * const * qs, const int16_t * const * bsums,
                                          const float * d, __m256 * acc, __m256 * acc_min) {
    __m256i isum[ROWS][2];  // [row][columns 0-3, 4-7] x (column x 2 lanes) int32, exact
    __m256i imin[ROWS];     // [row] x 8 columns int32, exact
    for (int r = 0; r < ROWS; r++) {
        isum[r][0] = isum[r][1] = imin[r] = _mm256_setzero_si256();
    }
    for (int sb = 0; sb < QK_K / 64; sb++) {  // a pair of 32-value sub-blocks: low nibbles, high nibbles
        for (int r = 0; r < ROWS; r++) {
            const int16_t * bs4 = bsums[r] + (r < FOURS ? 16 : 4) * sb;
            const uint32_t bsum_pair = (uint16_t) (bs4[0] + bs4[1]) | ((uint32_t) (uint16_t) (bs4[2] + bs4[3]) << 16);
            imin[r] = _mm256_add_epi32(imin[r], _mm256_madd_epi16(blk.mins[sb], _mm256_set1_epi32((int32_t) bsum_pair)));
        }
        for (int half = 0; half < 2; half++) {
            __m256i dot[ROWS][2];  // [row][columns 0-3, 4-7] x 16 lanes int16
            for (int r = 0; r < ROWS; r++) {
                dot[r][0] = dot[r][1] = _mm256_setzero_si256();
            }
            for (int j = 0; j < 4; j++) {  // values 8j..8j+7 of the sub-block: 8 bytes per column
                const __m256i w0 = blk.w[sb][half][j][0], w1 = blk.w[sb][half][j][1];
                for (int r = 0; r < ROWS; r++) {
                    int64_t a;  // k = 64 sb + 32 half + 8 j
                    memcpy(&a, qs[r] + (8 * sb + 4 * half + j) * (r < FOURS ? 32 : 8), 8);
                    const __m256i av = _mm256_set1_epi64x(a);
                    dot[r][0] = _mm256_add_epi16(dot[r][0], _mm256_maddubs_epi16(w0, av));
                    dot[r][1] = _mm256_add_epi16(dot[r][1], _mm256_maddubs_epi16(w1, av));
                }
            }
            for (int r = 0; r < ROWS; r++) {
                isum[r][0] = _mm256_add_epi32(isum[r][0], _mm256_madd_epi16(dot[r][0], blk.scale[sb][half][0]));
                isum[r][1] = _mm256_add_epi32(isum[r][1], _mm256_madd_epi16(dot[r][1], blk.scale[sb][half][1]));
            }
        }
    }
    for (int r = 0; r < ROWS; r++) {
        // a column's two lanes added: c0 c1 c4 c5 | c2 c3 c6 c7, then in column order
        const __m256i cols = _mm256_permute4x64_epi64(_mm256_hadd_epi32(isum[r][0], isum[r][1]), 0xD8);
        const __m256 row_d = _mm256_set1_ps(d[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(cols), _mm256_mul_ps(blk.col_d, row_d), acc[r]);
        acc_min[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(imin[r]), _mm256_mul_ps(blk.col_dmin, row_d), acc_min[r]);
    }
}

// 1-3 rows of their own (block_q8_K each) against super-block ib of a column group, decoded.
static inline void homespec_q4k_avx2_rest(const homespec_q4k_avx2_block & blk, const block_q8_K * const * rest, int nrest, int ib,
                                          __m256 * acc, __m256 * acc_min) {
    const int8_t * qs[3];
    const int16_t * bsums[3];
    float d[3];
    for (int r = 0; r < nrest; r++) {
        qs[r] = rest[r][ib].qs;
        bsums[r] = rest[r][ib].bsums;
        d[r] = rest[r][ib].d;
    }
    switch (nrest) {
        case 1: homespec_q4k_avx2_rows<1, 0>(blk, qs, bsums, d, acc, acc_min); break;
        case 2: homespec_q4k_avx2_rows<2, 0>(blk, qs, bsums, d, acc, acc_min); break;
        case 3: homespec_q4k_avx2_rows<3, 0>(blk, qs, bsums, d, acc, acc_min); break;
        default: break;
    }
}

// nfours groups of four interleaved rows (block_q8_Kx4, nb blocks each) then nrest rows of their
// own (block_q8_K, nb blocks each), columns in groups of 8: s[row*bs + col] as ggml's gemm and
// gemv write it. Up to 4 groups and the rest take each super-block of a column group in turn,
// decoded once for all of them: decoded per group of rows, a 16-row product cost 0.81x ggml's, now
// 0.68x (scripts/q4k_gemm_cost.c, 2-core AVX2 EPYC, 2026-12-07).
static void homespec_q4k_avx2(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx,
                              const block_q8_Kx4 * fours, int nfours, const block_q8_K * rest0, int nrest, int nc) {
    constexpr int GROUPS = 4;
    const int nb = n / QK_K;  // super-blocks of 256 values per row
    const int ngroups = nc / 8;
    const block_q4_Kx8 * b_start = (const block_q4_Kx8 *) vx;
    const block_q8_K * rest[3];  // [row] each its nb blocks
    for (int r = 0; r < nrest; r++) {
        rest[r] = rest0 + (size_t) r * nb;
    }
    alignas(32) homespec_q4k_avx2_block blk;
    const int nchunks = std::max(1, (nfours + GROUPS - 1) / GROUPS);
    for (int c = 0; c < nchunks; c++) {
        const int y0 = c * GROUPS;
        const int groups = std::min(GROUPS, nfours - y0);
        const int extra = c == nchunks - 1 ? nrest : 0;  // the rest go with the last fours
        for (int x = 0; x < ngroups; x++) {
            const block_q4_Kx8 * b = b_start + (size_t) x * nb;
            __m256 acc[4 * GROUPS + 3], acc_min[4 * GROUPS + 3];  // [row] x 8 columns
            for (int r = 0; r < 4 * GROUPS + 3; r++) {
                acc[r] = acc_min[r] = _mm256_setzero_ps();
            }
            for (int ib = 0; ib < nb; ib++) {
                if (c == 0 && x + 1 < ngroups) {  // the next group's, on the first rows only (q4k_vnni.cpp)
                    homespec_prefetch_q4_Kx8(b + nb + ib);
                }
                homespec_q4k_avx2_decode(b + ib, &blk);
                for (int g = 0; g < groups; g++) {
                    const block_q8_Kx4 * a = fours + (size_t) (y0 + g) * nb + ib;
                    const int8_t * qs[4] = { a->qs, a->qs + 8, a->qs + 16, a->qs + 24 };
                    const int16_t * bsums[4] = { a->bsums, a->bsums + 4, a->bsums + 8, a->bsums + 12 };
                    homespec_q4k_avx2_rows<4, 4>(blk, qs, bsums, a->d, acc + 4 * g, acc_min + 4 * g);
                }
                homespec_q4k_avx2_rest(blk, rest, extra, ib, acc + 4 * groups, acc_min + 4 * groups);
            }
            for (int r = 0; r < 4 * groups + extra; r++) {
                const int row = r < 4 * groups ? 4 * y0 + r : 4 * nfours + (r - 4 * groups);
                _mm256_storeu_ps(s + (size_t) row * bs + (size_t) x * 8, _mm256_sub_ps(acc[r], acc_min[r]));
            }
        }
    }
}

// Rows in fours and the 1-3 after them (q4k_vnni_rest.cpp's call), as ggml's gemm takes them.
static void homespec_gemm_q4_K_8x8_q8_K_avx2(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx,
                                             const void * GGML_RESTRICT vy, int nr, int nc) {
    const int nb = n / QK_K;
    const block_q8_Kx4 * fours = (const block_q8_Kx4 *) vy;
    homespec_q4k_avx2(n, s, bs, vx, fours, nr / 4, (const block_q8_K *) (fours + (size_t) (nr / 4) * nb), nr % 4, nc);
}

// 2-3 rows of their own in one call (q4k_vnni_rows.cpp's), the weights read once for all.
static void homespec_gemv_q4_K_8x8_q8_K_avx2(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx,
                                             const void * GGML_RESTRICT vy, int nr, int nc) {
    homespec_q4k_avx2(n, s, bs, vx, nullptr, 0, (const block_q8_K *) vy, nr, nc);
}
#endif
