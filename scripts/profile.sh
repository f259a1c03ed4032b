#!/usr/bin/env bash
# Where a request's server CPU goes, per store and scenario: system calls and context switches per
# request (perf stat) and a perf record -g profile filed under headings (send, receive, wake-ups,
# malloc, fred, hyper, this crate, ...), in microseconds per request. See scripts/profile.py.
#
#   scripts/profile.sh                          plain/plain memory/fresh redis/fresh redis/replay
#   scripts/profile.sh redis/fresh --out F.md   chosen cells; also write the tables to F.md
#   scripts/profile.sh postgres/fresh           the PostgreSQL store (its own server, as in bench.sh)
#   scripts/profile.sh ... --keep DIR           also keep each cell's perf.data in DIR (perf report -i)
#
# Installs wrk, redis-server, redis-tools and linux-perf (and PostgreSQL for a postgres cell) with
# apt-get if missing, and builds the bench server with line tables into target/profile (the
# benchmark's release build is untouched).
# perf needs permission to profile another process: run as root or lower
# /proc/sys/kernel/perf_event_paranoid.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v wrk >/dev/null 2>&1 || missing+=(wrk)
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || missing+=(redis-tools)
command -v perf >/dev/null 2>&1 || missing+=(linux-perf)
source scripts/apt-install.sh
apt_install ${missing[@]+"${missing[@]}"}

# Only a postgres cell needs PostgreSQL (as in bench.sh).
if [[ " $* " == *postgres* ]]; then
  if ! command -v psql >/dev/null 2>&1 \
    || { [ -z "${PG_BIN_DIR:-}" ] && ! compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null; }; then
    apt_install postgresql
  fi
fi

CARGO_PROFILE_RELEASE_DEBUG=line-tables-only \
  cargo build --release --example bench_server --features postgres --target-dir target/profile
exec python3 scripts/profile.py "$@"
