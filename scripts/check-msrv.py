#!/usr/bin/env python3
"""Checks that the crate's `rust-version` (its MSRV) is what the lockfile really needs.

For the default features and for each feature alone, every dependency the library then builds
with (dev-dependencies left out) must be locked at a version whose own `rust-version` is not
newer than ours, or than the feature's own minimum where Cargo.toml declares one under
`[package.metadata.msrv]` (a feature whose dependencies need a newer compiler; docs/crate-features.md lists them).
Only one toolchain can be installed where CI runs, so the MSRV is checked from the metadata, and
clippy's `incompatible_msrv` lint (on in `.ci/run`) checks our own use of the standard library.
"""
import json
import subprocess
import sys


def version(text):
    """`1.85` and `1.85.0` are the same requirement."""
    parts = [int(part) for part in text.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


def show(v):
    return ".".join(map(str, v))


def metadata(*flags):
    command = ["cargo", "metadata", "--format-version", "1", "--locked", *flags]
    return json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)


def needed_by_library(meta):
    """The packages the library builds with, followed from the root over normal and build edges."""
    nodes = {node["id"]: node for node in meta["resolve"]["nodes"]}
    root = meta["resolve"]["root"]
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
    return needed - {root}


base = metadata("--no-deps")
package = base["packages"][0]
ours = package.get("rust_version")
if not ours:
    sys.exit("Cargo.toml has no rust-version")
declared = {
    feature: version(needs)
    for feature, needs in ((package.get("metadata") or {}).get("msrv") or {}).items()
}
features = sorted(f for f in package["features"] if f != "default")

failed = False
for feature in [None, *features]:
    flags = ["--features", feature] if feature else []
    meta = metadata(*flags)
    packages = {p["id"]: p for p in meta["packages"]}
    # A feature's own minimum covers the features it turns on (policy-yaml turns on policy).
    allowed = max([version(ours), *(v for f, v in declared.items() if f == feature)])
    required = [
        (version(packages[p]["rust_version"]), packages[p]["name"], packages[p]["version"])
        for p in needed_by_library(meta)
        if packages[p].get("rust_version")
    ]
    highest = max((needs for needs, _, _ in required), default=(0, 0, 0))
    label = f"default + {feature}" if feature else "default features"
    too_new = sorted(r for r in required if r[0] > allowed)
    if too_new:
        failed = True
        for needs, name, locked in too_new:
            print(f"{label}: {name} {locked} needs Rust {show(needs)}", file=sys.stderr)
    else:
        print(f"{label}: builds on {show(allowed)} (the highest dependency needs {show(highest)})")
    if feature in declared and highest < declared[feature] and highest <= version(ours):
        print(f"{label}: declares Rust {show(declared[feature])} but needs only {show(max(highest, version(ours)))}: lower it")
        failed = True

if failed:
    sys.exit(
        f"rust-version is {ours}: raise it (or a feature's entry in [package.metadata.msrv]), or "
        "lock older versions (`cargo update`, which resolver 3 keeps within rust-version)"
    )
