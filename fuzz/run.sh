#!/usr/bin/env bash
# fuzz/run.sh [SECONDS] [--atheris [libFuzzer flags...]]: build cdc/_speedups.c with
# AddressSanitizer and UBSan into fuzz/build/, then fuzz it for SECONDS (default 60).
#   default    the differential random/mutation loop of fuzz_speedups.py (needs gcc or clang)
#   --atheris  libFuzzer through atheris (pip install atheris), with a corpus in fuzz/corpus/
# Exits non-zero on a sanitizer report or a C/Python mismatch (atheris leaves the input in
# fuzz/findings/; the loop prints it). See fuzz/README.md for the longer run.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")"
seconds=${1:-60}
shift || true

python=${PYTHON:-python}
build=build
mkdir -p "$build" findings corpus

# clang instruments the extension for libFuzzer's coverage too; gcc gives ASan alone.
cc=${CC:-$(command -v clang || command -v gcc)}
flags=(-g -O1 -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined -shared -fPIC)
if [[ $(basename "$cc") == clang* ]]; then
    flags+=(-fsanitize=fuzzer-no-link)
    asan_rt=$("$cc" -print-file-name=libclang_rt.asan-x86_64.so)
    ubsan_rt=""
else
    asan_rt=$("$cc" -print-file-name=libasan.so)
    ubsan_rt=$("$cc" -print-file-name=libubsan.so)
fi
include=$("$python" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
suffix=$("$python" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
extension=$PWD/$build/_speedups$suffix
"$cc" "${flags[@]}" -I"$include" ../cdc/_speedups.c -o "$extension"
echo "built $extension with $("$cc" --version | head -n 1)"

export CDC_FUZZ_EXTENSION=$extension
# Python's own allocations are never freed at exit: leak reports would be all noise.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:abort_on_error=1:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export LD_PRELOAD="$asan_rt${ubsan_rt:+ $ubsan_rt}"
export PYTHONMALLOC=malloc  # so ASan sees every object the extension touches

if [ "${1:-}" = "--atheris" ]; then
    shift
    if [ -z "$(ls -A corpus)" ]; then
        "$python" fuzz_speedups.py --write-seeds corpus
    fi
    exec "$python" fuzz_speedups.py -max_total_time="$seconds" -artifact_prefix=findings/ -timeout=10 \
        -rss_limit_mb=4096 "$@" corpus
fi
exec "$python" fuzz_speedups.py --plain "$seconds" "$@"
