// ggml's products of repacked weights (8 columns interleaved) as the installed llama.cpp build
// exports them, for the two layouts homespec's VNNI fixes replace: q4_K (block_q4_Kx8, the target's
// Q4_K weights; cpu-q4k-vnni) and q4_0 (block_q4_0x8, the requantized draft's; cpu-q4_0-vnni). The
// gemm over activation rows in fours (block_q8_Kx4 / block_q8_0x4) and the gemv over 1-3 rows
// (block_q8_K / block_q8_0 each; 2-3 in one call where the fix's kernels take them, as ggml's row
// loop then calls it), each with the fix's switch on (homespec's VNNI kernels where the build has
// them) against ggml's own AVX2/AVX-512 code (the switch off, one row per gemv call), and both
// against ggml's scalar versions (..._generic). Random weight bytes; activations quantized by
// ggml's own code. tests/unit/test_repacked_gemm_kernels.py compiles and runs it.
//
// Usage: repacked_gemm_check q4_K|q4_0. Prints "switch 0|1 0|1" (whether the build has the switch,
// and the kernels), then per case: rows (1-3: the gemv), n_in, n_out, results that differ between
// the switch on and off, results (switch on) that differ from the same row computed alone (its own
// quantization, a one-row gemv call: a one-token pass), worst error of each (on, off) against the
// scalar code relative to the case's largest |result|.
#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "ggml.h"
#include "ggml-cpu.h"

typedef void (*product_fn)(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);
typedef void (*quantize_mat_fn)(const float * x, void * vy, int64_t k);
typedef bool (*switch_fn)(bool on);

void ggml_quantize_mat_q8_K_4x8(const float * x, void * vy, int64_t k);
void ggml_gemm_q4_K_8x8_q8_K(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);
void ggml_gemm_q4_K_8x8_q8_K_generic(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);
void ggml_gemv_q4_K_8x8_q8_K(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);
void ggml_gemv_q4_K_8x8_q8_K_generic(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);
void ggml_quantize_mat_q8_0_4x8(const float * x, void * vy, int64_t k);
void ggml_gemm_q4_0_8x8_q8_0(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);
void ggml_gemm_q4_0_8x8_q8_0_generic(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);
void ggml_gemv_q4_0_8x8_q8_0(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);
void ggml_gemv_q4_0_8x8_q8_0_generic(int n, float * s, size_t bs, const void * vx, const void * vy, int nr, int nc);
// the fixes' switches, weak: a build without a fix lacks its switch
__attribute__((weak)) bool homespec_cpu_set_q4k_vnni(bool on);
__attribute__((weak)) bool homespec_cpu_set_q4_0_vnni(bool on);

struct layout {
    const char * name;
    int qk;              // values per block of a row
    size_t w_bytes;      // one block of 8 interleaved weight columns
    int w_halves;        // the fp16 scales that open it (d, and dmin for q4_K): small positive values
    size_t row_bytes;    // one block of one activation row (gemv)
    size_t rows4_bytes;  // one block of four interleaved activation rows (gemm)
    enum ggml_type row_type;
    quantize_mat_fn quantize4;
    product_fn gemm, gemm_scalar, gemv, gemv_scalar;
    switch_fn set;  // the fix's switch (weak: null where the build lacks the fix)
    bool gemm_takes_rest;  // the fix's gemm takes the 1-3 rows after the fours in the same call
};

static const struct layout LAYOUTS[] = {
    { "q4_K", 256, 2 * 8 + 2 * 8 + 96 + 1024, 16, 4 + 256 + (256 / 16) * 2, 4 * 4 + 256 * 4 + (256 / 4) * 2, GGML_TYPE_Q8_K,
      ggml_quantize_mat_q8_K_4x8, ggml_gemm_q4_K_8x8_q8_K, ggml_gemm_q4_K_8x8_q8_K_generic,
      ggml_gemv_q4_K_8x8_q8_K, ggml_gemv_q4_K_8x8_q8_K_generic, homespec_cpu_set_q4k_vnni, true },
    { "q4_0", 32, 2 * 8 + 128, 8, 2 + 32, 2 * 4 + 128, GGML_TYPE_Q8_0,
      ggml_quantize_mat_q8_0_4x8, ggml_gemm_q4_0_8x8_q8_0, ggml_gemm_q4_0_8x8_q8_0_generic,
      ggml_gemv_q4_0_8x8_q8_0, ggml_gemv_q4_0_8x8_q8_0_generic, homespec_cpu_set_q4_0_vnni, false },
};

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

int main(int argc, char ** argv) {
    const struct layout * L = NULL;
    for (size_t i = 0; i < sizeof(LAYOUTS) / sizeof(LAYOUTS[0]); i++) {
        if (argc == 2 && strcmp(argv[1], LAYOUTS[i].name) == 0) L = &LAYOUTS[i];
    }
    if (L == NULL) {
        fprintf(stderr, "usage: %s q4_K|q4_0\n", argv[0]);
        return 2;
    }
    ggml_cpu_init();
    const switch_fn set = L->set;
    const bool kernels = set && set(true);
    printf("switch %d %d\n", set ? 1 : 0, (int) kernels);
    const int shapes[][2] = { { 1536, 64 }, { 512, 24 } };  // (n_in, n_out): a model's rows, and an odd number of 8-column groups
    // 1-3: the gemv; ggml's gemm: 4-row tiles, 16-row tiles from 16 rows on; 5, 7, 9, 19: fours and the
    // rows after them, which the q4_K fix's gemm takes in the same call
    const int rows[] = { 1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 19, 20, 32, 36 };
    for (size_t si = 0; si < sizeof(shapes) / sizeof(shapes[0]); si++) {
        const int n = shapes[si][0], nc = shapes[si][1], nb = n / L->qk;
        unsigned s = 11u + (unsigned) n;
        // weights: random quants (and, for q4_K, packed 6-bit scales and mins); the halves small positive
        uint8_t * w = malloc(L->w_bytes * nb * (nc / 8));
        for (size_t g = 0; g < (size_t) nb * (nc / 8); g++) {
            uint8_t * blk = w + g * L->w_bytes;
            for (size_t i = 0; i < L->w_bytes; i++) blk[i] = (uint8_t) rnd(&s);
            for (int i = 0; i < L->w_halves; i++) {
                const ggml_fp16_t h = ggml_fp32_to_fp16((1.0f + (float) (rnd(&s) % 1000)) * (i < 8 ? 1e-4f : 2e-5f));
                memcpy(blk + 2 * i, &h, 2);
            }
        }
        for (size_t ri = 0; ri < sizeof(rows) / sizeof(rows[0]); ri++) {
            const int nr = rows[ri];
            float * x = malloc(sizeof(float) * (size_t) n * nr);
            for (size_t i = 0; i < (size_t) n * nr; i++) x[i] = ((float) (rnd(&s) % 20001) / 10000.0f - 1.0f) * (1.0f + (float) (i % 7));
            // as ggml quantizes a pass's rows: the fours interleaved, then the rest one after another
            // (four interleaved rows take the bytes of four rows)
            const size_t row_bytes = L->row_bytes * nb;
            const int fours = nr - nr % 4;
            uint8_t * xq = malloc(row_bytes * nr);
            for (int g = 0; g < fours / 4; g++) L->quantize4(x + (size_t) g * 4 * n, xq + (size_t) g * 4 * row_bytes, n);
            for (int r = fours; r < nr; r++) ggml_get_type_traits_cpu(L->row_type)->from_float(x + (size_t) r * n, xq + r * row_bytes, n);
            float * on = malloc(sizeof(float) * (size_t) nr * nc);
            float * off = malloc(sizeof(float) * (size_t) nr * nc);
            float * ref = malloc(sizeof(float) * (size_t) nr * nc);
            // The switch on, as ggml's row loop calls the fix's kernels: the fours and the rest in one
            // gemm call (q4_K), or the rest in one gemv call; ggml's own code takes one row per gemv call.
            if (set) set(true);
            if (kernels && fours && nr > fours && L->gemm_takes_rest) {
                L->gemm(n, on, nc, w, xq, nr, nc);
            } else {
                if (fours) L->gemm(n, on, nc, w, xq, fours, nc);
                for (int r = fours; r < nr; r += kernels ? nr - fours : 1) L->gemv(n, on + (size_t) r * nc, nc, w, xq + r * row_bytes, kernels ? nr - fours : 1, nc);
            }
            if (set) set(false);
            if (fours) L->gemm(n, off, nc, w, xq, fours, nc);
            for (int r = fours; r < nr; r++) L->gemv(n, off + (size_t) r * nc, nc, w, xq + r * row_bytes, 1, nc);
            if (set) set(true);
            if (fours) L->gemm_scalar(n, ref, nc, w, xq, fours, nc);
            for (int r = fours; r < nr; r++) L->gemv_scalar(n, ref + (size_t) r * nc, nc, w, xq + r * row_bytes, 1, nc);
            // each row alone, the switch on: quantized by itself, one gemv call (a one-token pass)
            float * alone = malloc(sizeof(float) * (size_t) nr * nc);
            uint8_t * row = malloc(row_bytes);
            for (int r = 0; r < nr; r++) {
                ggml_get_type_traits_cpu(L->row_type)->from_float(x + (size_t) r * n, row, n);
                L->gemv(n, alone + (size_t) r * nc, nc, w, row, 1, nc);
            }
            int differ = 0, differ_alone = 0;
            for (int i = 0; i < nr * nc; i++) {
                differ += memcmp(&on[i], &off[i], sizeof(float)) != 0;
                differ_alone += memcmp(&on[i], &alone[i], sizeof(float)) != 0;
            }
            printf("%d %d %d %d %d %.3g %.3g\n", nr, n, nc, differ, differ_alone, worst_error(on, ref, nr * nc), worst_error(off, ref, nr * nc));
            free(x); free(xq); free(on); free(off); free(ref); free(alone); free(row);
        }
        free(w);
    }
    return 0;
}
