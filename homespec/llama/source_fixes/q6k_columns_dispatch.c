#if defined(__AVX2__)
    // homespec (Q6K_COLUMNS_FIX): a Q6_K weight against several activation rows, each weight block
    // unpacked once for all of them (homespec_vec_dot_q6_K_q8_K_cols); one row keeps ggml's kernel
    if (homespec_q6k_columns_take(dst) && num_rows_per_vec_dot == 1 && ir1_end - ir1_start > 1) {
        for (int64_t iir1 = ir1_start; iir1 < ir1_end; iir1 += blck_1) {
            const int nc = (int) MIN(blck_1, ir1_end - iir1);
            const char * src1_cols = (const char *) wdata + iir1*row_size;
            float * dst_cols = (float *) ((char *) dst->data + iir1*nb1);
            for (int64_t ir0 = ir0_start; ir0 < ir0_end; ++ir0) {
                homespec_vec_dot_q6_K_q8_K_cols((int) ne00, dst_cols + ir0, nb1/sizeof(float),
                                                (const char *) src0->data + ir0*nb01, src1_cols, row_size, nc);
            }
        }
        return;
    }
#endif

