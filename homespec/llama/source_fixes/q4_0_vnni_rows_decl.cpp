// homespec (Q4_0_VNNI_FIX): defined in arch/x86/repack.cpp; weak, for the builds that do not compile it
extern "C" __attribute__((weak)) bool homespec_q4_0_gemv_takes_rows(int n);
