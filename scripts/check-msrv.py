#!/usr/bin/env python3
"""Checks that the crate's `rust-version` (its MSRV) is what the lockfile really needs.

Fails if any dependency the library builds with (every feature on, dev-dependencies left out)
is locked at a version whose own `rust-version` is newer than ours. Only one toolchain can be
installed where CI runs, so the MSRV is checked from the metadata, and clippy's
`incompatible_msrv` lint (on in `.ci/run`) checks our own use of the standard library against it.
"""
import json
import subprocess
import sys


def version(text):
    """`1.85` and `1.85.0` are the same requirement."""
    parts = [int(part) for part in text.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


metadata = json.loads(
    subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--all-features", "--locked"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
)
packages = {package["id"]: package for package in metadata["packages"]}
nodes = {node["id"]: node for node in metadata["resolve"]["nodes"]}
root = metadata["resolve"]["root"]
ours = packages[root].get("rust_version")
if not ours:
    sys.exit("Cargo.toml has no rust-version")

# What the library needs: normal and build dependencies, followed from the root. The resolve
# graph lists no dev-dependencies of dependencies; the root's own are skipped here.
needed, stack = set(), [root]
while stack:
    node = stack.pop()
    if node in needed:
        continue
    needed.add(node)
    for dep in nodes[node]["deps"]:
        kinds = {kind["kind"] for kind in dep["dep_kinds"]}
        if node == root and kinds == {"dev"}:
            continue
        stack.append(dep["pkg"])

too_new = sorted(
    (version(packages[p]["rust_version"]), packages[p]["name"], packages[p]["version"])
    for p in needed - {root}
    if packages[p].get("rust_version") and version(packages[p]["rust_version"]) > version(ours)
)
highest = max(
    (version(packages[p]["rust_version"]) for p in needed - {root} if packages[p].get("rust_version")),
    default=(0,),
)
if too_new:
    for needs, name, locked in too_new:
        print(f"{name} {locked} needs Rust {'.'.join(map(str, needs))}", file=sys.stderr)
    sys.exit(
        f"rust-version is {ours}, but the locked dependencies above need more: raise it, or "
        "lock older versions (`cargo update`, which resolver 3 keeps within rust-version)"
    )
print(f"MSRV {ours}: every locked dependency builds on it (the highest needs {'.'.join(map(str, highest))})")
