#!/usr/bin/env python3
"""Where a request's server CPU goes: the profile behind the benchmark's ratios.

Run it through scripts/profile.sh, which installs wrk, redis-server and linux-perf if missing and
builds the bench server with line tables (into target/profile, so the benchmark's own release
build is untouched). For each cell (store, scenario; 100 B bodies, `wrk -t2 -c32`) it starts its
own redis-server (and PostgreSQL, for the postgres store) and a fresh server exactly as
scripts/bench.py does, then:

1. runs wrk once under `perf stat` (system calls and context switches of the server process) and
   reads the server's CPU time from /proc: calls and CPU microseconds per request;
2. runs wrk again under `perf record -g` and files every sample under one heading, by the first
   match from the leaf of its call chain up (a system call first, then the library it is in);
3. scales each heading's share of samples by the CPU per request of step 1 (taken without the
   profiler), giving microseconds per request.

Prints one table per cell and, with --out FILE, writes them as Markdown. Absolute figures move with
the machine; compare headings between cells of the same run.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROFILE_BIN = ROOT / "target" / "profile" / "release" / "examples" / "bench_server"
os.environ.setdefault("BENCH_SERVER", str(PROFILE_BIN))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (reuses its servers, wrk script and checks)

SYSCALLS = ["writev", "sendto", "recvfrom", "epoll_wait", "futex", "write"]
DURATION = 4

# (heading, test on the joined call chain or the leaf); the first that matches wins.
HEADINGS = [
    ("send: writev, sendto to a socket (kernel)",
     lambda chain, leaf: "writev" in chain or "write_vectored" in chain or "sendto" in chain or "__send" in chain),
    ("receive: recvfrom (kernel)", lambda chain, leaf: "recvfrom" in chain or "__libc_recv" in chain),
    ("wait for events: epoll_wait (kernel)", lambda chain, leaf: "epoll_wait" in chain),
    ("park and wake threads: futex, eventfd (kernel)",
     lambda chain, leaf: "futex" in chain or "__lll_lock" in chain or "__libc_write" in chain),
    ("malloc and free", lambda chain, leaf: re.match(
        r"(malloc|_int_\w+|cfree|free|realloc|unlink_chunk|malloc_consolidate|__libc_(malloc|free))", leaf)),
    ("memcpy / memmove", lambda chain, leaf: "memmove" in leaf or "memcpy" in leaf or "memset" in leaf),
    ("SHA-256 (fingerprint, key digest)", lambda chain, leaf: "sha2::" in leaf),
    ("fred: Redis client (encode, decode, router task)",
     lambda chain, leaf: "fred::" in chain or "redis_protocol::" in chain),
    ("sqlx: PostgreSQL client (encode, decode, pool)", lambda chain, leaf: "sqlx_" in chain),
    ("tower-idempotency", lambda chain, leaf: "tower_idempotency" in chain),
    ("hyper and axum (HTTP)", lambda chain, leaf: "hyper::" in chain or "axum" in chain or "http::" in chain),
    ("tokio runtime (scheduling tasks)", lambda chain, leaf: "tokio::" in chain),
    ("kernel, other (scheduling, interrupts)",
     lambda chain, leaf: leaf.startswith(("finish_task", "_raw_spin", "irqentry", "__schedule"))),
]
OTHER = "other (unresolved frames)"


def classify(perf_data):
    out = subprocess.run(["perf", "script", "-i", str(perf_data), "-F", "ip,sym"],
                         capture_output=True, text=True, check=True).stdout
    counts = {}
    total = 0
    for sample in re.split(r"\n\s*\n", out):
        frames = []
        for line in sample.strip().splitlines():
            parts = line.strip().split(None, 1)
            if parts:
                frames.append(parts[1] if len(parts) > 1 else parts[0])
        if not frames:
            continue
        total += 1
        chain = " | ".join(frames)
        heading = next((h for h, test in HEADINGS if test(chain, frames[0])), OTHER)
        counts[heading] = counts.get(heading, 0) + 1
    return total, counts


def perf_stat(pid, seconds, out):
    events = ",".join([f"syscalls:sys_enter_{name}" for name in SYSCALLS] + ["context-switches"])
    return subprocess.Popen(["perf", "stat", "-x,", "-e", events, "-p", str(pid), "-o", str(out),
                             "--", "sleep", str(seconds)])


def read_stat(path):
    values = {}
    for line in Path(path).read_text().splitlines():
        fields = line.split(",")
        if len(fields) > 2 and fields[0].replace(".", "").isdigit():
            values[fields[2].replace("syscalls:sys_enter_", "")] = float(fields[0])
    return values


def profile_cell(tmp, redis, pg, store, scenario, keep=None):
    body = bench.make_body(bench.BODIES["100"])  # the benchmark's 100 B body
    script = bench.write_wrk_script(tmp, scenario, body)
    if redis is not None and store in bench.REDIS_STORES:
        redis.client.cmd("FLUSHALL")
    on_pg = pg is not None and store in bench.PG_STORES
    if on_pg:
        pg.empty()
    server = bench.Server(tmp, store, redis if store in bench.REDIS_STORES else None,
                          pg if on_pg else None)
    conc = "c32"
    holders = []
    try:
        run_id = int(time.time() * 1000) % 100000
        key_arg = f"k{run_id}"
        if scenario == "replay":
            bench.complete_keys(server.port, body, [f"r-{i}" for i in range(bench.REPLAY_KEYS)])
            if store.endswith("-cache"):
                bench.complete_keys(server.port, body, [f"r-{i}" for i in range(bench.REPLAY_KEYS)],
                                    replays=True)
            key_arg = "unused"
        elif scenario == "inflight":
            # One key held in flight by a request that sleeps in the handler, as bench.py does;
            # every run then asks for that same key.
            key_arg = f"inflight-{run_id}"
            holders = bench.hold_in_flight(server.port, key_arg, body)

        def keys(run):
            """The wrk script's key argument: a prefix of its own per run for fresh keys."""
            return key_arg if scenario in ("replay", "inflight") else key_arg + run

        bench.run_wrk(server.url, conc, 1, script, [keys("w"), server.host])
        time.sleep(0.2)
        # 1. calls and CPU per request, without the profiler
        stat_out = Path(tmp) / f"stat-{store}-{scenario}.txt"
        stat = perf_stat(server.proc.pid, DURATION + 0.3, stat_out)
        before = bench.cpu_ticks(server.proc.pid)
        wrk = bench.parse_wrk(bench.run_wrk(server.url, conc, DURATION, script, [keys("a"), server.host]))
        after = bench.cpu_ticks(server.proc.pid)
        stat.wait()
        problems = bench.check_answers(scenario, wrk)
        requests = max(wrk["requests"], 1)
        cpu_us = (after - before) / os.sysconf("SC_CLK_TCK") * 1e6 / requests
        calls = {name: value / requests for name, value in read_stat(stat_out).items()}
        # 2. where the time goes
        perf_data = Path(tmp) / f"perf-{store}-{scenario}.data"
        record = subprocess.Popen(["perf", "record", "-F", "2999", "-g", "-o", str(perf_data), "-p",
                                   str(server.proc.pid), "--", "sleep", str(DURATION)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        bench.run_wrk(server.url, conc, DURATION, script, [keys("b"), server.host])
        record.wait()
        if keep:
            shutil.copy(perf_data, keep)
    finally:
        for sock in holders:
            sock.close()
        server.stop()
    total, counts = classify(perf_data)
    return {"store": store, "scenario": scenario, "rps": wrk["rps"], "cpu_us": cpu_us,
            "calls": calls, "samples": total, "counts": counts, "problems": problems}


def render(cells):
    lines = []
    for cell in cells:
        calls = ", ".join(f"{name} {value:.2f}" for name, value in cell["calls"].items())
        lines.append(f"### {cell['store']} / {cell['scenario']} (c32, 100 B)")
        lines.append("")
        lines.append(f"- {cell['rps']:.0f} req/s; server CPU {cell['cpu_us']:.1f} µs per request "
                     f"(without the profiler); {cell['samples']} samples")
        lines.append(f"- per request: {calls}")
        if cell["problems"]:
            lines.append(f"- ⚠ unexpected answers: {'; '.join(cell['problems'])}")
        lines.append("")
        lines.append("| where | share of samples | µs per request |")
        lines.append("|---|---|---|")
        total = max(cell["samples"], 1)
        for heading, count in sorted(cell["counts"].items(), key=lambda kv: -kv[1]):
            share = count / total
            lines.append(f"| {heading} | {100 * share:.1f}% | {share * cell['cpu_us']:.1f} |")
        lines.append("")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cells", nargs="*", default=["plain/plain", "memory/fresh", "redis/fresh", "redis/replay"],
                        help="store/scenario pairs (default: plain/plain memory/fresh redis/fresh redis/replay)")
    parser.add_argument("--out", help="also write the tables to this Markdown file")
    parser.add_argument("--keep", metavar="DIR",
                        help="also keep each cell's perf.data in DIR (for perf report -i)")
    args = parser.parse_args()
    cells = [tuple(cell.split("/", 1)) for cell in args.cells]
    with tempfile.TemporaryDirectory(prefix="profile-") as tmp:
        redis = bench.RedisServer(tmp) if any(store in bench.REDIS_STORES for store, _ in cells) else None
        pg = bench.PgServer(tmp) if any(store in bench.PG_STORES for store, _ in cells) else None
        try:
            results = []
            for store, scenario in cells:
                print(f"profiling {store}/{scenario} ...", file=sys.stderr)
                results.append(profile_cell(tmp, redis, pg, store, scenario, args.keep))
        finally:
            if redis is not None:
                redis.stop()
            if pg is not None:
                pg.stop()
            bench.PROCS.stop_all()
    text = render(results)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
