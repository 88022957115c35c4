// homespec (cpu_build.py, FA_GROUPED_FIX): flash attention for passes of fewer query rows than
// ggml's tile of 64 (a verify pass, a decode step). ggml 0.25.3 takes such a pass one query row
// and head at a time, reading the whole history once per query head and accumulating V in f16.
// Here the rows of every query head that shares one KV head form one tile: each K row of the
// history is read once for all of them (K·Q by dot products, Q rounded to f16 as llama.cpp's
// matrix product without flash attention rounds it), each V tile is converted to f32 once, and
// the online softmax and the V sum run in f32 as in ggml's tiled kernel. Row t of the tile is
// query head ik2*rk2 + t/n_rows, query row iq1_0 + t%n_rows.
static void ggml_compute_forward_flash_attn_ext_grouped(
        const ggml_compute_params * params,
        ggml_tensor * dst,
        int64_t iq3, int64_t ik2, int64_t iq1_0, int64_t n_rows) {
    const ggml_tensor * q     = dst->src[0];
    const ggml_tensor * k     = dst->src[1];
    const ggml_tensor * v     = dst->src[2];
    const ggml_tensor * mask  = dst->src[3];
    const ggml_tensor * sinks = dst->src[4];

    GGML_TENSOR_LOCALS(int64_t, neq, q,   ne)
    GGML_TENSOR_LOCALS(size_t,  nbq, q,   nb)
    GGML_TENSOR_LOCALS(int64_t, nek, k,   ne)
    GGML_TENSOR_LOCALS(size_t,  nbk, k,   nb)
    GGML_TENSOR_LOCALS(int64_t, nev, v,   ne)
    GGML_TENSOR_LOCALS(size_t,  nbv, v,   nb)
    GGML_TENSOR_LOCALS(int64_t, ne,  dst, ne)
    GGML_TENSOR_LOCALS(size_t,  nb,  dst, nb)

    const int64_t DK = nek0;
    const int64_t DV = nev0;

    const int64_t rk2 = neq2/nek2;  // query heads per KV head (nev2 == nek2: checked by the caller)
    const int64_t ik3 = iq3/(neq3/nek3);
    const int64_t iv3 = iq3/(neq3/nev3);
    const ggml_type kv_type = k->type;

    float scale         = 1.0f;
    float max_bias      = 0.0f;
    float logit_softcap = 0.0f;

    memcpy(&scale,         (float *) dst->op_params + 0, sizeof(float));
    memcpy(&max_bias,      (float *) dst->op_params + 1, sizeof(float));
    memcpy(&logit_softcap, (float *) dst->op_params + 2, sizeof(float));

    if (logit_softcap != 0) {
        scale /= logit_softcap;
    }

    const uint32_t n_head      = neq2;
    const uint32_t n_head_log2 = 1u << (uint32_t) floor(log2(n_head));

    const float m0 = powf(2.0f, -(max_bias       ) / n_head_log2);
    const float m1 = powf(2.0f, -(max_bias / 2.0f) / n_head_log2);

    static constexpr int Q_TILE_SZ  = ggml_fa_tile_config::Q;
    static constexpr int KV_TILE_SZ = ggml_fa_tile_config::KV;

    const int M = (int) (rk2*n_rows);  // rows of the tile
    GGML_ASSERT(M <= Q_TILE_SZ);

    // the tiled kernel's per-thread scratch (ggml_graph_plan sizes it)
    float * base   = (float *) params->wdata + params->ith*(Q_TILE_SZ*DK + 2*Q_TILE_SZ*KV_TILE_SZ + Q_TILE_SZ*DV + KV_TILE_SZ*DV + KV_TILE_SZ*DK + CACHE_LINE_SIZE_F32);
    float * Q_f32  = base;
    float * KQ     = Q_f32 + Q_TILE_SZ*DK;
    float * mask32 = KQ + Q_TILE_SZ*KV_TILE_SZ;
    float * VKQ32  = mask32 + Q_TILE_SZ*KV_TILE_SZ;
    float * V32    = VKQ32 + Q_TILE_SZ*DV;
    float * K_f32  = V32 + KV_TILE_SZ*DV;

    float S[Q_TILE_SZ];
    float Mx[Q_TILE_SZ];
    float slope[Q_TILE_SZ];
    const ggml_fp16_t * mask_row[Q_TILE_SZ];

    for (int t = 0; t < M; t++) {
        const int64_t h  = ik2*rk2 + t/n_rows;
        const int64_t i1 = iq1_0 + t%n_rows;
        memcpy(Q_f32 + t*DK, (const char *) q->data + (i1*nbq1 + h*nbq2 + iq3*nbq3), DK*sizeof(float));
        slope[t] = (max_bias > 0.0f) ? h < n_head_log2 ? powf(m0, h + 1) : powf(m1, 2*(h - n_head_log2) + 1) : 1.0f;
        mask_row[t] = mask ? (const ggml_fp16_t *) ((const char *) mask->data + i1*mask->nb[1] + (h%mask->ne[2])*mask->nb[2] + (iq3%mask->ne[3])*mask->nb[3]) : nullptr;
        S[t]  = 0.0f;
        Mx[t] = -INFINITY;
    }

    ggml_fp16_t * Q_f16 = (ggml_fp16_t *) K_f32;
    if (kv_type == GGML_TYPE_F16) {
        ggml_cpu_fp32_to_fp16(Q_f32, Q_f16, M*DK);
    }

    memset(VKQ32,  0, M*DV*sizeof(float));
    memset(mask32, 0, M*KV_TILE_SZ*sizeof(float));
    memset(V32,    0, KV_TILE_SZ*DV*sizeof(float));

    for (int64_t ic = 0; ic < nek1; ic += KV_TILE_SZ) {
        const int kv_tile = (int) std::min((int64_t) KV_TILE_SZ, nek1 - ic);

        if (mask) {
            bool can_skip = true;
            for (int t = 0; t < M; t++) {
                float * m32 = mask32 + t*KV_TILE_SZ;
                for (int tk = 0; tk < kv_tile; tk++) {
                    m32[tk] = slope[t]*GGML_CPU_FP16_TO_FP32(mask_row[t][ic + tk]);
                    can_skip &= m32[tk] == -INFINITY;
                }
                for (int tk = kv_tile; tk < KV_TILE_SZ; tk++) {
                    m32[tk] = -INFINITY;
                }
            }
            if (can_skip) {
                continue;
            }
        }

        // K·Q by dot products over the tile's KV positions, each K row read in its own type (as
        // llama.cpp's matrix product without flash attention reads it): converting the tile to f32
        // and transposing it for a GEMM costs more than the few rows of such a pass can repay
        for (int tk = 0; tk < kv_tile; tk++) {
            const char * k_data = (const char *) k->data + (ic + tk)*nbk1 + ik2*nbk2 + ik3*nbk3;
            for (int t = 0; t < M; t++) {
                if (kv_type == GGML_TYPE_F16) {
                    ggml_vec_dot_f16(DK, KQ + t*KV_TILE_SZ + tk, 0, (ggml_fp16_t *) k_data, 0, Q_f16 + t*DK, 0, 1);
                } else {
                    ggml_vec_dot_f32(DK, KQ + t*KV_TILE_SZ + tk, 0, (const float *) k_data, 0, Q_f32 + t*DK, 0, 1);
                }
            }
        }
        ggml_vec_scale_f32(M*KV_TILE_SZ, KQ, scale);

        if (logit_softcap != 0.0f) {
            ggml_vec_tanh_f32(M*KV_TILE_SZ, KQ, KQ);
            ggml_vec_scale_f32(M*KV_TILE_SZ, KQ, logit_softcap);
        }

        for (int t = 0; t < M; t++) {
            for (int tk = kv_tile; tk < KV_TILE_SZ; tk++) {
                KQ[t*KV_TILE_SZ + tk] = -INFINITY;
            }
        }

        if (mask) {
            ggml_vec_add_f32(M*KV_TILE_SZ, KQ, KQ, mask32);
        }

        for (int t = 0; t < M; t++) {
            float * kq_row = KQ + t*KV_TILE_SZ;

            float tile_max;
            ggml_vec_max_f32(KV_TILE_SZ, &tile_max, kq_row);

            if (tile_max == -INFINITY) {
                memset(kq_row, 0, KV_TILE_SZ*sizeof(float));  // nothing of this tile for this row
                continue;
            }

            const float Mold = Mx[t];
            const float Mnew = fmaxf(Mold, tile_max);

            if (Mnew > Mold) {
                const float ms = expf(Mold - Mnew);
                ggml_vec_scale_f32(DV, VKQ32 + t*DV, ms);
                S[t] *= ms;
            }
            Mx[t] = Mnew;

            S[t] += ggml_vec_soft_max_f32(KV_TILE_SZ, kq_row, kq_row, Mnew);
        }

        for (int tk = 0; tk < kv_tile; tk++) {
            const char * v_data = (const char *) v->data + (ic + tk)*nbv1 + ik2*nbv2 + iv3*nbv3;
            if (kv_type == GGML_TYPE_F16) {
                ggml_cpu_fp16_to_fp32((const ggml_fp16_t *) v_data, V32 + tk*DV, DV);
            } else {
                memcpy(V32 + tk*DV, v_data, DV*sizeof(float));
            }
        }
        simd_gemm(VKQ32, KQ, V32, M, KV_TILE_SZ, DV);
    }

    for (int t = 0; t < M; t++) {
        const int64_t h  = ik2*rk2 + t/n_rows;
        const int64_t i1 = iq1_0 + t%n_rows;

        if (sinks) {
            const float s = ((const float *) sinks->data)[h];
            float ms = 1.0f;
            float vs = 1.0f;
            if (s > Mx[t]) {
                ms = expf(Mx[t] - s);
                ggml_vec_scale_f32(DV, VKQ32 + t*DV, ms);
            } else {
                vs = expf(s - Mx[t]);
            }
            S[t] = S[t]*ms + vs;
        }

        const float S_inv = S[t] == 0.0f ? 0.0f : 1.0f/S[t];
        ggml_vec_scale_f32(DV, VKQ32 + t*DV, S_inv);

        // permute(0, 2, 1, 3)
        memcpy((char *) dst->data + (iq3*ne2*ne1 + h + i1*ne1)*nb1, VKQ32 + t*DV, nb1);
    }
}

