#!/usr/bin/env bash
# `make test`'s runner: pytest sessions in lanes that run side by side.
#
#   scripts/test-lanes.sh PYTEST 'PART PART ...' ['PART ...' ...]
#
# Each argument after PYTEST is one lane: its parts (test folders or files) run one after the other, one pytest
# session each (so each has its own Kafka broker, tests/conftest.py); the lanes run at the same time. A part
# that fails does not stop its lane: every part always runs, and the exit status is 1 if any of them failed.
#
# Why lanes: a pytest session of this suite keeps the 2-core host busy about half of the time (it waits for
# Kafka groups, service start-ups and crash detection), so two sessions side by side finish sooner than one
# after the other (docs/performance.md, "The fifty-third round").
#
# Lane i of n gets TBMQ_FREE_PORT_BAND=i/n (tbmq_launcher.redis.port_band): its free-port picks never meet
# another lane's. Each part's output goes to $TEST_LOG_DIR/<part>.log (default .run/test-logs) and is printed
# whole when the part ends, so parts never interleave; PYTEST_ARGS are passed to every session.
set -uo pipefail

pytest=${1:?usage: scripts/test-lanes.sh PYTEST LANE...}
shift
lanes=("$@")
(( ${#lanes[@]} )) || { echo "scripts/test-lanes.sh: no lane given" >&2; exit 2; }
log_dir=${TEST_LOG_DIR:-.run/test-logs}
mkdir -p "$log_dir"
lock="$log_dir/.print.lock"
: > "$lock"
eval "pytest_args=(${PYTEST_ARGS:-})"  # the shell's word splitting and quotes: PYTEST_ARGS="-m 'not slow'"

run_lane() {  # lane number, parts
  local n=$1 part log start status=0 rc
  shift
  for part in $1; do
    log="$log_dir/$(echo "$part" | tr '/' '_').log"
    start=$SECONDS
    TBMQ_FREE_PORT_BAND="$n/${#lanes[@]}" "$pytest" "$part" "${pytest_args[@]}" > "$log" 2>&1
    rc=$?
    (( rc == 0 )) || status=1
    {
      flock 9
      echo "== $part (lane $n): $( ((rc == 0)) && echo passed || echo "FAILED (exit $rc)") in $((SECONDS - start)) s"
      cat "$log"
      echo "$part $rc $((SECONDS - start))" >> "$log_dir/.summary"
    } 9>> "$lock"
  done
  return $status
}

rm -f "$log_dir/.summary"
pids=()
stop() {  # a lane's pytest first (its fixtures stop what they started), then the lane
  for pid in "${pids[@]}"; do pkill -TERM -P "$pid"; kill "$pid"; done 2>/dev/null
  wait
  exit 130
}
trap stop INT TERM
for i in "${!lanes[@]}"; do
  run_lane $((i + 1)) "${lanes[$i]}" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
  wait "$pid" || status=1
done
echo "== summary (part, exit status, seconds; lanes side by side, ${SECONDS} s in all)"
cat "$log_dir/.summary"
exit $status
