#!/usr/bin/env bash
# Instructions per request of a bench_server build, counted by valgrind's callgrind: the same
# count for the same build and inputs whatever else the machine is doing, so two builds can be
# compared without a quiet machine.
#
#   scripts/count-instructions.sh [BIN] [MODE] [N] [SCENARIO]
#
# BIN: a bench_server binary (default: target/release/examples/bench_server, built if missing), or
# bench/peers/target/release/bench_peers with MODE floor-memory to count the in-process floor;
# MODE: plain or memory (default memory; the Redis modes would count fred's waiting too);
# N: POSTs counted (default 2000), after 200 uncounted ones;
# SCENARIO: fresh (default: a new key each) or replay (one key, completed by the first POST).
# One keep-alive connection, one request at a time; instructions are counted only while the N
# requests run. Valgrind hides the CPU's SHA instructions, so SHA-256 runs its portable code here
# (about 17 000 instructions of a fresh key): compare builds with each other, not with a native
# profile. Installs valgrind with apt-get if missing.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-target/release/examples/bench_server}
MODE=${2:-memory}
N=${3:-2000}
SCENARIO=${4:-fresh}
case "$SCENARIO" in fresh | replay) ;; *) echo "SCENARIO is fresh or replay, not $SCENARIO" >&2; exit 2 ;; esac
command -v valgrind >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq valgrind >/dev/null; }
[ -x "$BIN" ] || cargo build --release --example bench_server
OUT=$(mktemp -d)
trap 'kill "$VPID" 2>/dev/null || true; rm -rf "$OUT"' EXIT
PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$OUT/cg.out" \
  "$BIN" "127.0.0.1:$PORT" "$MODE" >"$OUT/server.log" 2>&1 &
VPID=$!
send() { # send COUNT TAG: COUNT POSTs (fresh keys, or replays of one), each answered 201
  python3 - "$PORT" "$1" "$2" "$SCENARIO" <<'PY'
import http.client, socket, sys, time
port, count, tag, scenario = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
for _ in range(600):
    try:
        socket.create_connection(("127.0.0.1", port)).close()
        break
    except OSError:
        time.sleep(0.1)
else:
    sys.exit("bench_server did not listen within 60 s")
conn = http.client.HTTPConnection("127.0.0.1", port)
body = b'{"amount":42,"note":"' + b"x" * 77 + b'"}'
for i in range(count):
    conn.request("POST", "/payments", body,
                 {"Content-Type": "application/json",
                  "Idempotency-Key": "replayed" if scenario == "replay" else f"{tag}-{i}"})
    answer = conn.getresponse()
    answer.read()
    if answer.status != 201:
        sys.exit(f"request {i} answered {answer.status}, expected 201")
PY
}
send 200 warm
callgrind_control --instr=on "$VPID" >/dev/null 2>&1
send "$N" counted
callgrind_control --instr=off "$VPID" >/dev/null 2>&1
callgrind_control --dump "$VPID" >/dev/null 2>&1
sleep 1
TOTAL=$(cat "$OUT"/cg.out* | awk '/^totals:/ {s += $2} END {print s + 0}')
[ "$TOTAL" -gt 0 ] || { echo "callgrind counted nothing; server log:" >&2; cat "$OUT/server.log" >&2; exit 1; }
echo "$BIN ($MODE, $SCENARIO): $((TOTAL / N)) instructions per request ($TOTAL over $N requests)"
