#!/usr/bin/env python3
"""Checks the links of the repository's Markdown: README.md, CHANGELOG.md, ARCHITECTURE.md (if
present) and docs/*.md. Every relative link (inline, image or reference definition) must name a
file or folder that exists, and every `#anchor`, in the same file or another Markdown file, a
heading there (by GitHub's rules for heading ids) or an HTML `id`/`name`. A reference link
(`[text][label]`) must have its label defined. Absolute URLs (`https:`, `mailto:`) are not
fetched. Links inside code (fenced blocks, `inline code`) are not links.

Usage: scripts/check-links.py [FILE.md ...]   (default: the files above)
Exits 1, naming each broken link as FILE:LINE, when any is broken.
"""

import re
import sys
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def default_files():
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "ARCHITECTURE.md"]
    files += sorted((ROOT / "docs").glob("*.md"))
    return [f for f in files if f.exists()]


def prose_lines(text, blank_code=True):
    """(line number, line) for each line outside fenced code blocks, inline code blanked unless
    `blank_code` is false."""
    fence = None
    for number, line in enumerate(text.split("\n"), 1):
        stripped = line.lstrip()
        match = re.match(r"(`{3,}|~{3,})", stripped)
        if fence is None and match:
            fence = match.group(1)
            continue
        if fence is not None:
            if stripped.startswith(fence) and stripped.strip() == fence[0] * len(stripped.strip()):
                fence = None
            continue
        yield number, re.sub(r"(`+)(.+?)\1", lambda m: " " * len(m.group(0)), line) if blank_code else line


def slug(heading):
    """The id GitHub gives a heading: its text lower-cased, punctuation dropped, spaces as '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links: their text
    text = re.sub(r"\[([^\]]*)\]\[[^\]]*\]", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.strip().lower()
    kept = []
    for char in text:
        if char in " -_" or char.isalnum():
            kept.append(char)
        elif unicodedata.category(char).startswith(("L", "N", "M")):
            kept.append(char)
    return "".join(kept).replace(" ", "-")


_anchors = {}


def anchors(path):
    """Every anchor a file offers: its headings' ids (repeats as GitHub numbers them) and HTML ids."""
    if path not in _anchors:
        found, seen = set(), {}
        text = path.read_text(encoding="utf-8")
        for _, line in prose_lines(text, blank_code=False):
            heading = re.match(r" {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
            if heading:
                base = slug(heading.group(1).replace("`", ""))
                count = seen.get(base, 0)
                seen[base] = count + 1
                found.add(base if count == 0 else f"{base}-{count}")
            for html in re.finditer(r"<[a-zA-Z][^>]*\s(?:id|name)=\"([^\"]+)\"", line):
                found.add(html.group(1))
        _anchors[path] = found
    return _anchors[path]


INLINE = re.compile(r"(?<!\\)!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
DEFINITION = re.compile(r"^ {0,3}\[([^\]]+)\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
REFERENCE = re.compile(r"(?<!\\)\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\[([^\]]*)\]")


def check_target(source, target):
    """None if `target`, as written in `source`, resolves; else why not."""
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("//"):
        return None  # an absolute URL: not fetched
    path_part, _, anchor = target.partition("#")
    if path_part:
        path = (source.parent / path_part).resolve()
        if not path.exists():
            return f"no file {path_part} (looked for {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path})"
    else:
        path = source
    if anchor:
        if path.is_dir() or path.suffix.lower() != ".md":
            return None  # an anchor into code or a folder: GitHub's line anchors, not checked
        if anchor not in anchors(path):
            near = sorted(anchors(path), key=lambda a: -len(set(a.split("-")) & set(anchor.split("-"))))[:3]
            return f"no heading #{anchor} in {path.relative_to(ROOT)} (nearest: {', '.join(near)})"
    return None


def check(path):
    text = path.read_text(encoding="utf-8")
    lines = list(prose_lines(text))
    problems = []
    labels = {}
    for number, line in lines:
        definition = DEFINITION.match(line)
        if definition:
            labels.setdefault(definition.group(1).strip().lower(), (number, definition.group(2)))
    for label, (number, target) in labels.items():
        why = check_target(path, target)
        if why:
            problems.append((number, f"[{label}]: {target}: {why}"))
    prose = [(number, "" if DEFINITION.match(line) else line) for number, line in lines]
    for number, line in prose:
        for match in INLINE.finditer(line):
            why = check_target(path, match.group(1))
            if why:
                problems.append((number, f"({match.group(1)}): {why}"))
    # Reference links over the whole text, as their text may run across a line break.
    joined = "\n".join(line for _, line in prose)
    for match in REFERENCE.finditer(joined):
        label = re.sub(r"\s+", " ", (match.group(2) or match.group(1)).strip().lower())
        if label not in labels:
            number = prose[joined.count("\n", 0, match.start())][0]
            problems.append((number, f"[{match.group(1)}][{match.group(2)}]: no definition of [{label}]".replace("\n", " ")))
    return problems


def main(argv):
    files = [Path(a).resolve() for a in argv[1:]] or default_files()
    broken = 0
    for path in files:
        for number, problem in sorted(set(check(path))):
            where = f"{path.relative_to(ROOT)}:{number}" if number else f"{path.relative_to(ROOT)}"
            print(f"{where}: broken link {problem}", file=sys.stderr)
            broken += 1
    if broken:
        print(f"check-links: {broken} broken link(s) in {len(files)} file(s)", file=sys.stderr)
        return 1
    print(f"check-links: every relative link and anchor resolves ({len(files)} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
