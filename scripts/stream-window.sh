#!/usr/bin/env bash
# Measures the Redis store's window in examples/stream_consumer.rs: the time from the effect's
# reply (HINCRBY) to the record's completion, during which a crash applies the effect again on
# redelivery. Starts its own redis-server on a free port, publishes MESSAGES messages (distinct
# ids), runs CONSUMERS consumers until all are acknowledged, and prints the window's
# percentiles from their debug lines (`completed … window_us=`).
#
#   scripts/stream-window.sh [--release]     # MESSAGES=2000 CONSUMERS=1 by default
set -euo pipefail
cd "$(dirname "$0")/.."

MESSAGES=${MESSAGES:-2000}
CONSUMERS=${CONSUMERS:-1}
profile=debug
if [ "${1:-}" = "--release" ]; then profile=release; fi
cargo build --quiet --example stream_consumer --features streams,postgres $([ "$profile" = release ] && echo --release)
binary=target/$profile/examples/stream_consumer

dir=$(mktemp -d)
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$dir" \
  --daemonize yes --pidfile "$dir/redis.pid" --loglevel warning
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait "${pids[@]}" 2>/dev/null || true
  kill "$(cat "$dir/redis.pid")" 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT
until redis-cli -p "$port" ping >/dev/null 2>&1; do sleep 0.05; done

for i in $(seq 1 "$MESSAGES"); do echo "XADD payments * id w-$i amount $i"; done |
  redis-cli -p "$port" >/dev/null
for n in $(seq 1 "$CONSUMERS"); do
  REDIS_URL=redis://127.0.0.1:$port RUST_LOG=stream_consumer=debug "$binary" \
    >"$dir/out.$n" 2>"$dir/err.$n" &
  pids+=($!)
done
# Settled: every entry delivered to the group and none pending.
while true; do
  sleep 0.2
  pending=$(redis-cli -p "$port" XPENDING payments workers | head -1)
  ledger=$(redis-cli -p "$port" HLEN payments:ledger)
  if [ "$pending" = 0 ] && [ "$ledger" = "$MESSAGES" ]; then break; fi
done
cat "$dir"/err.* | grep -o 'window_us=[0-9]*' | cut -d= -f2 | sort -n |
  awk -v profile="$profile" -v consumers="$CONSUMERS" '
    { v[NR] = $1 }
    END {
      printf "%s build, %d consumers, %d messages: window p50 %d µs, p90 %d µs, p99 %d µs, max %d µs\n",
        profile, consumers, NR, v[int(NR * 0.50)], v[int(NR * 0.90)], v[int(NR * 0.99)], v[NR]
    }'
