#!/usr/bin/env bash
# Runs the whole test suite: unit tests, the behaviour suites on both stores, Redis fault tests,
# TLS, doctests and examples, then the library's TLS tests once more built without its `tls`
# feature. The Redis tests start their own redis-server processes on free loopback
# ports (never 6379); on a machine without redis-server this installs it with apt-get first.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/apt-install.sh
command -v redis-server >/dev/null 2>&1 || apt_install redis-server
echo "using $(redis-server --version)"

cargo test --all-features "$@"
if [ "$#" -eq 0 ]; then
  # Built without TLS, a rediss:// URL must be refused (never a plain-text connection).
  cargo test --no-default-features --features redis --lib -- tls
fi
