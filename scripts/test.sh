#!/usr/bin/env bash
# Runs the whole test suite: unit tests, the behaviour suites on every store, Redis and
# PostgreSQL fault tests, TLS, the queue consumers on Redis Streams and RabbitMQ, doctests and
# examples, then the library's TLS tests once more built without its `tls` feature, and the
# Redis tests on newer Redis and Valkey servers. The test binaries run in two lanes side by side
# (most of their time is spent waiting on leases, timeouts and servers). The Redis, PostgreSQL
# and RabbitMQ tests start their own redis-server, postgres and rabbitmq-server processes on
# free loopback ports (never 6379, 5432, 5672 or 4369); on a machine without redis-server,
# PostgreSQL's server binaries or rabbitmq-server this installs them with apt-get first. With
# arguments, it runs `cargo test --all-features <arguments>` alone (one suite, say), after
# building the example binaries that suite runs.
# Nothing passes by running nothing: each test binary (and the doctests) must run at least one
# test, each name filter a lane gives a binary must match at least one, and each binary a lane
# names must be built, or the run fails.
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

# One suite (arguments for cargo test): as asked. The consumer suites run example binaries
# (`common::example_binary`), which `cargo test --test NAME` does not build: the examples a
# suite named here runs (its own `example_binary("…")`, and those of the tests/common modules
# it uses) are built first, so a stale example is never the one tested.
if [ "$#" -gt 0 ]; then
  suites=() previous=
  for arg in "$@"; do
    case "$arg" in
      --test=*) suites+=("${arg#--test=}") ;;
      *) [ "$previous" = --test ] && suites+=("$arg") ;;
    esac
    previous=$arg
  done
  examples=()
  for suite in "${suites[@]}"; do
    [ -f "tests/$suite.rs" ] || continue
    sources=("tests/$suite.rs")
    for module in tests/common/*.rs; do
      name=$(basename "$module" .rs)
      grep -q "common::$name\b\|$name::" "tests/$suite.rs" && sources+=("$module")
    done
    while read -r example; do examples+=(--example "$example"); done < <(
      grep -oh 'example_binary("[a-z_]*")' "${sources[@]}" | sed 's/.*("\(.*\)")/\1/' | sort -u
    )
  done
  if [ "${#examples[@]}" -gt 0 ]; then
    cargo build --all-features "${examples[@]}"
  fi
  exec cargo test --all-features "$@"
fi

# Builds the test binaries of `cargo test --all-features <args>` (and, with no args, the
# examples the consumer tests run) and prints each one's name and path.
test_binaries() {
  cargo test --all-features --no-run --message-format=json "$@" | python3 -c '
import json, sys
for line in sys.stdin:
    message = json.loads(line)
    if message.get("reason") == "compiler-artifact" and message.get("executable") and message["profile"]["test"]:
        print(message["target"]["name"], message["executable"])'
}

# Runs a test command (`name` in the log), its output as ever, and fails when it fails or when
# it passed having run no test: libtest's summaries, `test result: ok. N passed; …` (one per
# test binary, one per crate of doctests), must add up to at least one. A binary whose tests
# all moved, or whose only filter no longer matches, would otherwise pass having run nothing.
counted() {
  local name=$1 out status=0 passed
  shift
  out=$(mktemp)
  "$@" 2>&1 | tee "$out" || status=$?
  passed=$(sed -n 's/^test result: ok\. \([0-9][0-9]*\) passed;.*/\1/p' "$out" | awk '{ n += $1 } END { print n + 0 }')
  rm -f "$out"
  [ "$status" -eq 0 ] || return "$status"
  [ "$passed" -gt 0 ] || { echo "test.sh: $name ran no test: a run of zero tests is a failure"; return 1; }
}

# Fails when one of `filters` matches no test of the binary `exe` (libtest's `--list`, which runs
# nothing): with several filters, one left behind by a rename (a module, a test) would drop its
# suite while the others still run, and the binary would pass. Among the filters may stand
# libtest's `--skip PATTERN`, whose pattern must match a test too (else the tests it leaves to
# another phase, the storms, would run twice, or that phase none), and `--test-threads N`.
filters_match() {
  local name=$1 exe=$2 filter listed
  shift 2
  while [ "$#" -gt 0 ]; do
    filter=$1
    shift
    case "$filter" in
      --skip) filter=$1 && shift ;;
      --test-threads) shift && continue ;;
    esac
    listed=$("$exe" --list "$filter") || return 1
    grep -q ': test$' <<<"$listed" || {
      echo "test.sh: $name: the filter '$filter' matches no test"
      return 1
    }
  done
}

# Runs `binaries` (lines "<name> <path>") side by side in lanes, each lane's binaries one after
# another with their output to a log of its own, then prints the logs; fails if any binary did,
# ran no test, or was given a filter that matches none of its tests, and if a lane ran no
# binary. Most tests wait on leases, timeouts and servers rather than on the CPU, so two lanes
# overlap well on 2 cores. A lane is lines "<name> <path> [filters…]"; a line NAME=VALUE sets
# the environment of the binaries after it; the line "doctests" runs cargo's doctests there, and
# the line "tls-refusal-without-tls" the library's TLS tests built without its `tls` feature.
run_lanes() {
  local logs failed=0 pids=() n=0
  logs=$(mktemp -d)
  for lane in "$@"; do
    (
      lane_failed=0 ran=0
      while read -r name exe filters; do
        case "$name" in
          "") ;;
          *=*) export "${name?}" ;; # a lane's environment, ahead of its binaries
          doctests)
            echo "== doctests (at $(($(date +%s) - started)) s)"
            # At idle priority, as the TLS refusal's build below: builds, beside timing tests.
            counted doctests chrt --idle 0 cargo test --all-features --doc || lane_failed=1
            ran=$((ran + 1))
            ;;
          cargo-done)
            # This run needs cargo no more: .ci/run's lints (clippy, each feature alone, the
            # package), waiting at idle priority for this file, may take its lock now.
            [ -z "${TEST_SH_CARGO_DONE:-}" ] || touch "$TEST_SH_CARGO_DONE"
            ;;
          tls-refusal-without-tls)
            # Built without TLS, a rediss:// URL, or a PostgreSQL URL with sslmode=require, must
            # be refused (never a plain-text connection). A build of its own (about 25 s of a
            # core), so it runs in a lane, beside tests that mostly wait, and not after them.
            echo "== the TLS refusal without TLS (at $(($(date +%s) - started)) s)"
            counted "the TLS refusal without TLS" \
              chrt --idle 0 cargo test --no-default-features --features redis,postgres --lib -- tls || lane_failed=1
            ran=$((ran + 1))
            ;;
          *)
            echo "== $name (at $(($(date +%s) - started)) s)"
            # The model check is pure CPU on both cores and runs beside lanes whose tests wait
            # on leases and timeouts: at idle priority (SCHED_IDLE), see its lane below.
            idle=()
            [ "$name" != model_check ] || idle=(chrt --idle 0)
            # shellcheck disable=SC2086 # filters are words
            { filters_match "$name" "$exe" $filters && counted "$name" "${idle[@]}" "$exe" $filters; } || lane_failed=1
            ran=$((ran + 1))
            ;;
        esac
      done <<<"$lane"
      echo "== the lane ends (at $(($(date +%s) - started)) s)"
      [ "$ran" -gt 0 ] || { echo "test.sh: a lane ran no test binary"; lane_failed=1; }
      exit "$lane_failed"
    ) >"$logs/$n.log" 2>&1 &
    pids+=("$!")
    n=$((n + 1))
  done
  for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
  cat "$logs"/*.log
  rm -rf "$logs"
  return "$failed"
}

# Each phase is named with the seconds since the start, so the log tells where the time goes.
started=$(date +%s)
phase() { echo "== test.sh: $* (at $(($(date +%s) - started)) s)"; }
# The newer servers are fetched (about 20 s from a clean clone, mostly the network) while the
# test binaries build, and waited for before the first lanes. Read from a file once the fetch has succeeded, not a `for` over the command:
# a fetch that fails must fail the run, where a loop over a failed substitution would run zero
# times and pass.
newer_list=$(mktemp)
scripts/newer-servers.sh >"$newer_list" &
newer_fetch=$!
phase "building the test binaries"
mapfile -t binaries < <(test_binaries)
wait "$newer_fetch" || { echo "scripts/newer-servers.sh failed" >&2; exit 1; }
newer=$(cat "$newer_list")
rm -f "$newer_list"
[ -n "$newer" ] || { echo "scripts/newer-servers.sh named no server" >&2; exit 1; }
expected=$(($(ls tests/*.rs | wc -l) + 2)) # every tests/*.rs, the library's and the admin tool's unit tests
[ "${#binaries[@]}" -eq "$expected" ] || {
  echo "expected $expected test binaries, found ${#binaries[@]}: ${binaries[*]}" >&2
  exit 1
}
# The lane of each newer server (below), made now so that a binary it names and that is not
# built (a renamed file) fails the run at once, rather than leave the lane; each filter must
# match a test and each binary run one (run_lanes).
binary() {
  local entry
  for entry in "${binaries[@]}"; do
    [ "${entry%% *}" != "$1" ] || { echo "$entry"; return; }
  done
  echo "test.sh: the newer servers' lanes name the test binary $1, which is not built (renamed?)" >&2
  return 1
}
# What differs on the newer servers is the server (WAIT, WAITAOF, the commands it has), which the
# store suite, the model's traces and the Redis-only tests reach; the store's transitions are the
# same scripts on every server, which the layer and waiting suites exercise on Redis 7.0 above,
# so the newer servers' lanes leave them out (about 45 s of each lane).
server_lane=""
entry=$(binary store_suite)
server_lane+="$entry redis sentinel:: cluster"$'\n'
for name in redis redis_faults redis_replica_acks redis_cluster; do
  entry=$(binary "$name")
  server_lane+="$entry"$'\n'
done
entry=$(binary model_conformance)
server_lane+="$entry redis_store"$'\n'
# Two lanes side by side: the Redis suites (the faults, failovers and freezes among them, and
# the history checker's bounded runs) and the rest. Two more at idle priority (SCHED_IDLE,
# `run_lanes`: they take only the CPU the others leave, and cannot stretch their timings past
# their bounds): cargo's builds (the doctests and the TLS refusal built without TLS, the last
# use of cargo here: then .ci/run's lints may take cargo's lock on the target directory,
# `cargo-done`), and the model check, pure CPU on both cores (about a minute). A third lane at
# normal priority made PostgreSQL's fault tests, which race timeouts of 300 ms, fail, one to
# three a run: the history checker, run beside them, takes a core for 100 s.
# Suites that only wait run four tests at a time (libtest's default is one per core, two here).
# The failover storms run afterwards, alone, so that their figures (promotion time, 503 window)
# are the failover's and not the other lanes' load (.ci/run's background steps may run
# meanwhile, at idle priority: they get no CPU time the storms ask for). (Under that load, with
# a 5 s lease, a storm once ran a key twice: the lease ran out before the completion reached the
# new master, the documented limit; their lease is 15 s since, see
# docs/topologies-and-failover.md.) tests/redis_sentinel.rs's other tests (fences, late and
# stale announcements, sentinels unheard) run in the Redis lane, ten at a time: each waits on
# failovers and looks of its own topology (ten took 32 s so, 92 s two at a time).
storm_tests="forced_failover graceful_failover" # the names of tests/redis_sentinel.rs's storms
redis_lane="" other_lane="" model_lane="" storms=""
for entry in "${binaries[@]}"; do
  case "${entry%% *}" in
    redis_sentinel)
      storms+="$entry $storm_tests"$'\n'
      redis_lane+="$entry --test-threads 10$(printf ' --skip %s' $storm_tests)"$'\n'
      ;;
    redis_cluster_failover) storms+="$entry"$'\n' ;;
    model_check) model_lane+="$entry"$'\n' ;;
    # Suites that only wait (measured: 1.2 and 3.6 s of CPU in 15 and 24 s, six at a time at a
    # load of 8): redis_liveness (idle timeouts) in the other lane, the shorter, with waiting.
    layer_suite) redis_lane+="$entry --test-threads 4"$'\n' ;;
    redis_liveness) other_lane+="$entry --test-threads 4"$'\n' ;;
    redis* | chaos | history | store_suite | faults) redis_lane+="$entry"$'\n' ;;
    *) other_lane+="$entry"$'\n' ;;
  esac
done
cargo_lane="doctests"$'\n'"tls-refusal-without-tls"$'\n'"cargo-done"$'\n'
phase "the Redis lane, the other lane, and at idle priority cargo's builds and the model check"
run_lanes "$redis_lane" "$other_lane" "$cargo_lane" "$model_lane"
phase "the failover storms"
run_lanes "$storms"

# The Redis tests once more on newer Redis and Valkey servers from Debian's registry (fetched into
# target/servers, nothing installed; scripts/newer-servers.sh): Redis 8.0 and Valkey 8.1 (trixie),
# Redis 8.6 (experimental) and Valkey 9.1 (sid).
# One lane per server: the store suite on standalone, Sentinel and Cluster, the model's traces on
# the Redis store, and the Redis-only tests but the failover storms (tests/redis_sentinel.rs,
# tests/redis_cluster_failover.rs), which run on Redis 7.0 above (see server_lane).
lanes=()
for server in $newer; do
  echo "the Redis tests on $("$server" --version)"
  # Every newer server has WAITAOF: the fsync test must take its real path there, not the refusal.
  lanes+=("REDIS_SERVER_BIN=$server"$'\n'"EXPECT_WAITAOF=1"$'\n'"$server_lane")
done
phase "the newer servers' lanes"
run_lanes "${lanes[@]}"
phase "done"
