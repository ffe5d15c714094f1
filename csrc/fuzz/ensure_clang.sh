#!/bin/sh
# ensure_clang.sh - make sure clang with libFuzzer can build the fuzz targets; called by
# `../run test` before `make -C csrc fuzz`.
#   exit 0: clang links -fsanitize=fuzzer,address,undefined (installed here if it was not)
#   exit 3: it is missing and cannot be installed (not root, or no apt-get): one line says
#           so and the caller skips the fuzz step
#   other:  apt-get failed: the caller fails (a CI machine that should have installed it)
# The packages are Debian's clang and its sanitizer / libFuzzer runtimes (libclang-rt-*-dev;
# clang 14 on Debian 12). FUZZ_CC names another compiler (default clang).
set -u
cc=${FUZZ_CC:-clang}

works() {
    tmp=$(mktemp -d) || return 1
    printf '#include <stddef.h>\n#include <stdint.h>\nint LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) { (void)d; (void)n; return 0; }\n' >"$tmp/t.c"
    "$cc" -fsanitize=fuzzer,address,undefined -o "$tmp/t" "$tmp/t.c" >/dev/null 2>&1
    ok=$?
    rm -rf "$tmp"
    return $ok
}

works && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "[fuzz] skipped: $cc with libFuzzer is missing and cannot be installed here (needs root and apt-get: apt-get install clang libclang-rt-dev)"
    exit 3
fi
echo "[fuzz] installing clang and its libFuzzer runtime (apt-get, once)"
export DEBIAN_FRONTEND=noninteractive
install() {
    # libclang-rt-dev (the default version's runtimes) where it exists, else clang 14's
    rt=libclang-rt-dev
    apt-cache show "$rt" >/dev/null 2>&1 || rt=libclang-rt-14-dev
    apt-get install -y -qq --no-install-recommends clang "$rt" >/tmp/autoxla-apt.log 2>&1
}
if ! install; then
    # a fresh machine may have no package lists yet
    apt-get update -qq >>/tmp/autoxla-apt.log 2>&1 && install || {
        echo "[fuzz] apt-get could not install clang (log: /tmp/autoxla-apt.log):" >&2
        tail -n 20 /tmp/autoxla-apt.log >&2
        exit 1
    }
fi
works && exit 0
echo "[fuzz] $cc still cannot link -fsanitize=fuzzer,address,undefined after apt-get" >&2
exit 1
