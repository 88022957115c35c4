        // homespec (Q4K_VNNI_FIX, Q4_0_VNNI_FIX): the 2-3 rows the gemm leaves in one call where the
        // x86 kernels take them together (homespec_q4k_gemv_takes_rows, homespec_q4_0_gemv_takes_rows),
        // each row's result bitwise as one at a time
        constexpr bool homespec_q4k_rows = std::is_same_v<BLOC_TYPE, block_q4_K> && PARAM_TYPE == GGML_TYPE_Q8_K;
        constexpr bool homespec_q4_0_rows = std::is_same_v<BLOC_TYPE, block_q4_0> && PARAM_TYPE == GGML_TYPE_Q8_0;
        if constexpr (INTER_SIZE == 8 && NB_COLS == 8 && (homespec_q4k_rows || homespec_q4_0_rows)) {
            const int first = (int) (nrows - (nrows % 4));
            const bool takes = homespec_q4k_rows ? homespec_q4k_gemv_takes_rows && homespec_q4k_gemv_takes_rows()
                                                 : homespec_q4_0_gemv_takes_rows && homespec_q4_0_gemv_takes_rows((int) ne00);
            if (nrows - first > 1 && takes) {
                gemv<BLOC_TYPE, INTER_SIZE, NB_COLS, PARAM_TYPE>(ne00, (float *) (dst_ptr + (first * nb1)) + src0_start,
                                                                 nb1 / nb0, src0_ptr + src0_start * nb01,
                                                                 src1_ptr + (src1_col_stride * first), (int) (nrows - first), ncols);
                return;
            }
        }
