#!/bin/bash
# Run a command as if on a CPU with fewer instructions than this one, as far as homespec can tell:
# in a private mount namespace whose /proc/cpuinfo lists this CPU's flags without the wider ones.
#
#   scripts/as_cpu.sh avx2 make test      # no AVX-512, AVX-VNNI or AMX: an AVX2-only EPYC's kernels
#   scripts/as_cpu.sh avx512 make test    # no AMX
#
# homespec reads /proc/cpuinfo to choose the kernels llama.cpp is built with (cpu_build.py), to
# refuse a build this CPU cannot run, and for the bench's llama-server; so a clone set up under
# `avx2` builds, stamps and runs the AVX2 wheel and peer, and nothing in them executes a wider
# instruction (objdump finds no zmm register in their ggml). It is not such a CPU: other libraries
# (numpy, torch) ask CPUID and still use what the silicon has, and the caches and clocks are this
# machine's. Needs root (unshare -m); the flags line of every processor is rewritten.
set -euo pipefail

level=${1:-}
case "$level" in
    avx2) drop='avx512[a-z0-9_]*|amx_[a-z0-9_]*|avx_vnni[a-z0-9_]*|avx_ifma|avx_ne_convert' ;;
    avx512) drop='amx_[a-z0-9_]*' ;;
    *) echo "usage: scripts/as_cpu.sh avx2|avx512 COMMAND [ARG...]" >&2; exit 2 ;;
esac
shift
[ $# -gt 0 ] || { echo "usage: scripts/as_cpu.sh avx2|avx512 COMMAND [ARG...]" >&2; exit 2; }

if [ -n "${HOMESPEC_AS_CPU_INFO:-}" ]; then
    # Inside the namespace (unshare makes its mounts private): only this process tree sees it.
    mount --bind "$HOMESPEC_AS_CPU_INFO" /proc/cpuinfo
    unset HOMESPEC_AS_CPU_INFO
    exec "$@"
fi

info=$(mktemp /tmp/homespec-cpuinfo-XXXXXX)
trap 'rm -f "$info"' EXIT
sed -E "/^flags[[:space:]]*:/ s/ ($drop)\b//g" /proc/cpuinfo > "$info"
if grep -m1 '^flags' "$info" | grep -Eqw "$drop"; then
    echo "as_cpu.sh: could not remove the $level-excluded flags from /proc/cpuinfo" >&2
    exit 1
fi
HOMESPEC_AS_CPU_INFO="$info" unshare -m "$0" "$level" "$@"
