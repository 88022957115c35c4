// ggml_mul_mat of a Q6_K weight in the installed llama.cpp build over passes of 1-67 activation
// rows: each row's result against the same row computed alone (bitwise), and against a float64
// reference over the dequantized weights and the Q8_K rows ggml multiplies them with. Weights of
// 2 shapes, 1-3 threads. tests/unit/test_q6k_matmul_kernel.py compiles and runs it, with and
// without ggml's tiled matmul (GGML_CPU_TILED_MM), which takes passes of 8+ rows by default.
// Prints per case: rows, threads, n_in, n_out, results that differ from the row alone, worst
// relative error, results that differ from the same row in the pass of all 67 rows. With the
// argument "tiled-from-8" it first sets cpu-q6k-columns' switch for exact mode's prompt passes
// (exit status 2 where the build has no such switch).
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "ggml.h"
#include "ggml-cpu.h"

// cpu-q6k-columns' switch (homespec/llama/kernels.py), weak: a build without the fix lacks it
__attribute__((weak)) void homespec_cpu_set_q6k_tiled_from_8(bool on);

static float frand(unsigned * s) { *s = *s * 1103515245u + 12345u; return ((*s >> 8) & 0xffff) / 32768.0f - 1.0f; }

// out [n_out, m] = W [n_in, n_out] (Q6_K) x X [n_in, m] (f32)
static void mul_mat(const void * wq, int n_in, int n_out, const float * x, int m, int n_threads, float * out) {
    struct ggml_init_params ip = { (size_t) 256 << 20, NULL, false };
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * w = ggml_new_tensor_2d(ctx, GGML_TYPE_Q6_K, n_in, n_out);
    struct ggml_tensor * xt = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_in, m);
    memcpy(w->data, wq, ggml_nbytes(w));
    memcpy(xt->data, x, ggml_nbytes(xt));
    struct ggml_tensor * y = ggml_mul_mat(ctx, w, xt);
    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, y);
    ggml_graph_compute_with_ctx(ctx, gf, n_threads);
    memcpy(out, y->data, sizeof(float) * (size_t) n_out * m);
    ggml_free(ctx);
}

int main(int argc, char ** argv) {
    ggml_cpu_init();
    if (argc > 1 && strcmp(argv[1], "tiled-from-8") == 0) {
        if (!homespec_cpu_set_q6k_tiled_from_8) return 2;
        homespec_cpu_set_q6k_tiled_from_8(true);
    }
    const int shapes[][2] = { { 1536, 200 }, { 512, 37 } };  // (n_in, n_out): a model's and a ragged one
    for (size_t si = 0; si < sizeof(shapes) / sizeof(shapes[0]); si++) {
        const int n_in = shapes[si][0], n_out = shapes[si][1];
        unsigned s = 7u + n_in;
        float * wf = malloc(sizeof(float) * (size_t) n_in * n_out);
        for (size_t i = 0; i < (size_t) n_in * n_out; i++) wf[i] = frand(&s) * (1.0f + (i / n_in) % 5);
        void * wq = malloc(ggml_row_size(GGML_TYPE_Q6_K, n_in) * n_out);
        ggml_quantize_chunk(GGML_TYPE_Q6_K, wf, wq, 0, n_out, n_in, NULL);
        float * wd = malloc(sizeof(float) * (size_t) n_in * n_out);  // the weights ggml multiplies
        ggml_get_type_traits(GGML_TYPE_Q6_K)->to_float(wq, wd, (int64_t) n_in * n_out);
        const int m_max = 67;  // past the 65 rows the fix takes
        float * x = malloc(sizeof(float) * (size_t) n_in * m_max);
        for (size_t i = 0; i < (size_t) n_in * m_max; i++) x[i] = 3.0f * frand(&s);
        // the activations ggml multiplies: each row quantized to Q8_K and back
        void * xq = malloc(ggml_row_size(GGML_TYPE_Q8_K, n_in) * m_max);
        float * xd = malloc(sizeof(float) * (size_t) n_in * m_max);
        for (int r = 0; r < m_max; r++) {
            ggml_get_type_traits_cpu(GGML_TYPE_Q8_K)->from_float(x + (size_t) r * n_in, (char *) xq + r * ggml_row_size(GGML_TYPE_Q8_K, n_in), n_in);
        }
        for (size_t b = 0; b < (size_t) n_in * m_max / 256; b++) {  // ggml's block_q8_K: d, then 256 values
            const char * blk = (const char *) xq + b * ggml_type_size(GGML_TYPE_Q8_K);
            float d;
            memcpy(&d, blk, sizeof d);
            for (int i = 0; i < 256; i++) xd[b * 256 + i] = d * (float) ((const int8_t *) (blk + sizeof d))[i];
        }
        float * alone = malloc(sizeof(float) * (size_t) n_out * m_max);  // [m_max, n_out]: each row by itself
        for (int r = 0; r < m_max; r++) mul_mat(wq, n_in, n_out, x + (size_t) r * n_in, 1, 1, alone + (size_t) r * n_out);
        float * out = malloc(sizeof(float) * (size_t) n_out * m_max);
        float * widest = malloc(sizeof(float) * (size_t) n_out * m_max);  // [m_max, n_out]: all rows in one pass
        for (int m = 1; m <= m_max; m++)
        for (int th = 1; th <= 3; th++) {
            mul_mat(wq, n_in, n_out, x, m_max, th, widest);
            mul_mat(wq, n_in, n_out, x, m, th, out);
            int differ = 0, differ_widest = 0;
            double worst = 0.0;
            for (int r = 0; r < m; r++)
            for (int o = 0; o < n_out; o++) {
                const float got = out[(size_t) r * n_out + o];
                differ += memcmp(&got, &alone[(size_t) r * n_out + o], sizeof(float)) != 0;
                differ_widest += memcmp(&got, &widest[(size_t) r * n_out + o], sizeof(float)) != 0;
                double ref = 0.0, mag = 0.0;
                for (int i = 0; i < n_in; i++) {
                    const double p = (double) wd[(size_t) o * n_in + i] * xd[(size_t) r * n_in + i];
                    ref += p;
                    mag += fabs(p);
                }
                const double err = fabs(got - ref) / (mag > 0 ? mag : 1.0);
                if (!(err <= worst)) worst = err;  // NaN stays
            }
            printf("%d %d %d %d %d %.3g %d\n", m, th, n_in, n_out, differ, worst, differ_widest);
        }
        free(wf); free(wq); free(wd); free(x); free(xq); free(xd); free(alone); free(out); free(widest);
    }
    return 0;
}
