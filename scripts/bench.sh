#!/usr/bin/env bash
# HTTP benchmark: a plain axum server against the same server with the idempotency layer, in one
# interleaved run (every round runs every cell once; medians over rounds), printed as one table of
# ratios to plain. Installs wrk, redis-server and redis-tools with apt-get if missing, builds
# `cargo build --release --example bench_server` (benches/http_server.rs), then runs
# scripts/bench.py, which starts its own redis-server on a free loopback port (never 6379), its own
# PostgreSQL for the postgres store (initdb in a temporary directory, a free port, never 5432;
# installed with apt-get if missing), and a fresh server process per cell, and stops them all at
# the end.
#
#   scripts/bench.sh                 quick (a few minutes): 100 B bodies; plain + redis; fresh +
#                                    replay keys, and replays through the replay cache
#                                    (redis-cache); c32 + c1; 3 rounds of 5 s cells.
#                                    Prints the table; writes bench/quick.md and bench/quick.json.
#   scripts/bench.sh --full          every store (plain, memory, redis, redis-cache for
#                                    replays, redis-acks for fresh keys) x scenario (fresh,
#                                    replay, inflight) x concurrency (c1, c32) x body (100 B,
#                                    16 KiB, 1 MiB); 3 rounds, about 15 minutes. Writes bench/results.md
#                                    (table, command, date, machine, tool versions),
#                                    bench/results.json (every round's raw numbers) and
#                                    bench/chart.svg (x plain throughput, 100 B bodies).
#   scripts/bench.sh --soak [MIN]    one redis-mode server under wrk -t2 -c32 with fresh keys for
#                                    MIN minutes (default 10), sampling its RSS and Redis
#                                    used_memory every 10 s. Writes bench/soak.md.
#                                    --soak-store memory soaks the memory store instead.
#
# The postgres store is measured only when asked for: --stores plain,postgres (its fresh, replay
# and inflight cells; statements per request counted by pg_stat_statements).
#
# Filters and overrides (any mode): --stores plain,memory,redis[,redis-cache,redis-acks][,postgres]
# --scenarios fresh,replay,inflight --conc c32,c1 --bodies 100,16k,1m --rounds N --duration S --out DIR;
# environment BENCH_ROUNDS, BENCH_DURATION, BENCH_DURATION_1M, BENCH_WARMUP, and BENCH_SERVER (a
# server binary built elsewhere, e.g. from an earlier commit, for a before/after comparison; a
# store that build does not know is skipped). `--help` lists them all.
#
# Redis servers: every Redis cell (redis, redis-cache, redis-acks, floor-redis, the peers) runs once
# per server named in --redis-servers, those runs one after another in every round, and its rows
# carry the server's name (`redis [redis-8.6]`). The list is NAME=LAUNCHER pairs, bare launchers
# (named from their --version: redis-7.0, valkey-9.1), or `all`: the system's redis-server and
# every launcher scripts/newer-servers.sh prints (Redis 8.0 and 8.6, Valkey 8.1 and 9.1; it fetches
# them the first time), e.g.
#
#   scripts/bench.sh --stores plain,redis --scenarios fresh,replay,inflight --conc c32 \
#     --bodies 100 --redis-servers all --out /tmp/bench-servers
#
# Each run also prints, per server, what one Redis core can serve: Redis CPU per request (from
# /proc, median and range over rounds) and 10^6 over it, the requests per second that would keep
# one Redis core busy, beside the server's CPU and the commands sent per request; and, after the
# redis store's fresh-key cells, Redis memory per completed record (MEMORY USAGE and STRLEN of a
# sample of records, used_memory's growth per key) and where a record's bytes go.
# BENCH_REDIS_SERVERS stands for --redis-servers; BENCH_NEWER_SERVERS names the copy of
# scripts/newer-servers.sh that `all` runs (CARGO_TARGET_DIR is passed on to it).
#
# Before/after a change, in one run: `--baseline BIN` (BIN: bench_server built from the commit
# before, e.g. in a `git worktree`) runs every store's cell on BIN too, right before the build
# under test in each round, and adds a table of each cell's req/s × base (the per-round pairs)
# and both builds' CPU per request.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v wrk >/dev/null 2>&1 || missing+=(wrk)
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
if ! command -v redis-cli >/dev/null 2>&1 || ! command -v redis-benchmark >/dev/null 2>&1; then
  missing+=(redis-tools)
fi
source scripts/apt-install.sh
apt_install ${missing[@]+"${missing[@]}"}

command -v psql >/dev/null 2>&1 || missing_pg=1
if [ -z "${PG_BIN_DIR:-}" ] && ! compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null; then
  missing_pg=1
fi
# Only a run that measures the postgres store needs PostgreSQL.
if [ "${missing_pg:-0}" = 1 ] && [[ " $* " == *postgres* ]]; then
  apt_install postgresql
fi

cargo build --release --example bench_server --features postgres
exec python3 scripts/bench.py "$@"
