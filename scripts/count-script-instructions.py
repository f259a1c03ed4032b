#!/usr/bin/env python3
"""Instructions a Redis server spends per completion through scripts/complete.lua, counted by
valgrind's callgrind (python3, standard library only).

    scripts/count-script-instructions.py [SERVER] [--records N] [--per-call K] [--payload B]
                                         [--script FILE] [--runs R]

SERVER is a redis-server binary (default: the system's) or a launcher that
scripts/newer-servers.sh prints (target/servers/<name>/redis-server), which runs its server
through another C library's loader; valgrind then runs that loader. The server starts on a free
loopback port with no persistence. The driver claims N keys (default 4000) with the in-flight
records the store writes (`SET key <record> NX PX <lease> GET`), then completes them with
`EVALSHA` in calls of K records (default 8, as the store merges completions made together),
16 calls to a write, each record with the arguments the store sends: the head, the state, the
payload and the retention, from which the script builds the record. Instructions are counted only from the first
completion call to the last (`callgrind_control -i on|off`), reading and answering included,
and divided by N. Counted instructions do not depend on what else the machine does, unlike the
CPU time `scripts/bench.sh` reads, whose rounds spread by 15 % here (docs/performance.md); they
move by 2 or 3 % from one server start to the next (Redis seeds its hash tables at random), so
the driver starts the server R times (default 3) and prints each count and their median.

It also checks the records the script wrote (every one completed, byte for byte the record the
store built), so a script that answers 1 without writing is not counted as fast. Installs
valgrind with apt-get if it is missing.
"""

import argparse
import os
import random
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The record layout (src/store/redis/record.rs): magic, layout version, the owner's length and
# the owner; then the state, the deadline, the fingerprint and its policy tag (32 and 8 bytes);
# then, completed, the payload.
LAYOUT = b"TIR\x03"
OWNER_LEN = 51  # OwnerToken::generate's


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(server):
    """The command that runs `server`: itself, or the loader its launcher execs."""
    path = Path(shutil.which(server) or server)
    text = path.read_bytes()[:4096]
    if text.startswith(b"#!"):
        for line in text.decode(errors="replace").replace("\\\n", " ").splitlines():
            line = line.strip()
            if line.startswith("exec "):
                args = shlex.split(line[len("exec "):])
                if args and args[-1] == "$@":
                    args = args[:-1]
                return args
        sys.exit(f"{path}: a script whose exec line was not found")
    return [str(path)]


class Redis:
    def __init__(self, port):
        for _ in range(600):
            try:
                self.sock = socket.create_connection(("127.0.0.1", port))
                break
            except OSError:
                time.sleep(0.1)
        else:
            sys.exit("the server did not listen within 60 s")
        self.file = self.sock.makefile("rb")

    @staticmethod
    def encode(*args):
        out = [b"*%d\r\n" % len(args)]
        for arg in args:
            arg = arg if isinstance(arg, bytes) else str(arg).encode()
            out.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
        return b"".join(out)

    def read(self):
        line = self.file.readline()
        kind, rest = line[:1], line[1:-2]
        if kind in (b"+", b":"):
            return rest
        if kind == b"-":
            raise RuntimeError(rest.decode(errors="replace"))
        if kind == b"$":
            n = int(rest)
            return None if n < 0 else self.file.read(n + 2)[:-2]
        if kind == b"*":
            return [self.read() for _ in range(int(rest))]
        raise RuntimeError(f"unexpected answer {line!r}")

    def pipeline(self, commands, per_write=200):
        answers = []
        for i in range(0, len(commands), per_write):
            chunk = commands[i:i + per_write]
            self.sock.sendall(b"".join(chunk))
            answers += [self.read() for _ in chunk]
        return answers

    def cmd(self, *args):
        return self.pipeline([self.encode(*args)])[0]


def count(args):
    """One server start: the instructions per record."""
    with tempfile.TemporaryDirectory(prefix="count-script-") as tmp:
        out = Path(tmp) / "callgrind.out"
        port = free_port()
        command = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                   f"--callgrind-out-file={out}"] + server_command(args.server) + \
            ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", tmp]
        log = open(Path(tmp) / "server.log", "wb")
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            redis = Redis(port)
            sha = redis.cmd("SCRIPT", "LOAD", Path(args.script).read_bytes())
            rng = random.Random(26)
            deadline = ((int(time.time() * 1000) + 600_000) & ~1).to_bytes(8, "big")
            completed_state = b"C" + ((int(time.time() * 1000) + 86_400_000) & ~1).to_bytes(8, "big")
            payload = bytes(rng.randrange(256) for _ in range(args.payload))
            records = []
            for i in range(args.records):
                owner = bytes(rng.choice(b"abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(OWNER_LEN))
                head = LAYOUT + OWNER_LEN.to_bytes(2, "big") + owner
                fingerprint = bytes(rng.randrange(256) for _ in range(32 + 8))
                key = b"idempotency:{%064x}" % i
                in_flight = head + b"F" + deadline + fingerprint
                completed = head + completed_state + fingerprint + payload
                records.append((key, head, in_flight, completed))
            claims = [Redis.encode("SET", key, in_flight, "NX", "PX", 600_000, "GET")
                      for key, _, in_flight, _ in records]
            if any(answer is not None for answer in redis.pipeline(claims)):
                sys.exit("a claim found its key taken")
            calls = []
            for i in range(0, len(records), args.per_call):
                batch = records[i:i + args.per_call]
                call = ["EVALSHA", sha, len(batch)] + [key for key, _, _, _ in batch]
                for _, head, _, _ in batch:
                    call += [head, completed_state, payload, 86_400_000]
                calls.append(Redis.encode(*call))
            subprocess.run(["callgrind_control", "-i", "on", str(server.pid)], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            answers = redis.pipeline(calls, per_write=16)
            subprocess.run(["callgrind_control", "-i", "off", str(server.pid)], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            flags = [flag for answer in answers
                     for flag in (answer if isinstance(answer, list) else [answer])]
            if flags != [b"1"] * len(records):
                sys.exit(f"not every record was completed: {flags[:8]}…")
            stored = redis.pipeline([Redis.encode("GET", key) for key, _, _, _ in records])
            if stored != [completed for _, _, _, completed in records]:
                sys.exit("the script wrote other records than the store builds")
            subprocess.run(["callgrind_control", "-d", str(server.pid)], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        finally:
            server.terminate()
            server.wait(timeout=60)
            log.close()
        total = 0
        for dump in Path(tmp).glob("callgrind.out*"):
            for line in dump.read_text(errors="replace").splitlines():
                if line.startswith("totals:"):
                    total += int(line.split()[1])
        if total == 0:
            sys.exit("callgrind counted nothing; server log:\n" +
                     (Path(tmp) / "server.log").read_text(errors="replace"))
        return total // args.records


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("server", nargs="?", default="redis-server")
    parser.add_argument("--records", type=int, default=4000)
    parser.add_argument("--per-call", type=int, default=8)
    parser.add_argument("--payload", type=int, default=100, help="payload bytes per record")
    parser.add_argument("--script", default=str(ROOT / "scripts" / "complete.lua"))
    parser.add_argument("--runs", type=int, default=3, help="server starts (default 3)")
    args = parser.parse_args()
    if not shutil.which("valgrind"):
        subprocess.run(["apt-get", "update", "-qq"], check=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", "valgrind"], check=True,
                       stdout=subprocess.DEVNULL)
    counts = [count(args) for _ in range(args.runs)]
    print(f"{args.script} on {args.server}: {statistics.median(counts):,.0f} instructions per record, "
          f"the median of {', '.join(f'{n:,}' for n in counts)} ({args.records} records, "
          f"{args.per_call} a call, {args.payload} B payloads)")


if __name__ == "__main__":
    main()
