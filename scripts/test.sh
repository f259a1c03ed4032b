#!/usr/bin/env bash
# Runs the whole test suite: unit tests, the behaviour suites on both stores, Redis fault tests,
# doctests and examples. The Redis tests start their own redis-server processes on free loopback
# ports (never 6379); on a machine without redis-server this installs it with apt-get first.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null 2>&1; then
  echo "redis-server is not installed; installing it with apt-get"
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq redis-server >/dev/null
fi
echo "using $(redis-server --version)"

cargo test --all-features "$@"
