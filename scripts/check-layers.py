#!/usr/bin/env python3
"""Checks the module boundaries ARCHITECTURE.md promises, from the code's own paths.

Run by .ci/run. It reads every `crate::…` and `super::…` path in src/ (outside `//` comments and
`#[cfg(test)] mod tests` blocks, and outside files that are tests themselves), resolves each to the
file that defines it, and fails when:

1. files import each other in a loop (a strongly connected component of more than one file);
2. a file of the core (everything outside src/http/ and src/bin/) names anything in src/http/;
3. a file other than lib.rs reaches an item through lib.rs's re-exports (`crate::RecordKey`
   instead of `crate::key::RecordKey`), which hides which file it depends on.

`--graph` prints every file's imports as well.
"""
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")


def modules():
    found = {}
    for directory, _, files in os.walk(ROOT):
        for name in files:
            if not name.endswith(".rs"):
                continue
            path = os.path.join(directory, name)
            parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
            if parts[0] == "bin":
                continue
            if parts[-1] in ("mod", "lib"):
                parts = parts[:-1]
            found[tuple(parts)] = path
    return found


def reexports(lib_source):
    """Names lib.rs re-exports, mapped to the module path they come from."""
    names = {}
    pattern = r"pub use (?:self::)?([\w:]+?)(?:::\{([^}]*)\}|::(\w+));"
    for match in re.finditer(pattern, lib_source):
        base = match.group(1).split("::")
        listed = match.group(2) or match.group(3)
        for item in listed.split(","):
            item = item.strip().split(" ")[0]
            if item:
                names[item] = base
    return names


def code_of(path):
    source = open(path, encoding="utf-8").read()
    source = re.split(r"#\[cfg\(test\)\]\s*mod tests", source)[0]
    return "\n".join(line for line in source.split("\n") if not line.strip().startswith("//"))


def main():
    mods = modules()
    lib_names = reexports(open(os.path.join(ROOT, "lib.rs"), encoding="utf-8").read())

    def resolve(path):
        for end in range(len(path), -1, -1):
            if tuple(path[:end]) in mods:
                return tuple(path[:end])
        return ()

    edges, problems = {}, []
    for module, path in mods.items():
        if module == () or path.endswith("_tests.rs"):
            continue
        targets = set()
        for match in re.finditer(r"\b(crate|super)((?:::\w+)+)(::\{([^}]*)\})?", code_of(path)):
            segments = match.group(2).strip(":").split("::")
            prefix = [] if match.group(1) == "crate" else list(module[:-1])
            while segments and segments[0] == "super":
                prefix, segments = prefix[:-1], segments[1:]
            full = prefix + segments
            if match.group(1) == "crate" and full and full[0] in lib_names and tuple(full[:1]) not in mods:
                problems.append(
                    f"{os.path.relpath(path)}: `crate::{full[0]}` goes through lib.rs's re-exports; "
                    f"name the file that defines it (`crate::{'::'.join(lib_names[full[0]])}::{full[0]}`)"
                )
                full = lib_names[full[0]] + full
            paths = [full]
            for item in (match.group(4) or "").split(","):
                item = item.strip()
                if item and item != "self":
                    paths.append(full + item.split(" ")[0].split("::"))
            for target_path in paths:
                target = resolve(target_path)
                if target and target != module and module[: len(target)] != target:
                    targets.add(target)
                elif target and target != module:
                    problems.append(
                        f"{os.path.relpath(path)}: imports `{'::'.join(target_path)}` from its own parent "
                        f"module; move what it needs into a file below both"
                    )
        edges[module] = targets
        if module[0] != "http":
            for target in targets:
                if target and target[0] == "http":
                    problems.append(
                        f"{os.path.relpath(path)}: the core imports the HTTP adapter "
                        f"(`{'::'.join(target)}`)"
                    )

    # Tarjan's strongly connected components.
    index, low, stack, on_stack, loops, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(10000)

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for other in edges.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                loops.append(component)

    for node in list(edges):
        if node not in index:
            visit(node)
    name = lambda module: "::".join(module) or "lib"
    for loop in loops:
        members = sorted(name(module) for module in loop)
        problems.append("files import each other in a loop: " + ", ".join(members))

    if "--graph" in sys.argv:
        for module in sorted(edges):
            print(name(module), "->", ", ".join(sorted(name(t) for t in edges[module])) or "-")
    if problems:
        print("check-layers: the module boundaries are broken:", file=sys.stderr)
        for problem in sorted(set(problems)):
            print("  " + problem, file=sys.stderr)
        return 1
    print(f"check-layers: {len(edges)} files, no import loops, the core never imports the HTTP adapter")
    return 0


if __name__ == "__main__":
    sys.exit(main())
