#if defined(HOMESPEC_Q4K_VNNI) || defined(HOMESPEC_Q4K_AVX2)
#define HOMESPEC_Q4K_ROWS 1  // this build has one of the two kernel sets
#include <atomic>
static std::atomic<bool> homespec_q4k_vnni{true};
#endif

// bool (bool): ggml's own gemm and gemv while off, for the op-level check and paired timing (default
// on); returns whether this build has the kernels at all (AVX-512 with VNNI, or AVX2), the switch's
// effect.
extern "C" {
// Whether ggml_gemv_q4_K_8x8_q8_K takes 2-3 rows in one call now (its `nr`; ggml's own takes one):
// the row loop ggml's repack.cpp runs after the gemm asks before it calls (q4k_vnni_rows.cpp).
bool homespec_q4k_gemv_takes_rows(void);
bool homespec_q4k_gemv_takes_rows(void) {
#if defined(HOMESPEC_Q4K_ROWS)
    return homespec_q4k_vnni.load(std::memory_order_relaxed);
#else
    return false;
#endif
}
GGML_BACKEND_API bool homespec_cpu_set_q4k_vnni(bool on);
GGML_BACKEND_API bool homespec_cpu_set_q4k_vnni(bool on) {
#if defined(HOMESPEC_Q4K_ROWS)
    homespec_q4k_vnni.store(on);
    return true;
#else
    (void) on;
    return false;
#endif
}
}
