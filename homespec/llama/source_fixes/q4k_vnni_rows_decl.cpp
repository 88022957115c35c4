#include <type_traits>  // homespec: std::is_same_v in the row loop
// homespec (Q4K_VNNI_FIX): defined in arch/x86/repack.cpp; weak, for the builds that do not compile it
extern "C" __attribute__((weak)) bool homespec_q4k_gemv_takes_rows(void);

