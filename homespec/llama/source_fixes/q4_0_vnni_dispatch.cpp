#if defined(HOMESPEC_Q4_0_VNNI)
    // homespec (Q4_0_VNNI_FIX): rows in fours with VNNI, every result bitwise ggml's below
    if (n / QK8_0 <= HOMESPEC_Q4_0_MAX_BLOCKS && homespec_q4_0_vnni.load(std::memory_order_relaxed)) {
        homespec_gemm_q4_0_8x8_q8_0_vnni(n, s, bs, vx, vy, nr, nc);
        return;
    }
#endif
