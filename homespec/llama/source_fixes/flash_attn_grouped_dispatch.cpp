    // homespec (FA_GROUPED_FIX): passes of up to 65 query rows (every verify pass of a draft of up
    // to 64 tokens, speculation.k_max's default: ggml's tiled kernel would take those of 64-65 and
    // give their rows other bits than a one-row pass) go through the grouped kernel, one unit of
    // work per KV head of each stream (and per block of rows where there are more threads than
    // that), ahead of the split over the history that one row after 512 positions takes; with
    // fewer units than threads, ggml's own paths as before
    {
        const int64_t rk2g = (nek2 > 0 && neq2 % nek2 == 0) ? neq2/nek2 : 0;
        bool use_grouped = !use_ref && rk2g > 0 && rk2g <= (int64_t) ggml_fa_tile_config::Q && nev2 == nek2 &&
                           q->type == GGML_TYPE_F32 && kv_is_f32_or_f16 && k->type == v->type &&
                           neq1 <= 65;
#if defined(GGML_SIMD) && !defined(__x86_64__) && !defined(_M_X64)
#if defined(__ARM_FEATURE_SVE)
        use_grouped &= (DV % svcntw() == 0);
#else
        use_grouped &= (DV % GGML_F32_EPR == 0);
#endif
#endif
        if (use_grouped) {
            const int64_t rows_max = (int64_t) ggml_fa_tile_config::Q / rk2g;  // query rows in a tile
            const int64_t groups   = neq3*nek2;
            const int64_t blocks   = std::min(neq1, std::max((neq1 + rows_max - 1)/rows_max, (nth + groups - 1)/groups));
            const int64_t rows     = (neq1 + blocks - 1)/blocks;
            const int64_t n_blocks = (neq1 + rows - 1)/rows;
            const int64_t n_units  = groups*n_blocks;
            if (n_units >= nth) {
                if (ith == 0) {
                    ggml_threadpool_chunk_set(params->threadpool, nth);
                }
                ggml_barrier(params->threadpool);
                for (int64_t u = ith; u < n_units; u = ggml_threadpool_chunk_add(params->threadpool, 1)) {
                    const int64_t g     = u / n_blocks;
                    const int64_t iq1_0 = (u % n_blocks)*rows;
                    ggml_compute_forward_flash_attn_ext_grouped(params, dst, g / nek2, g % nek2, iq1_0, std::min(rows, neq1 - iq1_0));
                }
                return;
            }
        }
    }

