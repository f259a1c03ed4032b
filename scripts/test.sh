#!/usr/bin/env bash
# Runs the whole test suite: unit tests, the behaviour suites on every store, Redis and
# PostgreSQL fault tests, TLS, doctests and examples, then the library's TLS tests once more built
# without its `tls` feature. The Redis and PostgreSQL tests start their own redis-server and
# postgres processes on free loopback ports (never 6379 or 5432); on a machine without
# redis-server or PostgreSQL's server binaries this installs them with apt-get first.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/apt-install.sh
command -v redis-server >/dev/null 2>&1 || apt_install redis-server
echo "using $(redis-server --version)"
# The tests run initdb and postgres from PG_BIN_DIR, else from the newest /usr/lib/postgresql/*/bin.
if [ -z "${PG_BIN_DIR:-}" ] && ! compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null; then
  apt_install postgresql
fi
echo "using $("${PG_BIN_DIR:-$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)}/postgres" --version)"

cargo test --all-features "$@"
if [ "$#" -eq 0 ]; then
  # Built without TLS, a rediss:// URL, or a PostgreSQL URL with sslmode=require, must be
  # refused (never a plain-text connection).
  cargo test --no-default-features --features redis,postgres --lib -- tls
fi
