#if defined(HOMESPEC_Q4K_VNNI)
    // homespec (Q4K_VNNI_FIX): one row with VNNI, or 2-3 rows at once
    if (nr == 1 && homespec_q4k_vnni.load(std::memory_order_relaxed)) {
        homespec_gemv_q4_K_8x8_q8_K_vnni<1>(n, s, bs, vx, vy, nc);
        return;
    }
    // 2-3 rows come only from the row loop after homespec_q4k_gemv_takes_rows() said so: taken even
    // if the switch went off since, as ggml's code below would compute only the first
    if (nr == 2) {
        homespec_gemv_q4_K_8x8_q8_K_vnni<2>(n, s, bs, vx, vy, nc);
        return;
    }
    if (nr == 3) {
        homespec_gemv_q4_K_8x8_q8_K_vnni<3>(n, s, bs, vx, vy, nc);
        return;
    }
#elif defined(HOMESPEC_Q4K_AVX2)
    // homespec (Q4K_VNNI_FIX, AVX2): one row stays with ggml's code below; 2-3 rows (from the row
    // loop, as above) in one call
    if (nr > 1) {
        homespec_gemv_q4_K_8x8_q8_K_avx2(n, s, bs, vx, vy, nr, nc);
        return;
    }
#endif
