        // homespec (Q4K_VNNI_FIX): the 1-3 rows after the fours in the same call as the fours, where the
        // x86 kernel takes them (homespec_q4k_gemv_takes_rows): each block of weights is then read
        // and unpacked once for all rows, each row's result still bitwise as one at a time
        if constexpr (INTER_SIZE == 8 && NB_COLS == 8 && std::is_same_v<BLOC_TYPE, block_q4_K> && PARAM_TYPE == GGML_TYPE_Q8_K) {
            if (nrows > 4 && nrows % 4 != 0 && homespec_q4k_gemv_takes_rows && homespec_q4k_gemv_takes_rows()) {
                gemm<BLOC_TYPE, INTER_SIZE, NB_COLS, PARAM_TYPE>(ne00, (float *) (dst_ptr) + src0_start, nb1 / nb0,
                                                                 src0_ptr + src0_start * nb01, src1_ptr, (int) nrows, ncols);
                return;
            }
        }
