// What a Q6_K matrix product costs over passes of n rows in a llama.cpp build: ggml_mul_mat of a
// 1536 x n_out Q6_K weight (default 151936, the 1.5B target's output layer; random values)
// against n f32 rows, the best of 15 timings per n, in ms. Compare builds by running each in turn
// (cpu_build's cpu-q6k-columns against a build without it), and GGML_CPU_TILED_MM=0 for ggml's
// own per-row path past 7 rows. Build against the installed wheel:
//
//   L=.venv/lib/python3.11/site-packages/llama_cpp/lib I=.venv/lib/python3.11/site-packages/include
//   cc -O2 -o /tmp/q6k_cost scripts/q6k_matmul_cost.c -I$I -L$L -lggml -lggml-base -lggml-cpu -lm -Wl,-rpath,$L
//   /tmp/q6k_cost [n_out] [threads]
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "ggml.h"
#include "ggml-cpu.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char ** argv) {
    const int n_in = 1536;
    const int n_out = argc > 1 ? atoi(argv[1]) : 151936;
    const int threads = argc > 2 ? atoi(argv[2]) : 2;
    const int rows[] = { 1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 33, 64 };
    ggml_cpu_init();
    struct ggml_init_params ip = { (size_t) 1 << 30, NULL, false };
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * w = ggml_new_tensor_2d(ctx, GGML_TYPE_Q6_K, n_in, n_out);
    float * wf = malloc(sizeof(float) * (size_t) n_in * n_out);
    for (size_t i = 0; i < (size_t) n_in * n_out; i++) wf[i] = (rand() % 2000 - 1000) / 1000.0f;
    ggml_quantize_chunk(GGML_TYPE_Q6_K, wf, w->data, 0, n_out, n_in, NULL);
    free(wf);
    for (size_t ri = 0; ri < sizeof(rows) / sizeof(rows[0]); ri++) {
        const int n = rows[ri];
        struct ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_in, n);
        for (int i = 0; i < n_in * n; i++) ((float *) x->data)[i] = (rand() % 2000 - 1000) / 1000.0f;
        struct ggml_cgraph * gf = ggml_new_graph(ctx);
        ggml_build_forward_expand(gf, ggml_mul_mat(ctx, w, x));
        ggml_graph_compute_with_ctx(ctx, gf, threads);  // (the first run allocates)
        double best = 1e9;
        for (int r = 0; r < 15; r++) {
            const double t = now();
            ggml_graph_compute_with_ctx(ctx, gf, threads);
            const double dt = now() - t;  // s
            if (dt < best) best = dt;
        }
        printf("%2d rows %8.2f ms\n", n, best * 1000);
    }
    ggml_free(ctx);
    return 0;
}
