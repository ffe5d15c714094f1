#!/bin/sh
# run_fuzz.sh BUILD TOTAL_SECONDS PER_TARGET_SECONDS JOBS TARGET... - run libFuzzer targets.
#
# Called by `make -C csrc fuzz` (csrc/Makefile), from csrc/. Each target BUILD/fuzz_<t>
# runs over BUILD/fuzz-corpus/<t>/, a copy of the committed seeds fuzz/corpus/<t>/ (new
# inputs go to the copy only), for PER_TARGET_SECONDS, or if that is empty for
# TOTAL_SECONDS divided among the targets (at least 5 s each), JOBS targets at a time.
# Prints one line per target (time, executions, coverage, corpus size); any finding
# (crash, sanitizer report, failed check, leak, timeout, out of memory) makes the run
# fail, prints the end of the target's log and leaves the input in BUILD/fuzz-artifacts/.
# FUZZ_NICE=1 runs the targets under nice (long runs on a shared machine).
set -u
build=$1 total=$2 per=$3 jobs=$4
shift 4
[ $# -gt 0 ] || { echo "[fuzz] no targets (fuzz/fuzz_*.c)" >&2; exit 1; }
if [ -z "$per" ]; then
    per=$((total / $#))
    [ "$per" -ge 5 ] || per=5
fi
mkdir -p "$build/fuzz-artifacts"
nice_cmd=""
[ "${FUZZ_NICE:-0}" = 1 ] && nice_cmd="nice -n 10"

run_one() {
    t=$1
    corpus="$build/fuzz-corpus/$t"
    log="$build/fuzz-$t.log"
    mkdir -p "$corpus"
    if [ -d "fuzz/corpus/$t" ]; then
        cp -n fuzz/corpus/"$t"/* "$corpus"/ 2>/dev/null || true
    fi
    start=$(date +%s)
    # -timeout: one input must not take 25 s (a hang is a finding); -rss_limit_mb: a
    # runaway allocation is one too. Leaks are checked (ASan, at exit of each input batch).
    ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}" \
    UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}" \
        $nice_cmd "./$build/fuzz_$t" -max_total_time="$per" -print_final_stats=1 \
        -timeout=25 -rss_limit_mb=2048 -artifact_prefix="$build/fuzz-artifacts/$t-" \
        "$corpus" >"$log" 2>&1
    rc=$?
    wall=$(($(date +%s) - start))
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
    last=$(grep -E '^#[0-9]+.*cov: ' "$log" | tail -n 1)
    cov=$(echo "$last" | sed -n 's/.*cov: \([0-9]*\).*/\1/p')
    ft=$(echo "$last" | sed -n 's/.*ft: \([0-9]*\).*/\1/p')
    files=$(ls "$corpus" | wc -l)
    if [ "$rc" -eq 0 ]; then
        echo "[fuzz] $t: ok, ${wall}s, ${execs:-?} executions, cov ${cov:-?} ft ${ft:-?}, corpus $files inputs"
    else
        echo "[fuzz] $t: FINDING (exit $rc) after ${wall}s; input in $build/fuzz-artifacts/, log $log:" >&2
        tail -n 60 "$log" >&2
    fi
    return "$rc"
}

status=0
running=0
pids=""
for t in "$@"; do
    [ -x "$build/fuzz_$t" ] || { echo "[fuzz] $build/fuzz_$t is not built" >&2; status=1; continue; }
    if [ "$jobs" -le 1 ]; then
        run_one "$t" || status=1
        continue
    fi
    run_one "$t" &
    pids="$pids $!"
    running=$((running + 1))
    if [ "$running" -ge "$jobs" ]; then
        for p in $pids; do wait "$p" || status=1; done
        pids=""
        running=0
    fi
done
for p in $pids; do wait "$p" || status=1; done
exit "$status"
