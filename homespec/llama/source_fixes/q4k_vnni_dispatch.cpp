#if defined(HOMESPEC_Q4K_VNNI)
    // homespec (Q4K_VNNI_FIX): rows in fours with VNNI, every row's result bitwise the gemv's for it alone
    if (homespec_q4k_vnni.load(std::memory_order_relaxed)) {
        homespec_gemm_q4_K_8x8_q8_K_vnni(n, s, bs, vx, vy, nr, nc);
        return;
    }
#endif
