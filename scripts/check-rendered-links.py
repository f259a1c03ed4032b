#!/usr/bin/env python3
"""Checks the links of the guides as rustdoc renders them (the pages docs.rs shows), where
scripts/check-links.py checks the Markdown GitHub shows.

The guides are pages of the crate's documentation (`tower_idempotency::guide`, src/guide.rs),
and a link that works on GitHub can break there: a relative path to a file of the repository
(`../examples/x.rs`, `../bench/chart.svg`) names nothing in the built documentation. Every
`href` and `src` of each rendered guide page's content must name a file of the built
documentation, and its `#anchor` an `id` in that file; absolute URLs are not fetched.

Usage: scripts/check-rendered-links.py DOC_DIR   (DOC_DIR: a `cargo doc` output, such as
target/doc, holding tower_idempotency/guide/). Exits 1, naming each broken link, when any is.
"""

import html.parser
import re
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit


class Page(html.parser.HTMLParser):
    """The links of a page's main content, and every id of the page."""

    def __init__(self):
        super().__init__()
        self.links = []
        self.ids = set()
        self.depth = 0  # > 0 inside <section id="main-content">

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.add(attrs["id"])
        if "name" in attrs and tag == "a":
            self.ids.add(attrs["name"])
        if tag == "section" and attrs.get("id") == "main-content":
            self.depth = 1
        elif self.depth and tag == "section":
            self.depth += 1
        if self.depth:
            for attribute in ("href", "src"):
                if attrs.get(attribute):
                    self.links.append((tag, attrs[attribute]))

    def handle_endtag(self, tag):
        if self.depth and tag == "section":
            self.depth -= 1


def parse(path, cache={}):
    if path not in cache:
        page = Page()
        page.feed(path.read_text(errors="replace"))
        cache[path] = page
    return cache[path]


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    doc = Path(sys.argv[1]).resolve()
    guide = doc / "tower_idempotency" / "guide"
    pages = sorted(guide.glob("*/index.html")) + [guide / "index.html"]
    if not pages or not (guide / "index.html").exists():
        sys.exit(f"check-rendered-links: no guide pages under {guide}: build the docs first")
    broken = []
    for page_path in pages:
        for tag, link in parse(page_path).links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith(("mailto:", "javascript:")):
                continue
            target = page_path if not parts.path else (page_path.parent / unquote(parts.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            name = f"{page_path.relative_to(doc)}: <{tag}> {link}"
            if not target.exists():
                broken.append(f"{name}: no such file in the built documentation")
                continue
            # rustdoc's own "Source" links name lines (`#89-94`), which its script highlights.
            lines = re.fullmatch(r"\d+(-\d+)?", parts.fragment) and doc / "src" in target.parents
            if parts.fragment and not lines and target.suffix == ".html" and unquote(parts.fragment) not in parse(target).ids:
                broken.append(f"{name}: no id {parts.fragment!r} in {target.relative_to(doc)}")
    if broken:
        print("check-rendered-links: broken links on the rendered guide pages:\n" + "\n".join(broken), file=sys.stderr)
        sys.exit(1)
    print(f"check-rendered-links: every link of the {len(pages)} rendered guide pages resolves")


if __name__ == "__main__":
    main()
