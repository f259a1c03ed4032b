#!/usr/bin/env python3
"""Checks that every Rust snippet of README.md and docs/*.md compiles as a user would paste it.

A user copies a snippet from GitHub into a new project whose Cargo.toml is README's install block
(plus what the guide itself tells them to add: its `toml` blocks, such as a crate feature or a
crate the guide is about, like tonic for gRPC). So each snippet must be whole (a program with its
`main`, or whole items) and show every line: rustdoc's hidden lines (`# `), which GitHub shows
and a compiler rejects, are refused. Each guide's snippets are built as one new project of that
kind (this crate by path, the install block's other crates as written), every snippet a target of
its own, all of them sharing one target directory (`target/snippets`), so that a run after the
first rebuilds only what changed. `cargo check` is enough: the doctests run the snippets.

Usage: scripts/check-snippets.py  (exit status 1, naming file and line, if one does not compile)
"""

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "target" / "snippets"
HIDDEN = re.compile(r"^\s*#(\s|$)")
BLOCK = re.compile(r"^```([^\n]*)\n(.*?)^```", re.S | re.M)


def install_block():
    """README's `[dependencies]` block, as lines."""
    readme = (ROOT / "README.md").read_text()
    for info, body in BLOCK.findall(readme):
        if info.strip() == "toml" and "[dependencies]" in body:
            return [line for line in body.splitlines() if line.strip() and not line.startswith("[")]
    sys.exit("check-snippets: README.md has no ```toml block with [dependencies]")


def dependency_name(line):
    return line.split("=", 1)[0].strip()


def guide_additions(text):
    """The dependency lines a guide's own `toml` blocks add (or change)."""
    lines = []
    for info, body in BLOCK.findall(text):
        if info.strip() != "toml":
            continue
        if "[dependencies]" not in body and "[dev-dependencies]" not in body:
            continue
        section = None
        for line in body.splitlines():
            stripped = line.strip()
            if stripped.startswith("["):
                section = stripped
            elif stripped and not stripped.startswith("#") and section in ("[dependencies]", "[dev-dependencies]"):
                lines.append(line.split("#", 1)[0].rstrip())
    return lines


def manifest(name, dependencies, bins, has_lib):
    """A Cargo.toml for one guide's project: this crate by path, with the features asked."""
    lines = ["[package]", f'name = "{name}"', 'version = "0.0.0"', 'edition = "2021"', "publish = false", ""]
    if has_lib:
        lines += ["[lib]", 'path = "src/lib.rs"', ""]
    for bin_name in bins:
        lines += ["[[bin]]", f'name = "{bin_name}"', f'path = "src/bin/{bin_name}.rs"', ""]
    lines.append("[dependencies]")
    for line in dependencies:
        key = dependency_name(line)
        if key == "tower-idempotency":
            spec = line.split("=", 1)[1].strip()
            features = re.search(r"features\s*=\s*(\[[^\]]*\])", spec)
            no_default = "default-features = false" in spec
            parts = [f'path = "{ROOT}"']
            if features:
                parts.append(f"features = {features.group(1)}")
            if no_default:
                parts.append("default-features = false")
            lines.append(f"tower-idempotency = {{ {', '.join(parts)} }}")
        else:
            lines.append(line)
    lines += ["", "[workspace]", ""]
    return "\n".join(lines)


def main():
    base = install_block()
    files = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
    failures = []
    projects = []
    for path in files:
        text = path.read_text()
        snippets = []
        for match in BLOCK.finditer(text):
            info, body = match.group(1).strip(), match.group(2)
            tags = [tag.strip() for tag in info.split(",")]
            if tags[0] != "rust" or "ignore" in tags or "compile_fail" in tags:
                continue
            line = text[: match.start()].count("\n") + 1
            where = f"{path.relative_to(ROOT)}:{line}"
            hidden = [n for n, code in enumerate(body.splitlines(), line + 1) if HIDDEN.match(code)]
            if hidden:
                failures.append(f"{where}: hidden lines (rustdoc's `# `) at {hidden}: a pasted snippet must show every line")
                continue
            snippets.append((where, body))
        if not snippets:
            continue
        # The install block, with what this guide adds in place of the same crates.
        additions = guide_additions(text) if path.name != "README.md" else []
        added = {dependency_name(line) for line in additions}
        dependencies = [line for line in base if dependency_name(line) not in added] + additions
        projects.append((path, dependencies, snippets))

    if WORK.exists():
        for stale in WORK.glob("*/src"):
            shutil.rmtree(stale)
    for path, dependencies, snippets in projects:
        name = "snippets-" + path.stem.lower().replace("_", "-")
        project = WORK / name
        (project / "src" / "bin").mkdir(parents=True, exist_ok=True)
        bins, items = [], []
        for index, (where, body) in enumerate(snippets):
            if re.search(r"^\s*(async\s+)?fn main\s*\(", body, re.M):
                bin_name = f"snippet_{index}"
                (project / "src" / "bin" / f"{bin_name}.rs").write_text(f"// {where}\n{body}")
                bins.append(bin_name)
            else:
                items.append((index, where, body))
        lib = "".join(f"// {where}\n#[allow(dead_code)]\npub mod snippet_{index} {{\n{body}}}\n" for index, where, body in items)
        if items:
            (project / "src" / "lib.rs").write_text(lib)
        (project / "Cargo.toml").write_text(manifest(name, dependencies, bins, bool(items)))
        command = ["cargo", "check", "--quiet", "--all-targets", "--target-dir", str(WORK / "target")]
        result = subprocess.run(command, cwd=project, capture_output=True, text=True)
        status = "ok" if result.returncode == 0 else "FAILED"
        print(f"check-snippets: {path.relative_to(ROOT)}: {len(snippets)} snippet(s) {status}")
        if result.returncode != 0:
            failures.append(f"{path.relative_to(ROOT)} (project {project}):\n{result.stderr[-4000:]}")
    if failures:
        print("check-snippets: these snippets would not compile when pasted:\n" + "\n".join(failures), file=sys.stderr)
        sys.exit(1)
    print(f"check-snippets: every snippet of {len(projects)} file(s) compiles as pasted")


if __name__ == "__main__":
    main()
