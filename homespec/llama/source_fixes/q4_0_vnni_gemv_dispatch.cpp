#if defined(HOMESPEC_Q4_0_VNNI)
    // homespec (Q4_0_VNNI_FIX): one row with VNNI, or 2-3 rows at once
    if (n / QK8_0 <= HOMESPEC_Q4_0_MAX_BLOCKS) {
        if (nr == 1 && homespec_q4_0_vnni.load(std::memory_order_relaxed)) {
            homespec_gemv_q4_0_8x8_q8_0_vnni<1>(n, s, bs, vx, vy, nc);
            return;
        }
        // 2-3 rows come only from the row loop after homespec_q4_0_gemv_takes_rows() said so: taken
        // even if the switch went off since, as ggml's code below would compute only the first
        if (nr == 2) {
            homespec_gemv_q4_0_8x8_q8_0_vnni<2>(n, s, bs, vx, vy, nc);
            return;
        }
        if (nr == 3) {
            homespec_gemv_q4_0_8x8_q8_0_vnni<3>(n, s, bs, vx, vy, nc);
            return;
        }
    }
#endif
