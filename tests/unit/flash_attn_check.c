// ggml_flash_attn_ext in the installed llama.cpp build against a float64 reference: passes of n
// query rows over a history of n_kv positions, with the target's heads (12 query heads on 2 KV
// heads, 128 wide), f16 K and V, a causal f16 mask that also hides the first positions (cells of
// another sequence), one or four KV streams, 1-8 threads. tests/unit/test_flash_attention_kernel.py
// compiles and runs it.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "ggml.h"
#include "ggml-cpu.h"

#define N_HEAD 12
#define N_HEAD_KV 2

static float frand(unsigned * s) { *s = *s * 1103515245u + 12345u; return ((*s >> 8) & 0xffff) / 32768.0f - 1.0f; }

static double check(int n_rows, int n_kv, int n_head, int n_head_kv, int D, int ne3, int n_threads, float scale) {
    struct ggml_init_params ip = { (size_t) 512 << 20, NULL, false };
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * q = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, D, n_rows, n_head, ne3);
    struct ggml_tensor * k = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, D, n_kv, n_head_kv, ne3);
    struct ggml_tensor * v = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, D, n_kv, n_head_kv, ne3);
    struct ggml_tensor * m = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, n_kv, n_rows, 1, 1);
    unsigned s = 42u + n_rows * 7u + n_kv;
    float * qd = q->data;
    for (int64_t i = 0; i < ggml_nelements(q); i++) qd[i] = 2.0f * frand(&s);
    ggml_fp16_t * kd = k->data, * vd = v->data, * md = m->data;
    for (int64_t i = 0; i < ggml_nelements(k); i++) kd[i] = ggml_fp32_to_fp16(2.0f * frand(&s));
    for (int64_t i = 0; i < ggml_nelements(v); i++) vd[i] = ggml_fp32_to_fp16(frand(&s));
    // causal over a history: row r sees positions <= n_kv - n_rows + r; position 0..2 hidden too
    // (cells of another sequence), so some rows see no position of a first tile
    for (int r = 0; r < n_rows; r++)
        for (int c = 0; c < n_kv; c++)
            md[r * n_kv + c] = ggml_fp32_to_fp16((c <= n_kv - n_rows + r && c >= 3) ? 0.0f : -INFINITY);
    struct ggml_tensor * out = ggml_flash_attn_ext(ctx, q, k, v, m, scale, 0.0f, 0.0f);
    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    ggml_graph_compute_with_ctx(ctx, gf, n_threads);
    // reference; out: [D, n_head, n_rows, ne3]
    double worst = 0.0;
    double * p = malloc(sizeof(double) * n_kv), * acc = malloc(sizeof(double) * D);
    float * vf = malloc(sizeof(float) * ggml_nelements(v));  // V as f32, for the reference's sums
    for (int64_t i = 0; i < ggml_nelements(v); i++) vf[i] = ggml_fp16_to_fp32(vd[i]);
    for (int i3 = 0; i3 < ne3; i3++)
    for (int h = 0; h < n_head; h++) {
        int hk = h / (n_head / n_head_kv);
        for (int r = 0; r < n_rows; r++) {
            const float * qr = qd + ((int64_t) i3 * n_head * n_rows + (int64_t) h * n_rows + r) * D;
            double mx = -INFINITY, sum = 0.0;
            for (int c = 0; c < n_kv; c++) {
                double dot = 0.0;
                const ggml_fp16_t * kr = kd + ((int64_t) i3 * n_head_kv * n_kv + (int64_t) hk * n_kv + c) * D;
                for (int d = 0; d < D; d++) dot += (double) qr[d] * ggml_fp16_to_fp32(kr[d]);
                p[c] = dot * scale + ggml_fp16_to_fp32(md[r * n_kv + c]);
                if (p[c] > mx) mx = p[c];
            }
            for (int c = 0; c < n_kv; c++) { p[c] = exp(p[c] - mx); sum += p[c]; }
            const float * o = (const float *) out->data + ((int64_t) i3 * n_rows * n_head + (int64_t) r * n_head + h) * D;
            for (int d = 0; d < D; d++) acc[d] = 0.0;
            for (int c = 0; c < n_kv; c++) {
                if (p[c] == 0.0) continue;
                const float * vr = vf + ((int64_t) i3 * n_head_kv * n_kv + (int64_t) hk * n_kv + c) * D;
                for (int d = 0; d < D; d++) acc[d] += p[c] * vr[d];
            }
            for (int d = 0; d < D; d++) {
                double err = fabs(acc[d] / sum - o[d]);
                if (!(err <= worst)) worst = err;  // NaN counts as worst
            }
        }
    }
    free(p);
    free(acc);
    free(vf);
    ggml_free(ctx);
    return worst;
}

int main(void) {
    // one line per case: rows, history, threads, streams, worst absolute error of an output
    const int rows[] = {1, 2, 5, 17, 40, 63, 64, 65, 66, 70};
    const int kvs[] = {37, 300, 600};  // 600: one row past 512 positions is split over threads upstream
    const int threads[] = {1, 2, 8};
    const int streams[] = {1, 4};
    for (size_t a = 0; a < sizeof rows / sizeof *rows; a++)
    for (size_t b = 0; b < sizeof kvs / sizeof *kvs; b++)
    for (size_t t = 0; t < sizeof threads / sizeof *threads; t++)
    for (size_t e = 0; e < sizeof streams / sizeof *streams; e++) {
        if (rows[a] + 3 > kvs[b]) continue;
        double err = check(rows[a], kvs[b], N_HEAD, N_HEAD_KV, 128, streams[e], threads[t], 1.0f / sqrtf(128.0f));
        printf("%d %d %d %d %.3e\n", rows[a], kvs[b], threads[t], streams[e], err);
    }
    return 0;
}
