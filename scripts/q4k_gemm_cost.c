// What ggml's repacked Q4_K products cost over passes of n rows, with the wheel's kernels
// (cpu-q4k-vnni: AVX-512 VNNI or AVX2, source_fixes/q4k_vnni.cpp and q4k_avx2.cpp) and without
// (their switch off: ggml's own gemm, and its gemv one row at a time), taking turns in one process:
// a 1536 x 8960 weight (ffn_up of the 1.5B target; random values), one thread, the best of 15
// timings per n and side, in ms, and the ratio to ggml's one-row product. Rows are called as
// ggml's row loop calls them: the fours to the gemm, the 1-3 after them in the same call where the
// kernels take them, or one gemv call each. Build against the installed wheel:
//
//   L=.venv/lib/python3.11/site-packages/llama_cpp/lib I=.venv/lib/python3.11/site-packages/include
//   cc -O2 -o /tmp/q4k_cost scripts/q4k_gemm_cost.c -I$I -L$L -lggml -lggml-base -lggml-cpu -lm -Wl,-rpath,$L
//   /tmp/q4k_cost
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "ggml.h"
#include "ggml-cpu.h"

void ggml_quantize_mat_q8_K_4x8(const float * x, void * vy, int64_t k);
void ggml_gemm_q4_K_8x8_q8_K(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);
void ggml_gemv_q4_K_8x8_q8_K(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);
__attribute__((weak)) bool homespec_cpu_set_q4k_vnni(bool on);

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void product(int n, int nc, const void * w, const uint8_t * xq, size_t row_bytes, int nr, float * out, bool kernels) {
    const int fours = nr - nr % 4;
    if (kernels && fours && nr > fours) {
        ggml_gemm_q4_K_8x8_q8_K(n, out, nc, w, xq, nr, nc);
        return;
    }
    if (fours) ggml_gemm_q4_K_8x8_q8_K(n, out, nc, w, xq, fours, nc);
    const int step = kernels && nr - fours > 1 ? nr - fours : 1;
    for (int r = fours; r < nr; r += step) ggml_gemv_q4_K_8x8_q8_K(n, out + (size_t) r * nc, nc, w, xq + r * row_bytes, step, nc);
}

int main(void) {
    ggml_cpu_init();
    if (!homespec_cpu_set_q4k_vnni || !homespec_cpu_set_q4k_vnni(true)) {
        fprintf(stderr, "this build has no cpu-q4k-vnni kernels: nothing to compare\n");
        return 1;
    }
    const int n = 1536, nc = 8960, nb = n / 256, max_rows = 17;
    const size_t w_bytes = 2 * 8 + 2 * 8 + 96 + 1024;  // block_q4_Kx8
    const size_t row_bytes = (size_t) (4 + 256 + 32) * nb;  // block_q8_K x nb
    uint8_t * w = malloc(w_bytes * nb * (nc / 8));
    unsigned s = 7u;
    for (size_t i = 0; i < w_bytes * nb * (nc / 8); i++) w[i] = (uint8_t) ((s = s * 1103515245u + 12345u) >> 16);
    for (size_t g = 0; g < (size_t) nb * (nc / 8); g++) {
        for (int i = 0; i < 16; i++) {  // d and dmin: small positive halves
            const ggml_fp16_t h = ggml_fp32_to_fp16(1e-4f);
            memcpy(w + g * w_bytes + 2 * i, &h, 2);
        }
    }
    float * x = malloc(sizeof(float) * n * max_rows);
    for (int i = 0; i < n * max_rows; i++) x[i] = (float) ((s = s * 1103515245u + 12345u) >> 16 & 2047) / 1024.0f - 1.0f;
    uint8_t * xq = malloc(row_bytes * max_rows);
    float * out = malloc(sizeof(float) * max_rows * nc);
    const int rows[] = { 1, 2, 3, 4, 5, 8, 9, 12, 16, 17 };
    double one = 0.0;
    printf("rows  ggml (ms)  kernels (ms)  ggml / 1 row  kernels / 1 row  kernels / ggml\n");
    for (size_t ri = 0; ri < sizeof(rows) / sizeof(rows[0]); ri++) {
        const int nr = rows[ri], fours = nr - nr % 4;
        for (int g = 0; g < fours / 4; g++) ggml_quantize_mat_q8_K_4x8(x + (size_t) g * 4 * n, xq + (size_t) g * 4 * row_bytes, n);
        for (int r = fours; r < nr; r++) ggml_get_type_traits_cpu(GGML_TYPE_Q8_K)->from_float(x + (size_t) r * n, xq + r * row_bytes, n);
        double best[2] = { 1e9, 1e9 };  // [ggml's, the kernels']
        for (int rep = 0; rep < 15; rep++) {
            for (int on = 0; on < 2; on++) {
                homespec_cpu_set_q4k_vnni(on);
                const double t0 = now();
                product(n, nc, w, xq, row_bytes, nr, out, on);
                const double t = now() - t0;
                if (t < best[on]) best[on] = t;
            }
        }
        if (nr == 1) one = best[0];
        printf("%4d  %9.3f  %12.3f  %12.2f  %15.2f  %14.2f\n", nr, best[0] * 1e3, best[1] * 1e3, best[0] / one, best[1] / one, best[1] / best[0]);
    }
    return 0;
}
