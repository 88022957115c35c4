"""`homespec doctor`: what this machine runs llama.cpp with. The CPU's instruction sets, the
kernels the installed llama.cpp was built with (and whether this CPU can run them), llama.cpp's
own account of its backends, and whether AMX tiles work here.

Only argparse is imported at module level; llama_cpp is loaded last, after the build check.
"""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-amx-check", action="store_true", help="skip compiling and running the AMX tile check")


def main(args: argparse.Namespace) -> int:
    from homespec.llama import cpu_build as cb

    flags = cb.cpu_flags()
    wanted = sorted({f for needs in cb.OPTIONS.values() for f in needs})
    print(f"cpu:      {_cpu_model()}")
    print(f"flags:    {' '.join(f for f in wanted if f in flags) or '(none of the x86 SIMD flags llama.cpp uses)'}")
    amx = False  # AMX kernels would be built here (`make install`)
    if "amx_tile" in flags and not args.no_amx_check:
        works = cb.amx_works()
        amx = works and cb.amx_wanted()
        tiles = "tiles work (the check ran)" if works else "advertised, but the tile check failed"
        use = ("built in (HOMESPEC_AMX=on) when the check passes" if cb.amx_wanted()
               else "left out, every pass is cheaper with homespec's VNNI kernels (HOMESPEC_AMX=on builds them in)")
        print(f"amx:      {tiles}; {use}")
    print(f"memory:   {_huge_pages()}")
    folder = cb.installed_package_dir()
    options = cb.read_stamp(folder) if folder is not None else None
    if options is None:
        print("build:    no record of how llama.cpp was built (installed by hand?); `make install` builds it for this CPU")
        status = 0
    else:
        print(f"build:    {cb.key(options)}; source fixes: {', '.join(cb.read_fixes(folder)) or 'none'}")
        missing = cb.missing_flags(options, flags)
        better = sorted(k for k, v in cb.choose(flags, amx).items() if v and not options.get(k))
        if missing:
            print(f"mismatch: built for {', '.join(missing)}, which this CPU lacks: run `make install` to rebuild")
            return 1  # loading llama.cpp now could crash the process (SIGILL)
        unasked = sorted(k for k in cb.AMX_OPTIONS if options.get(k) and not amx)
        print("match:    this CPU runs every kernel of the build"
              + (f" (it also has {', '.join(better)}: `make install` to use them)" if better else "")
              + (f" (built with {', '.join(unasked)}, which cost every pass more here: `make install` rebuilds without)" if unasked else ""))
        if cb.rows_batch_invariant(options, cb.read_fixes(folder)):
            print("greedy:   a verify pass gives each row of a Q4_K_M target what a one-token pass gives it "
                  "(the wheel's Q4_K kernels): speculation answers as plain decoding does")
        else:
            print("greedy:   a row in a verify pass can differ in its last bits from the same row alone (ggml's own "
                  "kernels here), so speculation can answer otherwise than plain decoding at a near-tie; "
                  "`runtime.exact: true` makes them identical (README, Exact mode)")
        status = 0
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip()
    print(f"llama.cpp: {info}")
    return status


def _huge_pages() -> str:
    """How the weights of `homespec serve` (run, bench) get huge pages here (llama/hugepages.py)."""
    from homespec.llama import hugepages as hp

    thp = hp.thp_mode()
    if thp is None:
        return "no transparent huge pages in this kernel"
    if thp != "madvise":
        return f"transparent huge pages '{thp}': homespec asks for nothing"
    if hp.environ_with_huge_pages() is not None:  # (doctor itself does not run again: __main__)
        return f"transparent huge pages 'madvise': the commands that load models start again with {hp.TUNABLE}=1"
    return f"transparent huge pages 'madvise': {hp.TUNABLE} is set already or not available (GLIBC_TUNABLES, HOMESPEC_HUGEPAGES, glibc 2.35+)"


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8", errors="replace"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()
