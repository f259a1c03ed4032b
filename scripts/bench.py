#!/usr/bin/env python3
"""HTTP benchmark driver for tower-idempotency (python3, standard library only).

Run it through scripts/bench.sh, which installs wrk and redis-server if missing and builds the
server (`cargo build --release --example bench_server`, benches/http_server.rs) first.

    scripts/bench.sh                      quick: 100 B bodies; plain + redis; fresh + replay;
                                          c32 + c1; 3 rounds of 5 s cells -> bench/quick.{md,json}
    scripts/bench.sh --full               every store x scenario x concurrency x body size;
                                          -> bench/results.{md,json} and bench/chart.svg
    scripts/bench.sh --soak [MINUTES]     one server under load for MINUTES (default 10); samples
                                          its RSS and Redis used_memory -> bench/soak.md
    scripts/bench.sh --baseline BIN ...   A/B: every cell also on another build (BIN), right
                                          before the build under test in every round; prints
                                          each cell's throughput x base (per-round pairs)
    scripts/bench.sh --redis-servers all  every Redis cell once per server (the system's and
                                          scripts/newer-servers.sh's); prints Redis CPU per
                                          request, the requests/s one Redis core serves,
                                          Redis's socket reads per request and what a read
                                          costs it, and Redis memory per record, per server
    scripts/bench.sh --conc c128 ...      128 connections (not in any default matrix): a
                                          busier Redis, more commands per read

A cell is (store, scenario, concurrency, body size). Every round runs every cell once, in the
same order (interleaved, so drift hits all cells alike); each cell gets a fresh server process
and, for Redis stores, a FLUSHALL. The table shows medians over rounds; "x plain" is computed per
round against the plain cell of the same concurrency and body size, then the median (min-max)
is taken. "wrk CPU" is the load generator's own CPU per request; "machine busy" is the share of
both cores' time that was not idle during the timed run (from /proc/stat): near 100% a cell is
CPU-bound, and its throughput is the cores divided by the CPU per request of wrk, the server and
Redis together; below it, requests also waited on round trips with a core idle. See --help for
filters and the BENCH_* environment overrides.
"""

import argparse
import datetime
import http.client
import json
import math
import os
import random
import resource
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# BENCH_SERVER points at another build of the server, e.g. one built from an earlier commit for a
# before/after comparison (each run's ratios are to its own plain cells).
SERVER_BIN = Path(os.environ.get("BENCH_SERVER") or ROOT / "target" / "release" / "examples" / "bench_server")
# Other idempotency layers over the same handler (bench/peers), for a same-run comparison.
PEERS_DIR = ROOT / "bench" / "peers"
PEERS_BIN = PEERS_DIR / "target" / "release" / "bench_peers"
# The redis-server every Redis cell runs against. The peer `peer-axum-idempotent` needs Redis
# 7.4 or newer (HEXPIRE); scripts/newer-servers.sh prints a launcher for Redis 8.0.
REDIS_SERVER = os.environ.get("BENCH_REDIS_SERVER") or "redis-server"
# --baseline (or BENCH_BASELINE): a second build, measured in the same run. Every store's cell is
# run by both builds, one after the other in every round; the baseline's rows are named
# "<store>@base".
BASELINE_BIN = None
BASELINE_SUFFIX = "@base"


def mode_of(store):
    """The store mode a cell's server runs ("redis" for "redis@base")."""
    return store.split("@")[0]


def binary_of(store):
    if mode_of(store) in PEER_STORES:
        return PEERS_BIN
    return BASELINE_BIN if store.endswith(BASELINE_SUFFIX) else SERVER_BIN

STORES = ["plain", "memory", "redis", "redis-cache", "redis-acks", "postgres",
          "peer-idempotent", "peer-axum-idempotent", "floor-memory", "floor-redis"]  # every store the driver knows
# Never part of the default selections: named with --stores, built on demand (bench/peers).
# floor-memory and floor-redis are no library: the least an in-process layer, and a layer over
# Redis with fred, does per request, yardsticks for the memory store's and the Redis store's cells
# (bench/peers/src/floor.rs, floor_redis.rs).
PEER_STORES = {"peer-idempotent", "peer-axum-idempotent", "floor-memory", "floor-redis"}
REDIS_STORES = {"redis", "redis-cache", "redis-acks"} | (PEER_STORES - {"floor-memory"})
# What the peers' own Lua scripts call, so that "sent" counts their client's commands only
# (read from idempotent 2.0's valkey/*.lua and ruts 0.13's Redis store).
PEER_SCRIPT_CALLS = {
    "peer-idempotent": {"del", "hmget", "hset", "incr", "pexpire"},
    "peer-axum-idempotent": {"exists", "hdel", "hexpire", "hset", "rename"},
}
PG_STORES = {"postgres"}
RECORD_PREFIX = "idempotency"  # RedisStore's default prefix (DEFAULT_PREFIX, src/store/redis/store.rs)
PG_TABLE = "idempotency_records"  # PostgresStore's default table
LAYERED_SCENARIOS = ["fresh", "replay", "inflight"]
# name -> (wrk threads, connections); c128 only when asked for (--conc), to see Redis busier
CONCURRENCY = {"c32": (2, 32), "c1": (1, 1), "c128": (2, 128)}
BODIES = {"100": 100, "16k": 16 * 1024, "1m": 1_000_000}  # the layer's limit is 1 MiB = 1048576
BODY_LABEL = {"100": "100 B", "16k": "16 KiB", "1m": "1 MiB"}
EXPECTED_STATUS = {"plain": 201, "fresh": 201, "replay": 201, "inflight": 409}
REPLAY_KEYS = 1000
HOLD_MS = 600_000  # x-bench-sleep-ms of the request that holds the in-flight key
BAD_FRACTION = 0.01  # more unexpected answers than this flags a cell
CLK_TCK = os.sysconf("SC_CLK_TCK")


class BenchError(Exception):
    """A failure that stops the run with a clear message."""


class UnknownMode(BenchError):
    """The server does not know the store mode (exit status 2)."""


# ---------------------------------------------------------------------------------------------
# processes


class Processes:
    """Every process the driver starts, each in a session (process group) of its own, so it can
    always be stopped, also on Ctrl-C and on errors."""

    def __init__(self):
        self.procs = []

    def spawn(self, cmd, **kwargs):
        proc = subprocess.Popen(cmd, start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def stop(self, proc, timeout=5.0):
        """SIGTERM to the process group, SIGKILL if it has not exited after `timeout` s."""
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            except ProcessLookupError:
                pass
        if proc in self.procs:
            self.procs.remove(proc)
        return proc.returncode

    def stop_all(self):
        for proc in list(self.procs):
            try:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        self.procs.clear()


PROCS = Processes()


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_port(port, proc, what, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.01)
    raise BenchError(f"{what} did not accept connections on port {port} within {timeout:.0f} s")


def cpu_ticks(pid):
    """utime + stime of a process (all its threads), in clock ticks."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def machine_ticks():
    """(all, idle) clock ticks of every CPU of the machine since boot, from /proc/stat; idle
    counts iowait too."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return sum(fields), fields[3] + fields[4]


def busy_fraction(before, after):
    """The share of the machine's CPU time (all cores) that was not idle between two readings
    of machine_ticks(): below 1 when nothing was ready to run on some core some of the time, as
    when every request waits on a round trip."""
    total = after[0] - before[0]
    return 1 - (after[1] - before[1]) / total if total > 0 else None


def children_cpu_s():
    """User + system CPU seconds of this script's children that have ended and been waited for:
    read around run_wrk(), the difference is wrk's own."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def proc_status_kib(pid, field):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise BenchError(f"no {field} in /proc/{pid}/status")


def proc_meminfo_kib(field):
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise BenchError(f"no {field} in /proc/meminfo")


def tool_version(cmd):
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
        return (out.stdout or out.stderr).strip().splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return "unknown"


# ---------------------------------------------------------------------------------------------
# redis


class Redis:
    """A minimal RESP2 client: enough for PING, FLUSHALL, INFO and a look at records. Arguments
    may be bytes; `cmd_raw` hands bulk replies back as bytes (records are binary)."""

    def __init__(self, port):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.reader = self.sock.makefile("rb")

    def close(self):
        self.reader.close()
        self.sock.close()

    def cmd(self, *args):
        self._send(args)
        return self._read()

    def cmd_raw(self, *args):
        self._send(args)
        return self._read(raw=True)

    def _send(self, args):
        parts = [f"*{len(args)}\r\n".encode()]
        for arg in args:
            data = arg if isinstance(arg, bytes) else str(arg).encode()
            parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
        self.sock.sendall(b"".join(parts))

    def _read(self, raw=False):
        line = self.reader.readline()
        if not line:
            raise BenchError("redis-server closed the connection")
        kind, rest = line[:1], line[1:-2]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            raise BenchError(f"redis error: {rest.decode()}")
        if kind == b":":
            return int(rest)
        if kind == b"$":
            size = int(rest)
            if size < 0:
                return None
            data = self.reader.read(size + 2)[:-2]
            return data if raw else data.decode()
        if kind == b"*":
            size = int(rest)
            return None if size < 0 else [self._read(raw) for _ in range(size)]
        raise BenchError(f"unexpected reply from redis-server: {line!r}")

    def info(self, section):
        values = {}
        for line in self.cmd("INFO", section).splitlines():
            if ":" in line and not line.startswith("#"):
                name, value = line.split(":", 1)
                values[name] = value
        return values


class RedisServer:
    def __init__(self, tmp, maxmemory=None, name="redis", replicaof=None, binary=None):
        self.port = free_port()
        self.dir = Path(tmp) / name
        self.dir.mkdir()
        self.binary = binary or REDIS_SERVER
        cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
               "--save", "", "--appendonly", "no", "--dir", str(self.dir),
               "--logfile", str(self.dir / "redis.log"), "--daemonize", "no"]
        if maxmemory:
            cmd += ["--maxmemory", str(maxmemory), "--maxmemory-policy", "volatile-ttl"]
        if replicaof:
            cmd += ["--replicaof", "127.0.0.1", str(replicaof)]
        self.proc = PROCS.spawn(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        if not wait_for_port(self.port, self.proc, "redis-server"):
            raise BenchError(f"redis-server exited with status {self.proc.returncode}; "
                             f"see {self.dir / 'redis.log'}")
        self.client = Redis(self.port)
        self.client.cmd("PING")
        self.url = f"redis://127.0.0.1:{self.port}"

    def stop(self):
        try:
            self.client.close()
        except OSError:
            pass
        PROCS.stop(self.proc)


class ReplicatedRedis(RedisServer):
    """The redis-acks store's own master (measured like the other stores' redis-server) with one
    replica, so that the other stores' Redis does not pay for replication. The replica's CPU is
    not counted."""

    def __init__(self, tmp, binary=None, label="redis"):
        super().__init__(tmp, name=f"redis-acks-{label}", binary=binary)
        self.replica = RedisServer(tmp, name=f"redis-acks-replica-{label}", replicaof=self.port,
                                   binary=binary)
        # Online, and acknowledging at once (a freshly synced replica's first ACK can be late).
        deadline = time.monotonic() + 20
        while True:
            self.client.cmd("SET", "bench:probe", "1")
            if self.client.cmd("WAIT", "1", "100") == 1:
                break
            if time.monotonic() > deadline:
                raise BenchError("the redis-acks replica never acknowledged a write")
        self.client.cmd("DEL", "bench:probe")

    def stop(self):
        self.replica.stop()
        super().stop()
def server_label(binary):
    """A short name for a server build from its `--version` line: "redis-7.0", "valkey-9.1"."""
    text = tool_version([binary, "--version"])
    match = re.match(r"(\w+) server v=(\d+)\.(\d+)\.(\d+)", text)
    if not match:
        raise BenchError(f"{binary} --version printed {text!r}, not a Redis or Valkey server's version")
    return f"{match.group(1).lower()}-{match.group(2)}.{match.group(3)}", text


def newer_servers():
    """The launchers scripts/newer-servers.sh prints (one per line), fetching them if need be.
    BENCH_NEWER_SERVERS runs another copy of the script (e.g. a checkout whose build tree has
    them already; CARGO_TARGET_DIR is passed on as it is)."""
    script = os.environ.get("BENCH_NEWER_SERVERS") or str(ROOT / "scripts" / "newer-servers.sh")
    out = subprocess.run([script], stdout=subprocess.PIPE, text=True)
    if out.returncode != 0:
        raise BenchError(f"{script} failed with status {out.returncode}")
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def redis_servers(spec):
    """The servers every Redis cell runs against, as [(label, binary, version line)]: from
    --redis-servers (NAME=LAUNCHER, a bare LAUNCHER labelled by its --version, or `all`: the
    system's redis-server and every launcher scripts/newer-servers.sh prints), else
    BENCH_REDIS_SERVER alone."""
    wanted = []
    for item in (spec or REDIS_SERVER).split(","):
        item = item.strip()
        if not item:
            continue
        if item == "all":
            wanted += [(None, "redis-server")] + [(None, launcher) for launcher in newer_servers()]
        elif "=" in item:
            name, binary = item.split("=", 1)
            wanted.append((name.strip(), binary.strip()))
        else:
            wanted.append((None, item))
    servers, seen = [], set()
    for name, binary in wanted:
        if shutil.which(binary) is None:
            raise BenchError(f"--redis-servers: {binary} is not an executable")
        label, version = server_label(binary)
        label = name or label
        if label in seen:
            if name:
                raise BenchError(f"--redis-servers: the name {label} is given twice")
            label = f"{label}.{version.split('v=', 1)[1].split('.', 2)[2].split()[0]}"
            if label in seen:
                continue  # the same build twice (`all` and a launcher named as well)
        if not re.fullmatch(r"[A-Za-z0-9._-]+", label):
            raise BenchError(f"--redis-servers: the name {label!r} may hold letters, digits, '.', '_' and '-'")
        seen.add(label)
        servers.append((label, binary, version))
    return servers


# Commands the driver sends itself between two snapshots, and a replica's acknowledgements.
NOT_THE_CLIENTS = {"info", "replconf", "client|list"}
# `INFO commandstats` counts a command a script calls like one a client sends. What the store's
# scripts call, run by run (scripts/*.lua):
#   complete.lua completing a record:              GETRANGE SET [SPUBLISH]
#     (builds before the one-SET completion:       GETRANGE SETRANGE APPEND PEXPIRE SPUBLISH)
#   complete.lua on a record this owner completed: GETRANGE SETRANGE PEXPIRE
#   release.lua releasing:                         GETRANGE DEL [SPUBLISH]
#   renew.lua renewing:                            GETRANGE SETRANGE PEXPIRE
#   wait.lua, a waiting request's read:            SET [SETRANGE]  (in no bench cell)
#   any of them on a record the owner lost:        GETRANGE
# [SPUBLISH]: only for a record a request waits for (marked by wait.lua), which no bench cell
# has; builds before that published on every completion and release. The client never sends
# GETRANGE, SETRANGE, APPEND or DEL itself, so all of their calls are the scripts'; the scripts'
# PEXPIRE calls are no more than
# their SETRANGE calls.
# Every run of a script reads its record with one GETRANGE, and every run but a completion by
# one SET (and a lost claim) also calls SETRANGE or DEL: so the scripts' SET calls are their
# GETRANGE calls less their SETRANGE and DEL calls, counting a run that finds its claim lost as
# one too (a bench cell's lost claim is a wrong answer, and the cell is flagged; builds before the
# notice went only to waited-for records bounded this by the SPUBLISH calls). The scripts' SPUBLISH calls are at most
# their APPEND, DEL and SET calls. The rest of SET and SPUBLISH, and every other command, the
# client sent. check_counting() proves this on every server at the start of a run, running each
# branch of the scripts.
SCRIPT_ONLY = {"getrange", "setrange", "append", "del"}


def sent_by_client(delta, store, inner):
    """Of each command's calls in one cell's `INFO commandstats` delta ({name: calls}), how many
    the client sent: {name: calls}."""
    if store in PEER_SCRIPT_CALLS:
        # The peers' own scripts: a command their scripts call counts as called in the script.
        skip = inner | PEER_SCRIPT_CALLS[store] | NOT_THE_CLIENTS
        return {name: calls for name, calls in delta.items() if name not in skip}
    calls = lambda name: delta.get(name, 0)  # noqa: E731
    in_scripts = {name: calls(name) for name in SCRIPT_ONLY}
    in_scripts["pexpire"] = min(calls("pexpire"), calls("setrange"))
    in_scripts["set"] = max(0, min(calls("set"), calls("getrange") - calls("setrange") - calls("del")))
    in_scripts["spublish"] = min(calls("spublish"), calls("append") + calls("del") + in_scripts["set"])
    return {name: n - in_scripts.get(name, 0) for name, n in delta.items()
            if name not in NOT_THE_CLIENTS}


def sent_commands(delta, store, inner):
    """Commands the client sent, from one cell's `INFO commandstats` delta ({name: calls})."""
    return sum(sent_by_client(delta, store, inner).values())


def command_usec(delta, usec, store, inner):
    """Microseconds Redis spent running the commands the client sent (`INFO commandstats` usec;
    a script's own commands are inside its EVALSHA's time, so theirs are left out): Redis's CPU
    without reading, parsing and answering, and without its event loop."""
    sent = sent_by_client(delta, store, inner)
    return sum(usec.get(name, 0) * calls / delta[name] for name, calls in sent.items() if delta[name])


def check_counting(redis, inner):
    """Proves sent_commands() on this server: runs the transitions by the Lua scripts in scripts/
    (each of their branches), and checks the count against the commands sent. Raises BenchError
    if they disagree."""
    client = redis.client
    head = b"TIR\x03\x00\x0bbench-owner"
    # Even, as an owner writes it: odd is the waiters' mark (src/store/redis/record.rs).
    deadline = ((int(time.time() * 1000) + 60_000) & ~1).to_bytes(8, "big")
    # The fingerprint (32 bytes) and its policy tag (8): record layout 3.
    in_flight = head + b"F" + deadline + bytes(40)
    completed = head + b"C" + deadline + bytes(40) + b"payload"
    lua = {name: (ROOT / "scripts" / f"{name}.lua").read_text() for name in ("complete", "release", "renew")}
    sent = 0

    def send(*args):
        nonlocal sent
        sent += 1
        return client.cmd_raw(*args)

    def check(what, lost=0):
        # A script run that finds its claim lost reads and writes nothing: it counts as one of the
        # scripts' SET calls, so as a SET the client did not send (`lost` such runs here).
        nonlocal before, sent
        after = redis_snapshot(client)
        delta = {name: calls - before["calls"].get(name, 0) for name, calls in after["calls"].items()}
        counted = sent_commands({name: calls for name, calls in delta.items() if calls}, "redis", inner)
        if counted != sent - lost:
            raise BenchError(f"counting commands sent on {redis.label} ({what}): {counted} counted, "
                             f"{sent} sent (commandstats delta {delta}); fix sent_commands()")
        before, sent = redis_snapshot(client), 0

    before = redis_snapshot(client)
    for key in ("bench:check:a", "bench:check:b", "bench:check:c"):
        send("SET", key, in_flight, "NX", "PX", 60_000, "GET")
    # A record a request waits for (its deadline's lowest bit set, as wait.lua marks it).
    marked = head + b"F" + deadline[:7] + bytes([deadline[7] | 1]) + bytes(40)
    send("SET", "bench:check:m", marked, "NX", "PX", 60_000, "GET")
    done = b"C" + deadline
    # complete.lua's arguments: the head, the state, the payload and the retention.
    complete = ("EVAL", lua["complete"], 1)
    send(*complete, "bench:check:a", head, done, b"payload", 60_000)  # completes
    send(*complete, "bench:check:a", head, done, b"payload", 60_000)  # again
    send(*complete, "bench:check:a", b"TIR\x03\x00\x01x", done, b"p", 60_000)  # lost
    send("EVAL", lua["complete"], 2, "bench:check:b", "bench:check:a", head, done, b"payload", 60_000,
         head, done, b"payload", 60_000)  # two records in one call
    send("EVAL", lua["renew"], 1, "bench:check:c", head, b"F" + deadline, 60_000)
    send("EVAL", lua["release"], 1, "bench:check:c", head)
    send("EVAL", lua["release"], 1, "bench:check:c", head)  # lost
    send(*complete, "bench:check:m", head, done, b"payload", 60_000)  # marked: publishes
    check("the scripts", lost=2)
    if client.cmd_raw("GET", "bench:check:b") != completed:
        raise BenchError(f"complete.lua on {redis.label} built another record than the store's layout")
    client.cmd("FLUSHALL", "SYNC")


def record_head(client, key):
    """(state byte, owner length) of the record at `key`, or None if it is not a record."""
    start = client.cmd_raw("GETRANGE", key, 0, 5)
    if not start or len(start) < 6 or start[:3] != b"TIR":
        return None
    owner_len = int.from_bytes(start[4:6], "big")
    state = client.cmd_raw("GETRANGE", key, 6 + owner_len, 6 + owner_len)
    return (state[:1] if state else b""), owner_len


def payload_at(record):
    """Where a record's payload starts: after the head (magic, version, owner length, owner),
    state and deadline (9 bytes), and the fingerprint: 32 bytes in layouts 1 and 2, 40 in layout
    3 (the digest and the policy's tag, issue 38). Reading layout 3 at 32 made `with_body` take
    fingerprint bytes for a header count and loop for minutes."""
    owner_len = int.from_bytes(record[4:6], "big")
    return 6 + owner_len + 9 + (40 if record[3] >= 3 else 32)


def record_layout(record):
    """Where a completed record's bytes go (src/store/redis/record.rs, src/http/stored.rs):
    {part: bytes}, and the stored header names."""
    owner_len = int.from_bytes(record[4:6], "big")
    at = payload_at(record)
    payload = record[at:]
    parts = {"record head (magic, version, owner length, state, deadline)": 6 + 9,
             "owner token": owner_len, "fingerprint": at - 6 - owner_len - 9}
    names = []
    if payload[:3] == b"TIR" and payload[3] == 2 and payload[4:5] == b"R":
        pos = 5 + 2
        count = int.from_bytes(payload[pos:pos + 4], "big")
        pos += 4
        header_bytes = 0
        for _ in range(count):
            name_len = int.from_bytes(payload[pos:pos + 4], "big")
            name = payload[pos + 4:pos + 4 + name_len]
            pos += 4 + name_len
            value_len = int.from_bytes(payload[pos:pos + 4], "big")
            value = payload[pos + 4:pos + 4 + value_len]
            pos += 4 + value_len
            header_bytes += name_len + value_len
            names.append(f"{name.decode(errors='replace')}: {value.decode(errors='replace')}")
        body_len = int.from_bytes(payload[pos:pos + 8], "big")
        parts["payload framing (magic, version, kind, status, counts, lengths)"] = \
            5 + 2 + 4 + 8 * count + 8 + 4
        parts["stored header names and values"] = header_bytes
        parts["response body"] = body_len
    else:
        parts["payload (not a stored response)"] = len(payload)
    return parts, names


def with_body(record, body):
    """A completed record like `record` (a stored response) with another response body."""
    pos = payload_at(record) + 5 + 2
    count = int.from_bytes(record[pos:pos + 4], "big")
    if 8 * count > len(record):
        raise BenchError(f"a stored response with {count} headers in a {len(record)}-byte record: "
                         "bench.py does not read this record layout")
    pos += 4
    for _ in range(2 * count):
        pos += 4 + int.from_bytes(record[pos:pos + 4], "big")
    body_len = int.from_bytes(record[pos:pos + 8], "big")
    return record[:pos] + len(body).to_bytes(8, "big") + body + record[pos + 8 + body_len:]


# Response bodies the write-path step weighs records with, besides the bench's own (45 B: the
# body of the 863 B per record measured before issue 26).
WEIGHED_BODIES = (45, 100, 1000)


def weigh_write_paths(client, record, prefix):
    """MEMORY USAGE of `record`, and of it with WEIGHED_BODIES-byte response bodies, written the
    two ways a completion writes: the work tree's complete.lua on an in-flight record (one SET of
    the whole record since issue 26; before, SETRANGE then APPEND of the payload, and APPEND left
    the string room to grow, up to its length again), and one SET of the whole record. Probe keys
    are named like records, in another slot."""
    owner_len = int.from_bytes(record[4:6], "big")
    if record[3] != 3:
        return None  # another build's layout (a baseline's): the work tree's complete.lua writes layout 3
    head, at = record[:6 + owner_len], payload_at(record)
    in_flight = head + b"F" + record[6 + owner_len + 1:at]
    lua = (ROOT / "scripts" / "complete.lua").read_text()
    probe = f"{prefix}:{{{'x' * 64}}}"  # 'x' is no hex digit: never a record's key
    out = []
    for body in [None] + list(WEIGHED_BODIES):
        full = record if body is None else with_body(record, b"b" * body)
        client.cmd_raw("SET", probe, in_flight, "PX", 60_000)
        state = full[len(head):len(head) + 9]
        client.cmd_raw("EVAL", lua, 1, probe, head, state, full[at:], 60_000)
        if client.cmd_raw("GET", probe) != full:
            raise BenchError("complete.lua wrote another record than expected: is scripts/complete.lua "
                             "the build's?")
        appended = int(client.cmd("MEMORY", "USAGE", probe, "SAMPLES", "0"))
        client.cmd_raw("SET", probe, full, "PX", 60_000)
        one_set = int(client.cmd("MEMORY", "USAGE", probe, "SAMPLES", "0"))
        client.cmd("DEL", probe)
        out.append({"body": len(full) - len(with_body(full, b"")), "strlen": len(full),
                    "complete_lua": appended, "one_set": one_set})
    return out


def record_memory(client, prefix, used_before, sample=200):
    """Redis memory per completed record, read after a fresh-key cell: MEMORY USAGE and STRLEN
    of up to `sample` completed records, and used_memory's growth over the cell ÷ keys."""
    keys = int(client.cmd("DBSIZE"))
    used_after = int(client.info("memory")["used_memory"])
    usages, lengths, key_lengths = [], [], []
    cursor, layout_key = "0", None
    while len(usages) < sample:
        cursor, batch = client.cmd("SCAN", cursor, "MATCH", f"{prefix}:{{*", "COUNT", 1000)
        for key in batch:
            head = record_head(client, key)
            if head is None or head[0] != b"C" or len(usages) >= sample:
                continue  # still in flight when wrk stopped
            usages.append(int(client.cmd("MEMORY", "USAGE", key, "SAMPLES", "0")))
            lengths.append(int(client.cmd("STRLEN", key)))
            key_lengths.append(len(key))
            layout_key = layout_key or key
        if cursor == "0":
            break
    if not usages:
        return None
    record = client.cmd_raw("GET", layout_key)
    layout, headers = record_layout(record)
    return {"write_paths": weigh_write_paths(client, record, prefix),"keys": keys, "sampled": len(usages),
            "memory_usage": statistics.median(usages), "memory_usage_min": min(usages),
            "memory_usage_max": max(usages), "strlen": statistics.median(lengths),
            "key_len": statistics.median(key_lengths),
            "used_memory_per_key": (used_after - used_before) / keys if keys else None,
            "layout": layout, "stored_headers": headers}



# ---------------------------------------------------------------------------------------------
# postgres


def pg_bin_dir():
    if os.environ.get("PG_BIN_DIR"):
        return Path(os.environ["PG_BIN_DIR"])
    found = sorted((int(p.parent.name), p) for p in Path("/usr/lib/postgresql").glob("*/bin")
                   if p.parent.name.isdigit() and (p / "initdb").exists())
    if not found:
        raise BenchError("no PostgreSQL server binaries under /usr/lib/postgresql/*/bin "
                         "(apt-get install postgresql, or set PG_BIN_DIR)")
    return found[-1][1]


class PgServer:
    """A PostgreSQL of the bench's own: initdb in the temporary directory, a free port, the
    postgres user when the bench runs as root (PostgreSQL refuses root). Durable as shipped
    (fsync and synchronous_commit on): a commit waits for its WAL flush, as in production.
    pg_stat_statements counts the statements the store sends."""

    def __init__(self, tmp):
        self.bin = pg_bin_dir()
        self.port = free_port()
        self.dir = Path(tmp) / "postgres"
        self.dir.mkdir(mode=0o700)
        user = {}
        if os.geteuid() == 0:
            # The temporary directory is root's (mode 0700): let the postgres user pass through.
            os.chmod(tmp, 0o711)
            shutil.chown(self.dir, "postgres", "postgres")
            user = {"user": "postgres", "group": "postgres", "extra_groups": []}
        init = subprocess.run([str(self.bin / "initdb"), "-D", str(self.dir), "-U", "postgres",
                               "-A", "trust", "-E", "UTF8", "--locale=C"],
                              capture_output=True, text=True, **user)
        if init.returncode != 0:
            raise BenchError(f"initdb failed: {init.stderr}")
        self.log = open(Path(tmp) / "postgres.log", "wb")
        cmd = [str(self.bin / "postgres"), "-D", str(self.dir), "-p", str(self.port),
               "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={self.dir}",
               "-c", "shared_buffers=128MB", "-c", "max_connections=100",
               "-c", "shared_preload_libraries=pg_stat_statements"]
        self.proc = PROCS.spawn(cmd, stdout=self.log, stderr=subprocess.STDOUT, **user)
        deadline = time.monotonic() + 30
        while subprocess.run([str(self.bin / "pg_isready"), "-q", "-h", "127.0.0.1", "-p",
                              str(self.port)]).returncode != 0:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"postgres did not start; see {self.log.name}")
            time.sleep(0.05)
        self.url = f"postgres://postgres@127.0.0.1:{self.port}/postgres"
        self.sql("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")

    def sql(self, query):
        out = subprocess.run(["psql", "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1",
                              "-p", str(self.port), "-U", "postgres", "-d", "postgres", "-c", query],
                             capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise BenchError(f"psql failed: {out.stderr.strip()} ({query})")
        return out.stdout.strip()

    def empty(self):
        """Empties the record table (once the first server has created it), like FLUSHALL."""
        self.sql(f"DO $$ BEGIN IF to_regclass('{PG_TABLE}') IS NOT NULL THEN "
                 f"TRUNCATE {PG_TABLE}; END IF; END $$")

    def statements(self):
        """Statements run on the record table so far (the store's own; not this driver's)."""
        return int(self.sql(f"SELECT coalesce(sum(calls), 0) FROM pg_stat_statements "
                            f"WHERE query LIKE '%{PG_TABLE}%' AND query NOT LIKE '%pg_stat_statements%' "
                            f"AND query NOT LIKE 'DO %' AND query NOT LIKE 'CREATE%'") or 0)

    def cpu_ticks(self):
        """CPU of the postmaster and every process it started (a backend per connection)."""
        total = 0
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[1]) == self.proc.pid or int(entry.name) == self.proc.pid:
                total += int(stat[11]) + int(stat[12])
        return total

    def version(self):
        return tool_version([str(self.bin / "postgres"), "--version"])

    def stop(self):
        PROCS.stop(self.proc)
        self.log.close()


INNER_CALL = re.compile(r"""(?:redis\.call\(\s*|pcall\(\s*redis\.call\s*,\s*)['"]([A-Za-z]+)['"]""")


def inner_commands():
    """Commands our Lua scripts call inside Redis (so the client does not send them), and where
    they were found. The scripts are read from the server binary, which embeds the ones it runs;
    scripts/*.lua in the work tree may differ from the build being measured (an A/B run of an
    older build, a script being edited). The work tree is the fallback."""
    names = {name.decode().lower() for name in
             re.compile(INNER_CALL.pattern.encode()).findall(SERVER_BIN.read_bytes())}
    if names:
        shown = SERVER_BIN.relative_to(ROOT) if SERVER_BIN.is_relative_to(ROOT) else SERVER_BIN
        return names, f"the Lua scripts embedded in {shown}"
    for script in sorted((ROOT / "scripts").glob("*.lua")):
        names.update(name.lower() for name in INNER_CALL.findall(script.read_text()))
    return names, "scripts/*.lua"


def redis_snapshot(redis):
    calls, usec = {}, {}
    for name, value in redis.info("commandstats").items():
        if name.startswith("cmdstat_"):
            fields = dict(item.split("=", 1) for item in value.split(","))
            calls[name[len("cmdstat_"):]] = int(fields["calls"])
            usec[name[len("cmdstat_"):]] = int(fields["usec"])
    stats = redis.info("stats")
    total = int(stats["total_commands_processed"])
    # Socket reads and writes Redis made (every server here has them, Redis 6.0 on): the
    # commands a read carries is how well the client shares its writes.
    reads = int(stats["total_reads_processed"])
    writes = int(stats["total_writes_processed"])
    return {"calls": calls, "usec": usec, "total": total, "reads": reads, "writes": writes}


# ---------------------------------------------------------------------------------------------
# requests


def make_body(size):
    """JSON-ish ASCII bytes of exactly `size` bytes."""
    head, tail = '{"amount":42,"currency":"eur","note":"', '"}'
    filler = "lorem ipsum dolor sit amet consectetur adipiscing elit "
    room = size - len(head) - len(tail)
    if room < 0:
        raise BenchError(f"body size {size} is too small")
    return (head + (filler * (room // len(filler) + 1))[:room] + tail).encode()


def http_post(port, key, body, extra=None, timeout=30.0, conn=None):
    headers = {"Host": f"127.0.0.1:{port}", "Content-Type": "application/json",
               "Idempotency-Key": key}
    headers.update(extra or {})
    own = conn is None
    conn = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/payments", body=body, headers=headers)
        response = conn.getresponse()
        response.read()
        return response.status, response.getheader("idempotent-replayed")
    finally:
        if own:
            conn.close()


def complete_keys(port, body, keys, workers=4, replays=False):
    """Sends one request per key (keep-alive, a few connections) and checks each got 201 (and,
    with `replays`, that each was a replay)."""
    failures = []

    def work(part):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            for key in part:
                status, replayed = http_post(port, key, body, conn=conn)
                if status != 201 or (replays and replayed != "true"):
                    failures.append((key, status, replayed))
        finally:
            conn.close()

    threads = [threading.Thread(target=work, args=(keys[i::workers],)) for i in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise BenchError(f"{'replay' if replays else 'completion'} pass: {len(failures)} keys did "
                         f"not get a 201{' replay' if replays else ''}, e.g. {failures[:3]}")


def hold_in_flight(port, key, body):
    """Sends the request that holds `key` in flight (its handler sleeps HOLD_MS) and leaves its
    connection open. Returns the open sockets; close them to let go."""
    head = (f"POST /payments HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Idempotency-Key: {key}\r\nx-bench-sleep-ms: {HOLD_MS}\r\n\r\n").encode()
    holders = []
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(head + body)
    holders.append(sock)
    # Until a plain request with the key gets 409, the claim is not there yet. The probe carries
    # the sleep header too: if it arrives first it becomes the holder, which is just as good.
    deadline = time.monotonic() + 10
    time.sleep(0.05)
    while time.monotonic() < deadline:
        probe = http.client.HTTPConnection("127.0.0.1", port, timeout=1.0)
        try:
            status, _ = http_post(port, key, body, {"x-bench-sleep-ms": str(HOLD_MS)}, conn=probe)
            probe.close()
            if status == 409:
                return holders
            raise BenchError(f"in-flight probe got {status}, expected 409")
        except (socket.timeout, TimeoutError):
            holders.append(probe.sock)  # this probe holds the key now; keep its connection open
    raise BenchError("could not hold a key in flight within 10 s")


# ---------------------------------------------------------------------------------------------
# wrk

WRK_SCRIPT = r"""-- Generated by scripts/bench.py: key scheme %(scheme)s, body %(size)d bytes.
-- Every cell runs this same code (request() and response() included), so the client-side cost
-- is alike across cells; only the key differs.
local body = [==[%(body)s]==]
local scheme = "%(scheme)s"
local threads = {}
local next_id = 0

function setup(thread)
  next_id = next_id + 1
  thread:set("id", next_id)
  table.insert(threads, thread)
end

function init(args)
  prefix = args[1]
  head = "POST /payments HTTP/1.1\r\nHost: " .. args[2] ..
    "\r\nContent-Type: application/json\r\nContent-Length: " .. #body .. "\r\nIdempotency-Key: "
  tail = "\r\n\r\n" .. body
  n = 0
  counts = {}
  replayed = 0
end

function request()
  n = n + 1
  local key
  if scheme == "unique" then
    key = prefix .. "-" .. id .. "-" .. n
  elseif scheme == "cycle" then
    key = "r-" .. (n %% %(replay_keys)d)
  else
    key = prefix
  end
  return head .. key .. tail
end

function response(status, headers, body)
  counts[status] = (counts[status] or 0) + 1
  if headers["idempotent-replayed"] ~= nil then
    replayed = replayed + 1
  end
end

function done(summary, latency, requests)
  local total, replays = {}, 0
  for _, thread in ipairs(threads) do
    for status, count in pairs(thread:get("counts")) do
      total[status] = (total[status] or 0) + count
    end
    replays = replays + thread:get("replayed")
  end
  local parts = {}
  for status, count in pairs(total) do
    table.insert(parts, string.format("%%d=%%d", status, count))
  end
  io.write("BENCH_STATUS " .. table.concat(parts, " ") .. "\n")
  io.write(string.format("BENCH_REPLAYED %%d\n", replays))
end
"""

KEY_SCHEME = {"plain": "unique", "fresh": "unique", "replay": "cycle", "inflight": "fixed"}


def write_wrk_script(tmp, scenario, body):
    path = Path(tmp) / f"wrk-{scenario}-{len(body)}.lua"
    if not path.exists():
        text = body.decode()
        assert "]==]" not in text
        path.write_text(WRK_SCRIPT % {"scheme": KEY_SCHEME[scenario], "size": len(body),
                                      "body": text, "replay_keys": REPLAY_KEYS})
    return path


UNITS = {"us": 1.0, "ms": 1e3, "s": 1e6, "m": 60e6, "h": 3600e6}


def parse_time_us(text):
    match = re.fullmatch(r"([\d.]+)(us|ms|s|m|h)", text)
    if not match:
        raise BenchError(f"cannot parse wrk time {text!r}")
    return float(match.group(1)) * UNITS[match.group(2)]


def parse_wrk(out):
    result = {"statuses": {}, "replayed": 0, "socket_errors": {}, "non2xx": 0}
    match = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if not match:
        raise BenchError("wrk printed no Requests/sec line")
    result["rps"] = float(match.group(1))
    match = re.search(r"(\d+) requests in ([\d.]+\w+),", out)
    result["requests"] = int(match.group(1))
    result["duration_s"] = parse_time_us(match.group(2)) / 1e6
    for pct, key in (("50", "p50_us"), ("99", "p99_us")):
        match = re.search(rf"^\s+{pct}%\s+([\d.]+\w+)\s*$", out, re.M)
        if not match:
            raise BenchError(f"wrk printed no {pct}% latency (is --latency set?)")
        result[key] = parse_time_us(match.group(1))
    match = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if match:
        result["socket_errors"] = dict(zip(("connect", "read", "write", "timeout"),
                                           map(int, match.groups())))
    match = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if match:
        result["non2xx"] = int(match.group(1))
    match = re.search(r"^BENCH_STATUS(.*)$", out, re.M)
    if not match:
        raise BenchError("the wrk script printed no status counts")
    for item in match.group(1).split():
        status, count = item.split("=")
        result["statuses"][status] = int(count)
    match = re.search(r"^BENCH_REPLAYED (\d+)$", out, re.M)
    result["replayed"] = int(match.group(1))
    return result


def run_wrk(url, conc, duration, script, args, timeout_s="5s"):
    threads, connections = CONCURRENCY[conc]
    duration = max(1, round(duration))  # wrk takes whole seconds
    cmd = ["wrk", f"-t{threads}", f"-c{connections}", f"-d{duration}s", f"--timeout={timeout_s}",
           "--latency", "-s", str(script), url, "--"] + list(args)
    proc = PROCS.spawn(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=duration + 60)
    except subprocess.TimeoutExpired:
        PROCS.stop(proc)
        raise BenchError(f"wrk did not finish: {shlex.join(cmd)}")
    PROCS.procs.remove(proc)
    if proc.returncode != 0:
        raise BenchError(f"wrk failed with status {proc.returncode}: {shlex.join(cmd)}\n{err}{out}")
    return out


def check_answers(scenario, wrk):
    """Problems with the answers wrk got, as short strings (empty: all as expected)."""
    problems = []
    expected = str(EXPECTED_STATUS[scenario])
    answered = sum(wrk["statuses"].values())
    if answered == 0:
        return ["no answers"]
    wrong = answered - wrk["statuses"].get(expected, 0)
    if wrong > BAD_FRACTION * answered:
        others = {s: c for s, c in wrk["statuses"].items() if s != expected}
        problems.append(f"{wrong}/{answered} answers not {expected}: {others}")
    if scenario == "replay" and wrk["replayed"] < (1 - BAD_FRACTION) * answered:
        problems.append(f"only {wrk['replayed']}/{answered} answers were replays")
    if scenario != "replay" and wrk["replayed"] > BAD_FRACTION * answered:
        problems.append(f"{wrk['replayed']}/{answered} answers were replays")
    errors = sum(wrk["socket_errors"].values())
    if errors:
        problems.append(f"socket errors {wrk['socket_errors']}")
    expected_non2xx = wrk["statuses"].get(expected, 0) if int(expected) >= 300 else 0
    if abs(wrk["non2xx"] - expected_non2xx) > BAD_FRACTION * answered:
        problems.append(f"wrk counted {wrk['non2xx']} non-2xx answers")
    return problems


# ---------------------------------------------------------------------------------------------
# one cell


class Server:
    def __init__(self, tmp, store, redis, pg=None):
        self.port = free_port()
        self.log = Path(tmp) / f"server-{store}-{self.port}.log"
        binary = binary_of(store)
        store = mode_of(store)
        env = dict(os.environ)
        if redis is not None:
            env["REDIS_URL"] = redis.url
        if pg is not None:
            env["DATABASE_URL"] = pg.url
        self.log_file = open(self.log, "wb")
        cmd = [str(binary), f"127.0.0.1:{self.port}", store]
        self.proc = PROCS.spawn(cmd, stdout=self.log_file, stderr=subprocess.STDOUT, env=env)
        if not wait_for_port(self.port, self.proc, "bench_server"):
            self.log_file.close()
            text = self.log.read_text(errors="replace")
            if self.proc.returncode == 2 and "unknown mode" in text:
                raise UnknownMode(text.strip())
            raise BenchError(f"bench_server ({store}) exited with status {self.proc.returncode}:\n{text}")
        self.url = f"http://127.0.0.1:{self.port}/payments"
        self.host = f"127.0.0.1:{self.port}"

    def stop(self):
        """Stops the server; returns (exit status, warnings it logged)."""
        status = PROCS.stop(self.proc, timeout=10)
        self.log_file.close()
        text = self.log.read_text(errors="replace")
        match = re.search(r"bench_server: warnings=(\d+)", text)
        warnings = int(match.group(1)) if match else None
        # the first lines the server logged, without their timestamps
        self.first_lines = [re.sub(r"^\d{4}-\d\d-\d\dT\S+\s+", "", line) for line in text.splitlines()
                            if not line.startswith("bench_server:")][:3]
        if status != 0:
            raise BenchError(f"bench_server exited with status {status} after SIGTERM:\n{text[-2000:]}")
        return warnings


def run_cell(cfg, cell, tmp, redis, inner, pg=None):
    name, scenario, conc, body_name, server_name = cell
    store = mode_of(name)
    body = cfg.bodies_bytes[body_name]
    duration = cfg.duration_for(body_name)
    script = write_wrk_script(tmp, scenario, body)
    run_id = "%08x" % random.getrandbits(32)
    # After a fresh-key cell of the redis store, what its records take in Redis.
    weigh_records = store == "redis" and scenario == "fresh"
    used_before = None
    if redis is not None and store in REDIS_STORES:
        redis.client.cmd("FLUSHALL", "SYNC")  # SYNC: servers that flush lazily free memory later
        used_before = int(redis.client.info("memory")["used_memory"])
    if pg is not None and store in PG_STORES:
        pg.empty()
    server = Server(tmp, name, redis if store in REDIS_STORES else None,
                    pg if store in PG_STORES else None)
    holders = []
    measured = False
    try:
        # warm-up (and the scenario's preparation)
        if scenario == "replay":
            complete_keys(server.port, body, [f"r-{i}" for i in range(REPLAY_KEYS)])
            status, replayed = http_post(server.port, "r-0", body)
            if status != 201 or replayed != "true":
                raise BenchError(f"{store}: a completed key answered {status}, "
                                 f"idempotent-replayed={replayed!r}; expected a 201 replay")
            if store.endswith("-cache"):
                # A replay cache fills on a key's first replay. Replay every key once, so the cache
                # is warm at every body size (the timed warm-up reaches all 1000 keys only when
                # requests are fast, so 1 MiB cells would otherwise measure ~20% misses).
                complete_keys(server.port, body, [f"r-{i}" for i in range(REPLAY_KEYS)], replays=True)
            key_arg = "unused"
        elif scenario == "inflight":
            key_arg = f"inflight-{run_id}"
            holders = hold_in_flight(server.port, key_arg, body)
        else:
            key_arg = f"k{run_id}"
        if cfg.warmup > 0:
            warm_arg = f"w{run_id}" if scenario in ("fresh", "plain") else key_arg
            run_wrk(server.url, conc, cfg.warmup, script, [warm_arg, server.host])
            time.sleep(0.2 if body_name != "1m" else 0.5)  # let the warm-up's last requests finish

        before_server = cpu_ticks(server.proc.pid)
        before_redis = cpu_ticks(redis.proc.pid) if redis else 0
        before_stats = redis_snapshot(redis.client) if store in REDIS_STORES else None
        on_pg = pg is not None and store in PG_STORES
        before_pg = (pg.cpu_ticks(), pg.statements()) if on_pg else None
        before_machine, before_wrk = machine_ticks(), children_cpu_s()
        out = run_wrk(server.url, conc, duration, script, [key_arg, server.host])
        after_machine, after_wrk = machine_ticks(), children_cpu_s()
        after_pg = (pg.cpu_ticks(), pg.statements()) if on_pg else None
        after_stats = redis_snapshot(redis.client) if store in REDIS_STORES else None
        after_server = cpu_ticks(server.proc.pid)
        after_redis = cpu_ticks(redis.proc.pid) if redis else 0
        peak_rss_kib = proc_status_kib(server.proc.pid, "VmHWM")
        measured = True
    finally:
        for sock in holders:
            sock.close()
        if measured:
            warnings = server.stop()
        else:
            try:
                server.stop()
            except BenchError as error:  # the error on its way out matters more
                print(f"bench: also: {error}", file=sys.stderr)

    wrk = parse_wrk(out)
    requests = max(wrk["requests"], 1)
    tick_us = 1e6 / CLK_TCK
    row = {
        "store": name, "scenario": scenario, "conc": conc, "body": body_name, "server": server_name,
        "body_bytes": len(body), "duration_s": wrk["duration_s"],
        "rps": wrk["rps"], "requests": wrk["requests"],
        "p50_us": wrk["p50_us"], "p99_us": wrk["p99_us"],
        "statuses": wrk["statuses"], "replayed": wrk["replayed"],
        "socket_errors": wrk["socket_errors"], "non2xx": wrk["non2xx"],
        "server_cpu_us_per_req": (after_server - before_server) * tick_us / requests,
        "wrk_cpu_us_per_req": (after_wrk - before_wrk) * 1e6 / requests,
        "machine_busy": busy_fraction(before_machine, after_machine),
        "peak_rss_mib": peak_rss_kib / 1024,
        "server_warnings": warnings,
        "wrk_output": out,
    }
    if store in REDIS_STORES:
        calls_before, calls_after = before_stats["calls"], after_stats["calls"]
        delta = {name: calls - calls_before.get(name, 0) for name, calls in calls_after.items()}
        delta = {name: calls for name, calls in delta.items() if calls}
        # Not the client's: the driver's INFO, and a replica's REPLCONF ACKs (redis-acks).
        own_info, replica_acks = delta.get("info", 0), delta.get("replconf", 0)
        sent = sent_commands(delta, store, inner)
        executed = after_stats["total"] - before_stats["total"] - own_info - replica_acks
        usec = {name: after_stats["usec"].get(name, 0) - before_stats["usec"].get(name, 0)
                for name in delta}
        row.update({
            "redis_cpu_us_per_req": (after_redis - before_redis) * tick_us / requests,
            "redis_command_us_per_req": command_usec(delta, usec, store, inner) / requests,
            "redis_sent_per_req": sent / requests,
            "redis_executed_per_req": executed / requests,
            "redis_reads_per_req": (after_stats["reads"] - before_stats["reads"]) / requests,
            "redis_writes_per_req": (after_stats["writes"] - before_stats["writes"]) / requests,
        })
        reads = after_stats["reads"] - before_stats["reads"]
        # What Redis spent beyond the commands' own time, per socket read: reading, parsing,
        # answering, and waking for it; what a read costs whatever it carries.
        outside = row["redis_cpu_us_per_req"] - row["redis_command_us_per_req"]
        row.update({
            "redis_outside_us_per_read": outside * requests / reads if reads else None,
            "redis_command_calls": delta,
        })
    if weigh_records:
        row["record_memory"] = record_memory(redis.client, RECORD_PREFIX, used_before)
    if after_pg is not None:
        row.update({
            "pg_cpu_us_per_req": (after_pg[0] - before_pg[0]) * tick_us / requests,
            # pg_stat_statements counts a statement when it ends: those of requests still
            # running when wrk stopped are a rounding error over a cell's thousands of requests.
            "pg_statements_per_req": (after_pg[1] - before_pg[1]) / requests,
        })
    row["problems"] = check_answers(scenario, wrk)
    row["notes"] = [f"the server logged {warnings} warnings: {server.first_lines[0].strip()}"
                    if server.first_lines else f"the server logged {warnings} warnings"] if warnings else []
    return row


# ---------------------------------------------------------------------------------------------
# aggregation and output


def baseline_lines(runs, cells):
    """Each cell against its baseline twin: the per-round ratios of throughput (median, min-max),
    and the median server and Redis CPU per request of both."""
    if BASELINE_BIN is None:
        return []
    lines = ["", f"against the baseline build {BASELINE_BIN} (same run, the pair of each round):", "",
             "| cell | req/s × base | server CPU µs/req base → this | Redis (PostgreSQL) CPU µs/req base → this |",
             "|---|---|---|---|"]
    by_key = {(cell_key(r), r["round"]): r for r in runs}
    for cell in cells:
        if cell[0].endswith(BASELINE_SUFFIX) or cell[0] == "plain":
            continue
        twin = (cell[0] + BASELINE_SUFFIX,) + tuple(cell[1:])
        pairs = [(by_key[(cell, rnd)], by_key[(twin, rnd)]) for (key, rnd) in by_key
                 if key == cell and (twin, rnd) in by_key]
        ratios = [this["rps"] / base["rps"] for this, base in pairs if base["rps"] > 0]
        if not ratios:
            continue

        def med(rows, name):
            values = [r[name] for r in rows if r.get(name) is not None]
            return fmt_num(statistics.median(values), 1) if values else "–"

        this_rows, base_rows = [p[0] for p in pairs], [p[1] for p in pairs]
        store_cpu = "pg_cpu_us_per_req" if cell[0] in PG_STORES else "redis_cpu_us_per_req"
        lines.append(f"| {cell_name(cell[0], cell[4])} {cell[1]} {cell[2]} {BODY_LABEL[cell[3]]} "
                     f"| {statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f}) "
                     f"| {med(base_rows, 'server_cpu_us_per_req')} → {med(this_rows, 'server_cpu_us_per_req')} "
                     f"| {med(base_rows, store_cpu)} → {med(this_rows, store_cpu)} |")
    return lines


def cell_key(row):
    return (row["store"], row["scenario"], row["conc"], row["body"], row.get("server"))


def cell_name(store, server):
    """A cell's store as the tables show it: with the Redis server it ran against, if any."""
    return f"{store} [{server}]" if server else store


def aggregate(runs, cells):
    plain = {(r["round"], r["conc"], r["body"]): r for r in runs if r["store"] == "plain"}
    out = []
    for cell in cells:
        rows = [r for r in runs if cell_key(r) == cell]
        if not rows:
            continue
        ratios, p50_ratios = [], []
        for r in rows:
            base = plain.get((r["round"], r["conc"], r["body"]))
            if base and base["rps"] > 0:
                ratios.append(r["rps"] / base["rps"])
                p50_ratios.append(r["p50_us"] / base["p50_us"])

        def med(name, pick=statistics.median):
            values = [r[name] for r in rows if r.get(name) is not None]
            return pick(values) if values else None

        def least(name):
            return med(name, min)

        def most(name):
            return med(name, max)

        memory = [r["record_memory"] for r in rows if r.get("record_memory")]
        out.append({
            "store": cell[0], "scenario": cell[1], "conc": cell[2], "body": cell[3],
            "server": cell[4], "rounds": len(rows),
            "rps": med("rps"), "rps_min": min(r["rps"] for r in rows),
            "rps_max": max(r["rps"] for r in rows),
            "ratio": statistics.median(ratios) if ratios else None,
            "ratio_min": min(ratios) if ratios else None,
            "ratio_max": max(ratios) if ratios else None,
            "p50_us": med("p50_us"), "p99_us": med("p99_us"),
            "p50_ratio": statistics.median(p50_ratios) if p50_ratios else None,
            "server_cpu_us_per_req": med("server_cpu_us_per_req"),
            "wrk_cpu_us_per_req": med("wrk_cpu_us_per_req"),
            "machine_busy": med("machine_busy"),
            "redis_cpu_us_per_req": med("redis_cpu_us_per_req"),
            "redis_cpu_us_per_req_min": least("redis_cpu_us_per_req"),
            "redis_cpu_us_per_req_max": most("redis_cpu_us_per_req"),
            "redis_command_us_per_req": med("redis_command_us_per_req"),
            "redis_reads_per_req": med("redis_reads_per_req"),
            "redis_outside_us_per_read": med("redis_outside_us_per_read"),
            "redis_sent_per_req": med("redis_sent_per_req"),
            "redis_executed_per_req": med("redis_executed_per_req"),
            "pg_cpu_us_per_req": med("pg_cpu_us_per_req"),
            "pg_statements_per_req": med("pg_statements_per_req"),
            "peak_rss_mib": med("peak_rss_mib"),
            "problems": sorted({p for r in rows for p in r["problems"]}),
            "flagged_rounds": sum(1 for r in rows if r["problems"]),
            "notes": sorted({re.sub(r"logged \d+ warnings", "logged warnings", n)
                             for r in rows for n in r["notes"]}),
            "warnings_per_round": [r["server_warnings"] for r in rows],
            "record_memory": memory or None,
        })
    return out


def fmt_us(us):
    if us is None:
        return "–"
    if us >= 10_000:
        return f"{us / 1000:.0f} ms"
    if us >= 1000:
        return f"{us / 1000:.2f} ms"
    return f"{us:.0f} µs"


def fmt_num(value, digits=1):
    return "–" if value is None else f"{value:.{digits}f}"


def fmt_percent(fraction):
    return "–" if fraction is None else f"{fraction * 100:.0f}%"


def fmt_ratio(agg):
    if agg["store"] == "plain":
        return "1"
    if agg["ratio"] is None:
        return "–"
    if agg["rounds"] == 1:
        return f"{agg['ratio']:.2f}"
    return f"{agg['ratio']:.2f} ({agg['ratio_min']:.2f}–{agg['ratio_max']:.2f})"


def table(aggs):
    header = ("| store | scenario | conc | body | req/s | × plain | p50 | p99 | p50 × plain "
              "| server CPU µs/req | Redis (PostgreSQL) CPU µs/req "
              "| Redis cmds/req sent / executed (PostgreSQL statements/req) | peak RSS MiB "
              "| wrk CPU µs/req | machine busy |")
    lines = [header, "|" + "---|" * 15]
    for a in aggs:
        store = cell_name(a["store"], a["server"]) + (" ⚠" if a["problems"] else "") + \
            (" †" if a["notes"] else "")
        cmds = "–" if a["redis_sent_per_req"] is None else \
            f"{a['redis_sent_per_req']:.2f} / {a['redis_executed_per_req']:.2f}"
        store_cpu = a["redis_cpu_us_per_req"]
        if a.get("pg_statements_per_req") is not None:
            cmds = f"({a['pg_statements_per_req']:.2f})"
            store_cpu = a["pg_cpu_us_per_req"]
        p50_ratio = "1" if a["store"] == "plain" else fmt_num(a["p50_ratio"], 2)
        lines.append(
            f"| {store} | {a['scenario']} | {a['conc']} | {BODY_LABEL[a['body']]} "
            f"| {a['rps']:.0f} | {fmt_ratio(a)} | {fmt_us(a['p50_us'])} | {fmt_us(a['p99_us'])} "
            f"| {p50_ratio} | {fmt_num(a['server_cpu_us_per_req'])} "
            f"| {fmt_num(store_cpu)} | {cmds} | {fmt_num(a['peak_rss_mib'])} "
            f"| {fmt_num(a.get('wrk_cpu_us_per_req'))} | {fmt_percent(a.get('machine_busy'))} |")
    return "\n".join(lines)


def warning_lines(aggs):
    lines = []
    for a in aggs:
        name = f"{cell_name(a['store'], a['server'])} {a['scenario']} {a['conc']} {BODY_LABEL[a['body']]}"
        if a["problems"]:
            lines.append(f"⚠ {name}: wrong answers in {a['flagged_rounds']}/{a['rounds']} rounds: "
                         + "; ".join(a["problems"]))
        if a["notes"]:
            counts = ", ".join(str(w) for w in a["warnings_per_round"])
            lines.append(f"† {name}: {'; '.join(a['notes'])} (per round: {counts})")
    return lines


def shard_lines(aggs):
    """What one Redis core can serve: every Redis cell's Redis CPU per request (median over
    rounds, min-max) and its inverse, the requests per second that keep one core busy, by
    server; with the app server's CPU and the commands per request beside them."""
    rows = [a for a in aggs if a["redis_cpu_us_per_req"] is not None]
    if not rows:
        return []
    order = {name: i for i, name in enumerate(STORES)}
    servers = list(dict.fromkeys(a["server"] for a in rows))
    rows.sort(key=lambda a: (a["body"] != "100", list(BODIES).index(a["body"]),
                             list(CONCURRENCY).index(a["conc"]), order.get(mode_of(a["store"]), 99),
                             a["store"], LAYERED_SCENARIOS.index(a["scenario"]),
                             servers.index(a["server"])))
    lines = ["What a Redis core can serve (Redis CPU from /proc, median over rounds, min–max; "
             "the ceiling is 10⁶ ÷ that: the requests per second that would keep one Redis core "
             "busy at this load; a busier Redis reads more commands per wake-up, so the ceiling is "
             "a floor. *Running commands* is the time `INFO commandstats` counts in the commands the "
             "client sent, scripts included: Redis's CPU without reading, parsing and answering and "
             "without its event loop. *Reads/req* are Redis's socket reads (`INFO stats` "
             "total_reads_processed) per request: how many commands share a write; *outside µs per "
             "read* is Redis's CPU beyond running commands, per read: reading, parsing, answering "
             "and waking up, which fewer, fuller reads cut and faster commands do not):", "",
             "| store | scenario | conc | body | Redis server | Redis CPU µs/req | req/s per Redis core "
             "| of which running commands µs/req | Redis reads/req | outside µs per read "
             "| req/s here | server CPU µs/req | Redis cmds/req sent / executed |",
             "|" + "---|" * 13]
    for a in rows:
        cpu, low, high = (a["redis_cpu_us_per_req"], a["redis_cpu_us_per_req_min"],
                          a["redis_cpu_us_per_req_max"])
        spread = f" ({low:.1f}–{high:.1f})" if a["rounds"] > 1 else ""
        ceiling = "–" if not cpu else f"{1e6 / cpu:,.0f}"
        if cpu and a["rounds"] > 1 and low and high:
            ceiling += f" ({1e6 / high:,.0f}–{1e6 / low:,.0f})"
        cmds = "–" if a["redis_sent_per_req"] is None else \
            f"{a['redis_sent_per_req']:.2f} / {a['redis_executed_per_req']:.2f}"
        lines.append(f"| {a['store']} | {a['scenario']} | {a['conc']} | {BODY_LABEL[a['body']]} "
                     f"| {a['server']} | {cpu:.1f}{spread} | {ceiling} "
                     f"| {fmt_num(a.get('redis_command_us_per_req'))} "
                     f"| {fmt_num(a.get('redis_reads_per_req'), 3)} "
                     f"| {fmt_num(a.get('redis_outside_us_per_read'), 0)} | {a['rps']:,.0f} "
                     f"| {fmt_num(a['server_cpu_us_per_req'])} | {cmds} |")
    # CPU per request moves with the machine's speed (a shared or throttled host): plain axum's
    # own is the yardstick to compare runs by.
    plain = [f"{a['conc']} {fmt_num(a['server_cpu_us_per_req'])} µs" for a in aggs
             if a["store"] == "plain" and a["body"] == "100"]
    if plain:
        lines += ["", f"Plain axum's server CPU per request in this run (100 B bodies): {', '.join(plain)}; "
                  "CPU figures scale with the machine's speed, so compare runs whose plain rows agree."]
    return lines


def memory_lines(aggs):
    """Redis memory per completed record, from the redis store's fresh-key cells."""
    rows = [a for a in aggs if a.get("record_memory")]
    if not rows:
        return []
    lines = ["Redis memory per completed record (after the redis store's fresh-key cells: "
             "`MEMORY USAGE` and `STRLEN` of up to 200 completed records, median; used_memory's "
             "growth over the cell ÷ keys; medians over rounds):", "",
             "| store | Redis server | conc | request body | keys | MEMORY USAGE B (min–max) | STRLEN B "
             "| Redis's own B (USAGE − STRLEN) | used_memory Δ ÷ keys B | key name B |",
             "|" + "---|" * 10]
    layouts = {}
    for a in rows:
        runs = a["record_memory"]

        def med(name):
            values = [m[name] for m in runs if m.get(name) is not None]
            return statistics.median(values) if values else None

        usage, strlen = med("memory_usage"), med("strlen")
        low = min(m["memory_usage_min"] for m in runs)
        high = max(m["memory_usage_max"] for m in runs)
        lines.append(f"| {a['store']} | {a['server']} | {a['conc']} | {BODY_LABEL[a['body']]} | {med('keys'):,.0f} "
                     f"| {usage:.0f} ({low}–{high}) | {strlen:.0f} | {usage - strlen:.0f} "
                     f"| {fmt_num(med('used_memory_per_key'), 0)} | {med('key_len'):.0f} |")
        layouts.setdefault(a["body"], runs[-1])
    paths = {}
    for a in rows:
        weighed = a["record_memory"][-1]["write_paths"]
        if weighed is not None:
            paths.setdefault(a["server"], weighed)
    lines += ["", "The same records written the two ways a completion writes (`MEMORY USAGE`, B): by "
              "the work tree's complete.lua onto the in-flight record (one `SET` of the whole record; "
              "before issue 26's last change, `SETRANGE` then `APPEND` of the payload, which left the "
              "string room to grow) and by one `SET` of the whole record; "
              "the bench's response body and longer ones:", "",
              "| Redis server | response body B | record (STRLEN) B | complete.lua | one SET |",
              "|---|---|---|---|---|"]
    for server, weighed in paths.items():
        for w in weighed:
            lines.append(f"| {server} | {w['body']} | {w['strlen']} | {w['complete_lua']} | {w['one_set']} |")
    for body, sample in layouts.items():
        parts = "; ".join(f"{part} {size}" for part, size in sample["layout"].items())
        lines += ["", f"Where a record's {sum(sample['layout'].values())} bytes go "
                  f"({BODY_LABEL[body]} request bodies): {parts}. Stored headers: "
                  f"{', '.join('`' + h + '`' for h in sample['stored_headers']) or 'none'}."]
    return lines


def ping_floor(redis):
    cmd = ["redis-benchmark", "-p", str(redis.port), "-c", "1", "-n", "20000", "-t", "ping", "-q"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
    except (OSError, subprocess.TimeoutExpired) as error:
        return {"error": str(error)}
    floor = {}
    for name, rps, p50 in re.findall(r"(PING_\w+): ([\d.]+) requests per second, p50=([\d.]+) msec",
                                     out.replace("\r", "\n")):
        floor[name] = {"rps": float(rps), "p50_us": float(p50) * 1000}
    return floor


def floor_text(floor):
    if not floor or "error" in floor:
        return f"one loopback round trip: not measured ({floor.get('error', 'no output') if floor else 'no redis'})"
    parts = [f"{name} p50 {fmt_us(v['p50_us'])}, {v['rps']:.0f} req/s" for name, v in floor.items()]
    return ("one loopback round trip (`redis-benchmark -c 1 -n 20000 -t ping`, same redis-server): "
            + "; ".join(parts))


SVG_COLORS = {"memory": "#4c78a8", "redis": "#f58518", "redis-cache": "#54a24b",
              "redis-acks": "#e45756", "postgres": "#b279a2"}


def chart_svg(aggs, rounds):
    """A bar chart of "x plain" throughput for 100 B bodies: one panel per concurrency, bars
    grouped by scenario, one bar per store, whiskers for the min-max over rounds."""
    data = [a for a in aggs if a["body"] == "100" and a["store"] != "plain" and a["ratio"] is not None]
    concs = [c for c in CONCURRENCY if any(a["conc"] == c for a in data)]
    # One bar per store and Redis server (--redis-servers), in the order the cells ran.
    stores = list(dict.fromkeys((a["store"], a["server"]) for a in data
                                if mode_of(a["store"]) in STORES))
    palette = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#b279a2", "#72b7b2", "#eeca3b",
               "#ff9da6", "#9d755d", "#bab0ac"]
    several = len({server for _, server in stores}) > 1
    colors = {series: (palette[i % len(palette)] if several else SVG_COLORS.get(series[0], "#999"))
              for i, series in enumerate(stores)}
    scenarios = [s for s in LAYERED_SCENARIOS if any(a["scenario"] == s for a in data)]
    if not data:
        return None
    top = max([1.0] + [a["ratio_max"] for a in data])
    step = 0.2 if top <= 1.6 else 0.5
    y_max = math.ceil(top * 1.08 / step) * step
    panel_w, panel_h, left, top_pad, gap = 380, 260, 60, 84, 40
    width = left + len(concs) * panel_w + (len(concs) - 1) * gap + 20
    # The legend: one entry per bar series, then plain's line, wrapped into rows that fit.
    legend = [(cell_name(*series), colors[series]) for series in stores] + [("plain axum (1.0)", None)]
    legend_at, x, row = [], left, 0
    for label, _ in legend:
        advance = 30 + 8 * len(label) + 20
        if x + advance > width and x > left:
            x, row = left, row + 1
        legend_at.append((x, row))
        x += advance
    height = top_pad + panel_h + 100 + 22 * row
    esc = lambda s: s.replace("&", "&amp;").replace("<", "&lt;")  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
           f'<text x="{width / 2}" y="24" text-anchor="middle" font-size="15" font-weight="bold">'
           f'Throughput with the idempotency layer, × plain axum (100 B bodies)</text>',
           f'<text x="{width / 2}" y="44" text-anchor="middle" fill="#555">median of {rounds} '
           f'round{"s" if rounds != 1 else ""}, whiskers: min–max; plain axum = 1</text>']
    y = lambda v: top_pad + panel_h - v / y_max * panel_h  # noqa: E731
    for index, conc in enumerate(concs):
        x0 = left + index * (panel_w + gap)
        threads, connections = CONCURRENCY[conc]
        out.append(f'<text x="{x0 + panel_w / 2}" y="{top_pad - 10}" text-anchor="middle" '
                   f'font-weight="bold">{conc}: wrk -t{threads} -c{connections}</text>')
        ticks = int(round(y_max / step))
        for t in range(ticks + 1):
            value = t * step
            out.append(f'<line x1="{x0}" x2="{x0 + panel_w}" y1="{y(value):.1f}" y2="{y(value):.1f}" '
                       f'stroke="#e5e5e5"/>')
            out.append(f'<text x="{x0 - 6}" y="{y(value) + 4:.1f}" text-anchor="end" fill="#333">'
                       f'{value:.1f}</text>')
        out.append(f'<line x1="{x0}" x2="{x0 + panel_w}" y1="{y(1):.1f}" y2="{y(1):.1f}" '
                   f'stroke="#333" stroke-dasharray="5,4"/>')
        group_w = panel_w / max(len(scenarios), 1)
        bar_w = min(36, (group_w - 24) / max(len(stores), 1))
        for g, scenario in enumerate(scenarios):
            gx = x0 + g * group_w
            start = gx + (group_w - bar_w * len(stores)) / 2
            for b, series in enumerate(stores):
                store = cell_name(*series)
                match = [a for a in data
                         if (a["store"], a["server"], a["scenario"], a["conc"]) == series + (scenario, conc)]
                if not match:
                    continue
                a = match[0]
                bx = start + b * bar_w
                out.append(f'<rect x="{bx + 2:.1f}" y="{y(a["ratio"]):.1f}" width="{bar_w - 4:.1f}" '
                           f'height="{y(0) - y(a["ratio"]):.1f}" fill="{colors[series]}">'
                           f'<title>{esc(store)} {scenario} {conc}: {a["ratio"]:.2f} × plain</title></rect>')
                cx = bx + bar_w / 2
                if a["rounds"] > 1:
                    out.append(f'<line x1="{cx:.1f}" x2="{cx:.1f}" y1="{y(a["ratio_min"]):.1f}" '
                               f'y2="{y(a["ratio_max"]):.1f}" stroke="#222"/>')
                out.append(f'<text x="{cx:.1f}" y="{y(a["ratio_max"]) - 4:.1f}" text-anchor="middle" '
                           f'font-size="10">{a["ratio"]:.2f}</text>')
            out.append(f'<text x="{gx + group_w / 2:.1f}" y="{y(0) + 18:.1f}" text-anchor="middle">'
                       f'{scenario}</text>')
        out.append(f'<line x1="{x0}" x2="{x0 + panel_w}" y1="{y(0):.1f}" y2="{y(0):.1f}" stroke="#333"/>')
        out.append(f'<line x1="{x0}" x2="{x0}" y1="{y(0):.1f}" y2="{y(y_max):.1f}" stroke="#333"/>')
    out.append(f'<text transform="translate(16 {top_pad + panel_h / 2}) rotate(-90)" '
               f'text-anchor="middle">req/s × plain</text>')
    out.append(f'<text x="{left + (width - left) / 2}" y="{y(0) + 40:.1f}" text-anchor="middle" '
               f'fill="#333">scenario</text>')
    for (label, color), (lx, row) in zip(legend, legend_at):
        ly = y(0) + 66 + 22 * row
        if color is None:
            out.append(f'<line x1="{lx}" x2="{lx + 24}" y1="{ly - 4:.1f}" y2="{ly - 4:.1f}" stroke="#333" '
                       f'stroke-dasharray="5,4"/>')
            out.append(f'<text x="{lx + 30}" y="{ly:.1f}">{esc(label)}</text>')
        else:
            out.append(f'<rect x="{lx}" y="{ly - 10:.1f}" width="12" height="12" fill="{color}"/>')
            out.append(f'<text x="{lx + 18}" y="{ly:.1f}">{esc(label)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def environment(servers, pg=None):
    """The machine and the tools; `servers` as redis_servers() gives them."""
    cpu = "unknown"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "kernel": os.uname().release,
        "wrk": tool_version(["wrk", "-v"]),
        "redis": "; ".join(f"{label}: {version}" if len(servers) > 1 else version
                           for label, _, version in servers) or None,
        "postgres": pg.version() if pg is not None else None,
        "rustc": tool_version(["rustc", "-V"]),
    }


def command_line():
    env = " ".join(f"{name}={os.environ[name]}" for name in sorted(os.environ)
                   if name.startswith("BENCH_"))
    return " ".join(filter(None, [env, "scripts/bench.sh", shlex.join(sys.argv[1:])]))


# ---------------------------------------------------------------------------------------------
# modes


class Config:
    def __init__(self, args):
        self.full = args.full
        self.rounds = args.rounds or int(os.environ.get("BENCH_ROUNDS", 3))
        self.duration = args.duration or float(os.environ.get("BENCH_DURATION", 5))
        self.duration_1m = float(os.environ.get("BENCH_DURATION_1M", min(self.duration, 3)))
        self.warmup = float(os.environ.get("BENCH_WARMUP", 1))
        if args.full:
            stores = ["plain", "memory", "redis", "redis-cache", "redis-acks"]
            scenarios, concs, bodies = LAYERED_SCENARIOS, ["c32", "c1"], ["100", "16k", "1m"]
        else:
            stores = ["plain", "redis", "redis-cache"]
            scenarios, concs, bodies = ["fresh", "replay"], ["c32", "c1"], ["100"]
        self.stores = pick("store", args.stores, stores, STORES)
        if "plain" not in self.stores:
            self.stores.insert(0, "plain")  # every ratio needs its plain baseline
        self.scenarios = pick("scenario", args.scenarios, scenarios, LAYERED_SCENARIOS)
        self.concs = pick("concurrency", args.conc, concs, list(CONCURRENCY))
        self.bodies = pick("body", args.bodies, bodies, list(BODIES))
        self.bodies_bytes = {name: make_body(BODIES[name]) for name in self.bodies}

    def duration_for(self, body):
        return self.duration_1m if body == "1m" else self.duration

    def scenarios_of(self, store):
        if store == "plain":
            return ["plain"]
        if store == "redis-cache":
            # The cache serves completed records only: fresh keys and in-flight answers are the
            # redis store's.
            return [s for s in self.scenarios if s == "replay"]
        if store == "redis-acks":
            # Only claims and completions wait for the replica: replays and in-flight answers
            # are the redis store's.
            return [s for s in self.scenarios if s == "fresh"]
        if store in PEER_STORES:
            # axum-idempotent has no claim (a key in flight runs the handler again), so the
            # peers are compared on fresh keys and replays.
            return [s for s in self.scenarios if s in ("fresh", "replay")]
        return self.scenarios

    def cells(self, servers):
        """(store, scenario, concurrency, body, Redis server label or None), in the order every
        round runs them: a Redis store's cells once per server in `servers`, one after another."""
        cells = []
        for body in self.bodies:
            for conc in self.concs:
                for store in self.stores:
                    for server in (servers if store in REDIS_STORES else [None]):
                        for scenario in self.scenarios_of(store):
                            if BASELINE_BIN is not None and store != "plain":
                                cells.append((store + BASELINE_SUFFIX, scenario, conc, body, server))
                            cells.append((store, scenario, conc, body, server))
        return cells


def build_peers():
    """Builds bench/peers (its own package and lock file; idempotent 2.0 declares rust-version
    1.98 and builds with older toolchains)."""
    cmd = ["cargo", "build", "--release", "--locked", "--ignore-rust-version",
           "--manifest-path", str(PEERS_DIR / "Cargo.toml")]
    if subprocess.run(cmd).returncode != 0:
        raise BenchError(f"could not build the peer servers: {shlex.join(cmd)}")


def pick(what, given, default, known):
    if not given:
        return list(default)
    aliases = {"100b": "100", "16kib": "16k", "1mib": "1m", "1": "c1", "32": "c32"}
    chosen = [aliases.get(item.strip().lower(), item.strip().lower()) for item in given.split(",")]
    unknown = [item for item in chosen if item not in known]
    if unknown:
        raise BenchError(f"unknown {what} {', '.join(unknown)}; known: {', '.join(known)}")
    return [item for item in known if item in chosen]


def probe_stores(cfg, tmp, redis, pg=None):
    """Drops stores this server build does not accept (e.g. redis-cache before it exists)."""
    for store in list(cfg.stores):
        if store in ("plain", "memory", "redis"):
            continue
        try:
            for name in [store] + ([store + BASELINE_SUFFIX] if BASELINE_BIN is not None else []):
                Server(tmp, name, redis, pg).stop()
        except UnknownMode as error:
            print(f"note: skipping store {store}: {error}")
            cfg.stores.remove(store)


def run_matrix(args):
    cfg = Config(args)
    started = time.monotonic()
    needs_redis = any(store in REDIS_STORES for store in cfg.stores)
    needs_replica = "redis-acks" in cfg.stores
    needs_pg = any(store in PG_STORES for store in cfg.stores)
    out_dir = Path(args.out) if args.out else ROOT / "bench"
    name = "results" if cfg.full else "quick"
    servers = redis_servers(args.redis_servers or os.environ.get("BENCH_REDIS_SERVERS")) \
        if needs_redis else []
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        # One redis-server (and, for redis-acks, one with a replica) per server build, each
        # started once; a Redis cell gets its server's, flushed.
        redises, acks_redises = {}, {}
        redis = None  # the first server's: the store probe, and --soak
        pg = None
        try:
            for label, binary, _ in servers:
                redises[label] = RedisServer(tmp, name=f"redis-{label}", binary=binary)
                redises[label].label = label
                if needs_replica:
                    acks_redises[label] = ReplicatedRedis(tmp, binary=binary, label=label)
                    acks_redises[label].label = label
            redis = redises[servers[0][0]] if servers else None
            pg = PgServer(tmp) if needs_pg else None
            inner, inner_source = inner_commands()
            for label, server in redises.items():
                check_counting(server, inner)
            probe_stores(cfg, tmp, redis, pg)
            cells = cfg.cells([label for label, _, _ in servers])
            print(f"{'full' if cfg.full else 'quick'} mode: {len(cells)} cells × {cfg.rounds} rounds, "
                  f"{cfg.duration:g} s per cell ({cfg.duration_1m:g} s for 1 MiB bodies), "
                  f"warm-up {cfg.warmup:g} s; {os.cpu_count()} CPUs")
            for label, binary, version in servers:
                print(f"Redis server {label} on port {redises[label].port}: {binary} ({version})")
            if redis:
                print(f"commands run inside the scripts (from {inner_source}): {', '.join(sorted(inner))}; "
                      f"counting of commands sent checked on every server")
            runs = []
            for rnd in range(1, cfg.rounds + 1):
                for index, cell in enumerate(cells, 1):
                    pool = acks_redises if mode_of(cell[0]) == "redis-acks" else redises
                    row = run_cell(cfg, cell, tmp, pool.get(cell[4]), inner, pg)
                    row["round"] = rnd
                    runs.append(row)
                    flag = "  ⚠ " + "; ".join(row["problems"]) if row["problems"] else ""
                    print(f"round {rnd}/{cfg.rounds} cell {index:>2}/{len(cells)} "
                          f"{cell_name(cell[0], cell[4]):>24} {cell[1]:>8} {cell[2]:>3} "
                          f"{BODY_LABEL[cell[3]]:>6}: {row['rps']:>8.0f} req/s  "
                          f"p50 {fmt_us(row['p50_us']):>8}{flag}", flush=True)
            floors = {label: ping_floor(server) for label, server in redises.items()}
            if pg:
                print(f"PostgreSQL on port {pg.port}: {pg.version()}")
            env = environment(servers, pg)
        finally:
            for server in list(redises.values()) + list(acks_redises.values()):
                server.stop()
            if pg:
                pg.stop()
            PROCS.stop_all()

    aggs = aggregate(runs, cells)
    elapsed = time.monotonic() - started
    text = table(aggs)
    warnings = warning_lines(aggs)
    floor_lines = [(f"{label}: " if len(floors) > 1 else "") + floor_text(floor)
                   for label, floor in floors.items()]
    shard = shard_lines(aggs)
    memory = memory_lines(aggs)
    print()
    print(text)
    print()
    for line in floor_lines or ["no Redis store in this run"]:
        print(line)
    for line in warnings:
        print(line)
    comparison = baseline_lines(runs, cells)
    for line in comparison:
        print(line)
    for block in (shard, memory):
        if block:
            print()
            print("\n".join(block))
    print(f"\n{len(cells)} cells × {cfg.rounds} rounds in {elapsed / 60:.1f} min")

    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"command": command_line(), "mode": "full" if cfg.full else "quick", "rounds": cfg.rounds,
            "duration_s": cfg.duration, "duration_1m_s": cfg.duration_1m, "warmup_s": cfg.warmup,
            "elapsed_s": round(elapsed, 1), "inner_commands": sorted(inner),
            "inner_commands_from": inner_source,
            "redis_servers": [{"label": label, "binary": binary, "version": version}
                              for label, binary, version in servers], **env}
    md = [f"# HTTP benchmark: axum with and without tower-idempotency ({meta['mode']} mode)", "",
          f"- command: `{meta['command']}`",
          f"- date: {env['date']}; elapsed {elapsed / 60:.1f} min",
          f"- machine: `nproc` = {env['nproc']}, {env['cpu']}, Linux {env['kernel']}",
          f"- tools: {env['wrk']}; {env['redis'] or 'no redis-server'}; "
          f"{env.get('postgres') or 'no PostgreSQL'}; {env['rustc']}",
          f"- {cfg.rounds} rounds × {len(cells)} cells, interleaved; {cfg.duration:g} s per cell "
          f"({cfg.duration_1m:g} s for 1 MiB bodies) after a {cfg.warmup:g} s warm-up; "
          f"a fresh server per cell; medians over rounds",
          "", text, ""]
    md += ["- " + line for line in floor_lines]
    md += ["- " + line for line in warnings]
    md += comparison
    for block in (shard, memory):
        if block:
            md += [""] + block
    md += ["", "Columns: *× plain* is req/s over the plain cell of the same concurrency and body "
           "size in the same round, median (min–max) over rounds; *p50 × plain* likewise for the "
           "median latency. CPU µs/req is utime+stime of the process over the measured run ÷ "
           "requests. *Redis cmds/req sent* counts commands the client sends (SET, EVALSHA, …): every command in `INFO commandstats` but the driver's INFO and CLIENT LIST, a "
           "replica's REPLCONF (redis-acks: its replica answers each WAIT) and those the store's Lua "
           "scripts call: all GETRANGE, SETRANGE, APPEND and DEL calls (the client sends none); as "
           "many PEXPIRE as SETRANGE calls; as SET calls, the GETRANGE calls less the SETRANGE and DEL calls (complete.lua "
           "writes a completed record with one SET; every other branch but a lost claim calls "
           "SETRANGE or DEL); as SPUBLISH calls (a notice for a waited-for record, which no cell "
           "has), at most the APPEND, DEL and those SET calls; the rest of SET and SPUBLISH "
           "being the client's; checked at the start of the run on every server against each branch "
           "of scripts/*.lua. For the peers, every command their scripts call counts as called in a "
           "script. *executed* is the `total_commands_processed` "
           "delta, which also counts the commands run inside the scripts. Both include the "
           "requests still in flight when wrk stops (up to 32 per cell). Peak RSS is the server's "
           "VmHWM. *wrk CPU* is the load generator's own CPU per request. *machine busy* is the share "
           "of both cores' time not idle during the measured run (/proc/stat): near 100% a cell is "
           "CPU-bound, and its × plain is about plain's CPU per request (wrk + server) over the cell's"
           " (wrk + server + Redis); below it, requests also waited on round trips with a core idle, "
           "and × plain is that CPU ratio times busy ÷ plain's busy. Scenarios: *fresh* = a new "
           "key per request; *replay* = cycling over 1000 completed keys; *inflight* = one key "
           "held in flight, every answer 409. c32 = `wrk -t2 -c32`, c1 = `wrk -t1 -c1`. Every "
           "cell runs the same wrk Lua script (a `request()` that sets the key, a `response()` "
           "that counts statuses), plain included. ⚠ marks a cell whose answers were not all "
           "as expected (more than 1% unexpected statuses, replays where none belong or the other "
           "way round, socket errors); † a cell whose server logged warnings (the server counts "
           "them and prints only the first few, so they cost no terminal I/O)."]
    if cfg.full:
        svg = chart_svg(aggs, cfg.rounds)
        if svg:
            (out_dir / "chart.svg").write_text(svg)
            md += ["", "![× plain throughput, 100 B bodies](chart.svg)"]
    (out_dir / f"{name}.md").write_text("\n".join(md) + "\n")
    (out_dir / f"{name}.json").write_text(json.dumps(
        {"meta": meta, "ping_floor": floors, "cells": aggs, "runs": runs}, indent=1) + "\n")
    print(f"wrote {out_dir / (name + '.md')}, {out_dir / (name + '.json')}"
          + (f", {out_dir / 'chart.svg'}" if cfg.full else ""))
    return 0


def slope_per_minute(samples):
    """Least-squares slope (value per minute) of (seconds, value) samples."""
    if len(samples) < 2:
        return 0.0
    xs = [s for s, _ in samples]
    ys = [v for _, v in samples]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return 0.0 if var == 0 else sum((x - mx) * (y - my) for x, y in samples) / var * 60


def run_soak(args):
    minutes = args.soak
    store = args.soak_store
    if store not in ("redis", "memory"):
        raise BenchError("--soak-store is redis or memory")
    out_dir = Path(args.out) if args.out else ROOT / "bench"
    body = make_body(100)
    interval = float(os.environ.get("BENCH_SOAK_INTERVAL", 10))
    samples = []
    # Every fresh key leaves a record of about 0.6 KiB in Redis for 24 h: at ~20 000 req/s that is
    # ~0.7 GiB a minute. Cap Redis so a long soak cannot exhaust the machine's memory; at the cap it
    # evicts the records nearest their expiry (volatile-ttl).
    cap = min(4 << 30, int(proc_meminfo_kib("MemAvailable") * 1024 * 0.4))
    servers = redis_servers(args.redis_servers or os.environ.get("BENCH_REDIS_SERVERS"))[:1] \
        if store == "redis" else []
    with tempfile.TemporaryDirectory(prefix="bench-soak-") as tmp:
        redis = RedisServer(tmp, maxmemory=cap, binary=servers[0][1]) if store == "redis" else None
        try:
            server = Server(tmp, store, redis)
            script = write_wrk_script(tmp, "fresh", body)
            threads, connections = CONCURRENCY["c32"]
            seconds = int(minutes * 60)
            cmd = ["wrk", f"-t{threads}", f"-c{connections}", f"-d{seconds}s", "--timeout=5s",
                   "--latency", "-s", str(script), server.url, "--", "soak%08x" % random.getrandbits(32),
                   server.host]
            print(f"soak: {store} store, wrk -t{threads} -c{connections}, fresh keys, 100 B bodies, "
                  f"{minutes:g} min; a sample every {interval:g} s")
            print(f"{'t (s)':>6} {'server RSS MiB':>15} {'redis used_memory MiB':>22}")
            wrk = PROCS.spawn(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            collected = {}
            reader = threading.Thread(target=lambda: collected.update(zip(("out", "err"), wrk.communicate())))
            reader.start()
            start = time.monotonic()
            next_sample = start
            while True:
                now = time.monotonic()
                if now >= next_sample:
                    rss = proc_status_kib(server.proc.pid, "VmRSS") / 1024
                    used = int(redis.client.info("memory")["used_memory"]) / 2**20 if redis else None
                    samples.append((now - start, rss, used))
                    print(f"{now - start:>6.0f} {rss:>15.1f} {fmt_num(used):>22}", flush=True)
                    next_sample += interval
                if not reader.is_alive():
                    break
                reader.join(timeout=max(0.0, min(next_sample - time.monotonic(), 1.0)))
            if time.monotonic() - start - samples[-1][0] >= 1:
                rss = proc_status_kib(server.proc.pid, "VmRSS") / 1024
                used = int(redis.client.info("memory")["used_memory"]) / 2**20 if redis else None
                samples.append((time.monotonic() - start, rss, used))
            if wrk in PROCS.procs:
                PROCS.procs.remove(wrk)
            if wrk.returncode != 0:
                raise BenchError(f"wrk failed with status {wrk.returncode}: {collected.get('err')}")
            result = parse_wrk(collected["out"])
            peak = proc_status_kib(server.proc.pid, "VmHWM") / 1024
            evicted = int(redis.client.info("stats")["evicted_keys"]) if redis else 0
            warnings = server.stop()
            env = environment(servers if redis else [])
        finally:
            if redis:
                redis.stop()
            PROCS.stop_all()

    problems = ["⚠ " + p for p in check_answers("fresh", result)]
    if warnings:
        problems.append(f"† the server logged {warnings} warnings: "
                        f"{server.first_lines[0].strip() if server.first_lines else '?'}")
    rss = [(t, r) for t, r, _ in samples]
    half = [(t, r) for t, r in rss if t >= rss[-1][0] / 2]
    rss_slope = slope_per_minute(half)
    lines = [f"# Soak: {store} store, {minutes:g} min", "",
             f"- command: `{command_line()}`",
             f"- date: {env['date']}; `nproc` = {env['nproc']}, {env['cpu']}",
             f"- tools: {env['wrk']}; {env['redis'] or 'no redis-server'}",
             f"- load: `wrk -t2 -c32`, a fresh key per request, 100 B bodies, default layer",
             f"- {result['requests']} requests, {result['rps']:.0f} req/s, p50 {fmt_us(result['p50_us'])}, "
             f"p99 {fmt_us(result['p99_us'])}; answers {result['statuses']}",
             f"- server RSS: first {rss[0][1]:.1f} MiB, last {rss[-1][1]:.1f} MiB, max "
             f"{max(r for _, r in rss):.1f} MiB, peak (VmHWM) {peak:.1f} MiB; slope over the second "
             f"half {rss_slope:+.2f} MiB/min"]
    if redis:
        used = [(t, u) for t, _, u in samples]
        used_slope = slope_per_minute([(t, u) for t, u in used if t >= used[-1][0] / 2])
        lines.append(f"- Redis used_memory: first {used[0][1]:.1f} MiB, last {used[-1][1]:.1f} MiB, "
                     f"slope over the second half {used_slope:+.2f} MiB/min. It grows by design: every "
                     f"fresh key leaves a completed record for the 24 h retention. The server's RSS "
                     f"should stay flat.")
        lines.append(f"- Redis ran with `--maxmemory {cap >> 20}mb --maxmemory-policy volatile-ttl` "
                     f"(40% of available memory, at most 4 GiB) so a long soak cannot exhaust the "
                     f"machine; keys evicted at the cap: {evicted}.")
    else:
        lines.append("- The memory store holds at most 64 MiB of records (its default bound), so its "
                     "RSS is bounded; once full, each fresh key evicts the completed records nearest "
                     "their expiry and the store logs one warning (counted below).")
    lines += ["- " + p for p in problems]
    lines += ["", "| t (s) | server RSS MiB | Redis used_memory MiB |", "|---|---|---|"]
    lines += [f"| {t:.0f} | {r:.1f} | {fmt_num(u)} |" for t, r, u in samples]
    text = "\n".join(lines) + "\n"
    print()
    print(text)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "soak.md").write_text(text)
    print(f"wrote {out_dir / 'soak.md'}")
    return 1 if any(p.startswith("⚠") for p in problems) else 0


def on_sigterm(*_):
    print("bench: terminated; stopping the servers", file=sys.stderr)
    sys.exit(143)


def main():
    parser = argparse.ArgumentParser(
        prog="scripts/bench.sh", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="environment: BENCH_ROUNDS (3), BENCH_DURATION (5 s per cell), BENCH_DURATION_1M "
               "(min(duration, 3) s for 1 MiB cells), BENCH_WARMUP (1 s), "
               "BENCH_SOAK_INTERVAL (10 s), BENCH_SERVER (another build of bench_server, for a "
               "before/after comparison), BENCH_BASELINE (as --baseline), BENCH_REDIS_SERVERS (as "
               "--redis-servers), BENCH_REDIS_SERVER (the one redis-server otherwise), "
               "BENCH_NEWER_SERVERS (the scripts/newer-servers.sh that `all` runs)")
    parser.add_argument("--full", action="store_true", help="the whole matrix; writes results.md, "
                        "results.json and chart.svg")
    parser.add_argument("--soak", nargs="?", type=float, const=10.0, metavar="MINUTES",
                        help="one server under load for MINUTES (default 10); writes soak.md")
    parser.add_argument("--soak-store", default="redis", help="redis (default) or memory")
    parser.add_argument("--stores", help="e.g. plain,memory,redis,redis-cache,redis-acks (plain is always "
                        "run); peer-idempotent,peer-axum-idempotent are the other layers of bench/peers, "
                        "floor-memory and floor-redis the least an in-process layer and a layer over Redis do "
                        "(bench/peers/src/floor.rs, floor_redis.rs)")
    parser.add_argument("--scenarios", help="e.g. fresh,replay,inflight")
    parser.add_argument("--conc", help="c32,c1 (c128 only when named)")
    parser.add_argument("--bodies", help="100,16k,1m")
    parser.add_argument("--rounds", type=int, help="overrides BENCH_ROUNDS")
    parser.add_argument("--duration", type=float, help="seconds per cell; overrides BENCH_DURATION")
    parser.add_argument("--out", help="output directory (default: bench/)")
    parser.add_argument("--redis-servers", metavar="SERVERS",
                        help="the Redis servers every Redis cell runs against, one after another in "
                             "each round: comma-separated NAME=LAUNCHER (a redis-server binary or a "
                             "launcher of scripts/newer-servers.sh), a bare LAUNCHER (named by its "
                             "--version, e.g. redis-8.6), or `all` (the system's redis-server and "
                             "every launcher scripts/newer-servers.sh prints); default "
                             "BENCH_REDIS_SERVERS, else BENCH_REDIS_SERVER (redis-server)")
    parser.add_argument("--baseline", metavar="BIN",
                        help="another build of bench_server (e.g. of the commit before a change), "
                             "measured in the same run: each store's cell runs on it too, right "
                             "before the build under test, in every round (rows <store>@base)")
    args = parser.parse_args()

    global BASELINE_BIN
    baseline = args.baseline or os.environ.get("BENCH_BASELINE")
    if baseline:
        BASELINE_BIN = Path(baseline).resolve()
        if not BASELINE_BIN.exists():
            raise BenchError(f"--baseline {baseline}: no such file")
        if args.soak is not None:
            raise BenchError("--baseline applies to the matrix, not to --soak")

    if args.stores and any(s.strip() in PEER_STORES for s in args.stores.split(",")):
        build_peers()
    if not SERVER_BIN.exists():
        raise BenchError(f"{SERVER_BIN} is missing: run `cargo build --release --example bench_server` "
                         "(scripts/bench.sh does)")
    # SIGTERM unwinds like Ctrl-C, so the finally blocks stop every process.
    signal.signal(signal.SIGTERM, on_sigterm)
    if args.soak is not None:
        return run_soak(args)
    return run_matrix(args)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as error:
        print(f"bench: error: {error}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("bench: interrupted", file=sys.stderr)
        sys.exit(130)
    finally:
        PROCS.stop_all()
