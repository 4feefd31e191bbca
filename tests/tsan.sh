#!/usr/bin/env bash
# tests/tsan.sh BUILD SUITE... — `make tsan`: run these Check suites of
# BUILD's runner, built with -fsanitize=thread, with the daemons, ranks and
# tools they start logging every ThreadSanitizer report under BUILD/tsan/.
# A failed test or any report fails the run; the reports are printed.  The
# suppressions, each with its reason, are tests/tsan.supp.
set -euo pipefail
build=$1
shift
logs="$PWD/$build/tsan"
rm -rf "$logs"
mkdir -p "$logs"
export TSAN_OPTIONS="log_path=$logs/report suppressions=$PWD/tests/tsan.supp second_deadlock_stack=1 ${TSAN_OPTIONS:-}"
# Check's timeouts catch a hung test; ThreadSanitizer makes the suites
# several times slower than a plain build.
export CK_TIMEOUT_MULTIPLIER=${CK_TIMEOUT_MULTIPLIER:-4}
rc=0
for s in "$@"; do
  start=$(date +%s)
  DEP_BUILD="$PWD/$build" CK_RUN_SUITE=$s "$build/check_deepepd" || rc=1
  echo "tsan: suite $s done in $(( $(date +%s) - start )) s"
done
shopt -s nullglob
reports=("$logs"/report.*)
for r in "${reports[@]}"; do
  cat "$r"
done
echo "tsan: suites run under ThreadSanitizer: $*"
if (( ${#reports[@]} > 0 )); then
  echo "tsan: FAIL: ${#reports[@]} process(es) reported (above; kept under $logs)" >&2
  rc=1
fi
(( rc == 0 )) && echo "tsan: no report, every test passed"
exit $rc
