// ggml's products of repacked Q4_K weights (block_q4_Kx8, 8 columns interleaved) as the installed
// llama.cpp build exports them: the gemm over activation rows in fours (block_q8_Kx4) and the gemv
// over 1-3 rows (block_q8_K each; 2-3 in one call where the fix's kernels take them, as ggml's
// row loop then calls it), each with cpu-q4k-vnni's switch on (homespec's VNNI kernels where the
// build has them) against ggml's own AVX2/AVX-512 code (the switch off, one row per gemv call),
// and both against ggml's scalar versions (..._generic). Random weight bytes; activations
// quantized by ggml's own code. tests/unit/test_q4k_gemm_kernel.py compiles and runs it.
// Prints "switch 0|1 0|1" (whether the build has the switch, and the kernels), then per case: rows (1-3: the gemv),
// n_in, n_out, results that differ between the switch on and off, worst error of each (on, off)
// against the scalar code relative to the case's largest |result|.
#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "ggml.h"
#include "ggml-cpu.h"

void ggml_quantize_mat_q8_K_4x8(const float * x, void * vy, int64_t k);
void ggml_gemm_q4_K_8x8_q8_K(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);
void ggml_gemm_q4_K_8x8_q8_K_generic(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);
void ggml_gemv_q4_K_8x8_q8_K(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);
void ggml_gemv_q4_K_8x8_q8_K_generic(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);
// cpu-q4k-vnni's switch, weak: a build without the fix lacks it
__attribute__((weak)) bool homespec_cpu_set_q4k_vnni(bool on);

enum { QK = 256, Q4KX8_BYTES = 2 * 8 + 2 * 8 + 96 + 1024, Q8KX4_BYTES = 4 * 4 + QK * 4 + (QK / 4) * 2, Q8K_BYTES = 4 + QK + (QK / 16) * 2 };
typedef void (*product_fn)(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);

static double worst_error(const float * got, const float * ref, int count) {
    double biggest = 0.0, worst = 0.0;
    for (int i = 0; i < count; i++) if (fabs(ref[i]) > biggest) biggest = fabs(ref[i]);
    for (int i = 0; i < count; i++) {
        const double e = fabs((double) got[i] - ref[i]) / biggest;
        if (!(e <= worst)) worst = e;  // NaN propagates
    }
    return worst;
}

static unsigned rnd(unsigned * s) { *s = *s * 1103515245u + 12345u; return *s >> 8; }

int main(void) {
    ggml_cpu_init();
    const bool kernels = homespec_cpu_set_q4k_vnni && homespec_cpu_set_q4k_vnni(true);
    printf("switch %d %d\n", homespec_cpu_set_q4k_vnni ? 1 : 0, (int) kernels);
    const int shapes[][2] = { { 1536, 64 }, { 512, 24 } };  // (n_in, n_out): a model's rows, and an odd number of 8-column groups
    const int rows[] = { 1, 2, 3, 4, 8, 12, 16, 20, 32, 36 };  // 1-3: the gemv; ggml's gemm: 4-row tiles, 16-row tiles from 16 rows on
    for (size_t si = 0; si < sizeof(shapes) / sizeof(shapes[0]); si++) {
        const int n = shapes[si][0], nc = shapes[si][1], nb = n / QK;
        unsigned s = 11u + (unsigned) n;
        // weights: random quants and packed 6-bit scales and mins; d and dmin small positive halves
        uint8_t * w = malloc((size_t) Q4KX8_BYTES * nb * (nc / 8));
        for (size_t g = 0; g < (size_t) nb * (nc / 8); g++) {
            uint8_t * blk = w + g * Q4KX8_BYTES;
            for (int i = 0; i < Q4KX8_BYTES; i++) blk[i] = (uint8_t) rnd(&s);
            for (int i = 0; i < 16; i++) {
                const ggml_fp16_t h = ggml_fp32_to_fp16((1.0f + (float) (rnd(&s) % 1000)) * (i < 8 ? 1e-4f : 2e-5f));
                memcpy(blk + 2 * i, &h, 2);
            }
        }
        for (size_t ri = 0; ri < sizeof(rows) / sizeof(rows[0]); ri++) {
            const int nr = rows[ri];
            float * x = malloc(sizeof(float) * (size_t) n * nr);
            for (size_t i = 0; i < (size_t) n * nr; i++) x[i] = ((float) (rnd(&s) % 20001) / 10000.0f - 1.0f) * (1.0f + (float) (i % 7));
            uint8_t * xq;
            product_fn product = ggml_gemm_q4_K_8x8_q8_K, scalar = ggml_gemm_q4_K_8x8_q8_K_generic;
            if (nr < 4) {  // one block_q8_K row after another, as ggml quantizes the rows its gemm leaves
                xq = malloc((size_t) Q8K_BYTES * nb * nr);
                for (int r = 0; r < nr; r++) ggml_get_type_traits_cpu(GGML_TYPE_Q8_K)->from_float(x + (size_t) r * n, xq + (size_t) r * nb * Q8K_BYTES, n);
                product = ggml_gemv_q4_K_8x8_q8_K, scalar = ggml_gemv_q4_K_8x8_q8_K_generic;
            } else {
                xq = malloc((size_t) Q8KX4_BYTES * nb * (nr / 4));
                for (int g = 0; g < nr / 4; g++) ggml_quantize_mat_q8_K_4x8(x + (size_t) g * 4 * n, xq + (size_t) g * nb * Q8KX4_BYTES, n);
            }
            float * on = malloc(sizeof(float) * (size_t) nr * nc);
            float * off = malloc(sizeof(float) * (size_t) nr * nc);
            float * ref = malloc(sizeof(float) * (size_t) nr * nc);
            // a gemv call takes several rows only where the fix's kernels are built; ggml's takes one
            const int per_call = nr >= 4 || kernels ? nr : 1, per_call_off = nr >= 4 ? nr : 1;
            const size_t row_bytes = (size_t) Q8K_BYTES * nb;
            if (homespec_cpu_set_q4k_vnni) homespec_cpu_set_q4k_vnni(true);
            for (int r = 0; r < nr; r += per_call) product(n, on + (size_t) r * nc, nc, w, xq + r * row_bytes, per_call, nc);
            if (homespec_cpu_set_q4k_vnni) homespec_cpu_set_q4k_vnni(false);
            for (int r = 0; r < nr; r += per_call_off) product(n, off + (size_t) r * nc, nc, w, xq + r * row_bytes, per_call_off, nc);
            if (homespec_cpu_set_q4k_vnni) homespec_cpu_set_q4k_vnni(true);
            for (int r = 0; r < nr; r += per_call_off) scalar(n, ref + (size_t) r * nc, nc, w, xq + r * row_bytes, per_call_off, nc);
            int differ = 0;
            for (int i = 0; i < nr * nc; i++) differ += memcmp(&on[i], &off[i], sizeof(float)) != 0;
            printf("%d %d %d %d %.3g %.3g\n", nr, n, nc, differ, worst_error(on, ref, nr * nc), worst_error(off, ref, nr * nc));
            free(x); free(xq); free(on); free(off); free(ref);
        }
        free(w);
    }
    return 0;
}
