#!/usr/bin/env bash
# check.sh — run the Soft-RoCE scenarios (`make check-rdma`): each
# tests/rdma/*.sh, or each one named, through run.sh in one guest or two,
# with a PASS, FAIL or SKIP line and its seconds, then a summary that ends
# with the last lines of each failed scenario's log.  Exits 1 when any
# scenario failed; a skip (this machine cannot run guests, or a scenario
# said it cannot run) is not a failure, and its line says why.
#
#   tests/rdmavm/check.sh BUILD_DIR [tests/rdma/NAME.sh ...]
#
# A scenario runs in the repository root with DEP_BUILD=BUILD_DIR (absolute;
# the guests see it read-only) and run.sh's RDMAVM_* variables.  Its header
# says how to run it, in a line such as
#   # rdmavm: nodes=2 timeout=180
# (nodes 1 or 2, default 1: with 2 the same script runs on both guests and
# branches on $RDMAVM_NODE; timeout in seconds, default 180).
set -euo pipefail

[[ $# -ge 1 ]] || { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 2; }
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
BUILD=$(cd "$1" && pwd); shift
RUN=tests/rdmavm/run.sh
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/check-rdma.XXXXXX")
trap 'rm -rf "$LOGS"' EXIT
shopt -s nullglob
scenarios=("$@")
[[ $# -gt 0 ]] || scenarios=(tests/rdma/*.sh)
[[ ${#scenarios[@]} -gt 0 ]] || { echo "check-rdma: no scenarios in tests/rdma/" >&2; exit 1; }

start=$SECONDS
results=() failed=0 passed=0 skipped=0
# The text after the last "skip: " of a log: why it skipped.
why() { grep -o 'skip: .*' "$1" | tail -n1 | sed 's/^skip: //'; }
# One line per scenario after the marker (CI reads the SKIP and FAIL lines
# there), then the last TAIL_LINES lines of each failed scenario's log, then
# the counts; the exit status says whether any failed.  CI keeps only the
# tail of a run's output, so a failure early in a long run would otherwise
# show its FAIL line without the lines that say why.
TAIL_LINES=40
failed_logs=()
summary() {
  local r f n
  echo "=== check-rdma: summary"
  for r in "${results[@]}"; do echo "check-rdma: $r"; done
  for f in "${failed_logs[@]}"; do
    if grep -q '^\[node2\] ' "$f"; then
      # Two guests: each node's own last lines, since one that failed early
      # would otherwise be pushed out by the other's report.
      for n in 1 2; do
        echo "=== check-rdma: the last $TAIL_LINES lines of node $n in $(basename "$f")'s log"
        grep "^\[node$n\] " "$f" | tail -n "$TAIL_LINES"
      done
    else
      echo "=== check-rdma: the last $TAIL_LINES lines of $(basename "$f")'s log"
      tail -n "$TAIL_LINES" "$f"
    fi
  done
  echo "check-rdma: $passed passed, $failed failed, $skipped skipped in $((SECONDS - start)) s"
  [[ $failed -eq 0 ]]
}

# The kernel and initramfs first, so that a first run's set-up is not charged
# to one scenario, and a machine that cannot run guests is told once.
t=$SECONDS rc=0
"$RUN" --prepare 2>&1 | tee "$LOGS/prepare" || rc=${PIPESTATUS[0]}
if [[ $rc -eq 77 ]]; then
  reason=$(why "$LOGS/prepare")
  for s in "${scenarios[@]}"; do results+=("SKIP $(basename "$s" .sh): $reason"); done
  skipped=${#scenarios[@]}
  summary; exit
elif [[ $rc -ne 0 ]]; then
  for s in "${scenarios[@]}"; do results+=("FAIL $(basename "$s" .sh): not run: run.sh --prepare exited $rc"); done
  failed=${#scenarios[@]}
  failed_logs=("$LOGS/prepare")
  summary; exit
fi
echo "check-rdma: guest kernel ready in $((SECONDS - t)) s"

for s in "${scenarios[@]}"; do
  name=$(basename "$s" .sh)
  [[ $s == */* ]] || s=./$s   # the guest runs it as a command
  header=$(sed -n 's/^# rdmavm: *//p' "$s" | head -n1)
  nodes=$(sed -n 's/.*nodes=\([0-9]*\).*/\1/p' <<<"$header")
  tmo=$(sed -n 's/.*timeout=\([0-9]*\).*/\1/p' <<<"$header")
  args=(-t "${tmo:-180}" -e "DEP_BUILD=$BUILD" -r "$BUILD")
  if [[ ${nodes:-1} == 2 ]]; then args+=(-2 "$s" "$s"); else args+=("$s"); fi
  echo "=== check-rdma: $name (${nodes:-1} guest(s))"
  t=$SECONDS rc=0
  "$RUN" "${args[@]}" 2>&1 | tee "$LOGS/$name" || rc=${PIPESTATUS[0]}
  secs=$((SECONDS - t))
  case $rc in
  0) line="PASS $name ($secs s)"; passed=$((passed + 1)) ;;
  77) line="SKIP $name ($secs s): $(why "$LOGS/$name")"; skipped=$((skipped + 1)) ;;
  124) line="FAIL $name ($secs s): timed out" ;;
  125) line="FAIL $name ($secs s): the guest could not be set up (harness, exit 125)" ;;
  *) line="FAIL $name ($secs s): exit $rc" ;;
  esac
  if [[ $line == FAIL* ]]; then
    failed=$((failed + 1))
    failed_logs+=("$LOGS/$name")
  fi
  echo "check-rdma: $line"
  results+=("$line")
done

summary
