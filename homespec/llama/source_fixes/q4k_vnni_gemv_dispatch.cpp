#if defined(HOMESPEC_Q4K_VNNI)
    // homespec (Q4K_VNNI_FIX): one row with VNNI
    if (nr == 1 && homespec_q4k_vnni.load(std::memory_order_relaxed)) {
        homespec_gemv_q4_K_8x8_q8_K_vnni(n, s, vx, vy, nc);
        return;
    }
#endif
