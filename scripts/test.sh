#!/usr/bin/env bash
# Runs the whole test suite: unit tests, the behaviour suites on every store, Redis and
# PostgreSQL fault tests, TLS, doctests and examples, then the library's TLS tests once more built
# without its `tls` feature, and the Redis tests on newer Redis and Valkey servers. The Redis,
# PostgreSQL and RabbitMQ tests start their own redis-server, postgres and rabbitmq-server
# processes on free loopback ports (never 6379, 5432, 5672 or 4369); on a machine without
# redis-server, PostgreSQL's server binaries or rabbitmq-server this installs them with apt-get
# first.
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
# The RabbitMQ tests run a node of their own from RABBITMQ_SERVER_BIN, else from Debian's
# /usr/lib/rabbitmq/bin/rabbitmq-server (as the current user, not /usr/sbin's wrapper), and
# read its queues with erl_call (erlang-base, which rabbitmq-server brings).
if [ -z "${RABBITMQ_SERVER_BIN:-}" ] && [ ! -x /usr/lib/rabbitmq/bin/rabbitmq-server ]; then
  apt_install rabbitmq-server
fi
echo "using RabbitMQ $(dpkg-query -W -f '${Version}' rabbitmq-server 2>/dev/null || echo "from ${RABBITMQ_SERVER_BIN:-?}")"

cargo test --all-features "$@"
if [ "$#" -eq 0 ]; then
  # Built without TLS, a rediss:// URL, or a PostgreSQL URL with sslmode=require, must be
  # refused (never a plain-text connection).
  cargo test --no-default-features --features redis,postgres --lib -- tls
  # The Redis tests once more on the newest Redis and Valkey in Debian's registry (fetched into
  # target/servers, nothing installed): the store, layer and waiting suites on standalone,
  # Sentinel and Cluster, and the Redis-only tests but the failover storms
  # (tests/redis_sentinel.rs, tests/redis_cluster_failover.rs), which run on Redis 7.0 above.
  # An assignment, not a `for` over the command: a fetch that fails must fail the run, where a
  # loop over a failed substitution would run zero times and pass.
  newer=$(scripts/newer-servers.sh)
  [ -n "$newer" ] || { echo "scripts/newer-servers.sh named no server" >&2; exit 1; }
  # The test binaries built above, run directly so that the servers' runs go side by side
  # (cargo runs one test command at a time); their tests mostly wait on leases and timeouts.
  mapfile -t binaries < <(cargo test --all-features --no-run --message-format=json \
    --test store_suite --test layer_suite --test waiting --test redis --test redis_faults \
    --test redis_replica_acks --test redis_cluster | python3 -c '
import json, sys
for line in sys.stdin:
    message = json.loads(line)
    if message.get("reason") == "compiler-artifact" and message.get("executable") and message["profile"]["test"]:
        print(message["target"]["name"], message["executable"])')
  [ "${#binaries[@]}" -eq 7 ] || { echo "expected 7 test binaries, found: ${binaries[*]}" >&2; exit 1; }
  on_server() {
    local server=$1 name exe failed=0
    echo "the Redis tests on $("$server" --version)"
    for entry in "${binaries[@]}"; do
      read -r name exe <<<"$entry"
      filters=()
      case "$name" in store_suite | layer_suite | waiting) filters=(redis sentinel:: cluster two_nodes::) ;; esac
      echo "== $name"
      REDIS_SERVER_BIN="$server" "$exe" "${filters[@]}" || failed=1
    done
    return "$failed"
  }
  logs=$(mktemp -d)
  pids=()
  n=0
  for server in $newer; do
    on_server "$server" >"$logs/$n.log" 2>&1 &
    pids+=("$!")
    n=$((n + 1))
  done
  failed=0
  for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
  cat "$logs"/*.log
  rm -rf "$logs"
  [ "$failed" -eq 0 ] || { echo "the Redis tests failed on a newer server (above)" >&2; exit 1; }
fi
