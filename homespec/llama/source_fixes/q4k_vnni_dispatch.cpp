#if defined(HOMESPEC_Q4K_ROWS)
    // homespec (Q4K_VNNI_FIX): rows in fours with VNNI or AVX2, every row's result bitwise the gemv's
    // for it alone; rows past a multiple of four come only from the hook before ggml's call
    // (q4k_vnni_rest.cpp) after homespec_q4k_gemv_takes_rows() said so: taken even if the switch went
    // off since, as ggml's code below takes rows in fours only
    if (homespec_q4k_vnni.load(std::memory_order_relaxed) || nr % 4 != 0) {
#if defined(HOMESPEC_Q4K_VNNI)
        if (nr < 8) {
            homespec_gemm_q4_K_8x8_q8_K_vnni<1>(n, s, bs, vx, vy, nr, nc);
        } else {
            homespec_gemm_q4_K_8x8_q8_K_vnni<4>(n, s, bs, vx, vy, nr, nc);
        }
#else
        homespec_gemm_q4_K_8x8_q8_K_avx2(n, s, bs, vx, vy, nr, nc);
#endif
        return;
    }
#endif
