#!/usr/bin/env python3
"""Checks that every relative link in the repository's Markdown resolves:
the file or directory exists, and a `#fragment` into a Markdown file names
one of its headings (GitHub's anchors: lower case, punctuation dropped,
spaces to hyphens, `-1`, `-2` for repeats). Links to other sites are not
followed. Prints each broken link and exits 1 if there is any.

Usage: tests/docs/links.py [ROOT]   (the repository by default)
"""

import re
import sys
from functools import cache
from pathlib import Path

SKIP = {".git", "target", "node_modules"}
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.M)


def slug(heading: str) -> str:
    # What GitHub does: drop inline code marks, links' targets and
    # punctuation other than hyphens and underscores.
    text = re.sub(r"\]\([^)]*\)", "]", heading).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out = set()
    for match in HEADING.finditer(text):
        base = slug(match.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def broken_links(root: Path) -> list[str]:
    broken = []
    for md in sorted(root.rglob("*.md")):
        if SKIP & set(md.relative_to(root).parts):
            continue
        text = FENCE.sub("", md.read_text(encoding="utf-8"))
        for match in LINK.finditer(text):
            link = match.group(1)
            if re.match(r"[a-zA-Z][a-zA-Z+.-]*:", link):
                continue  # https:, mailto: ...
            path, _, fragment = link.partition("#")
            target = (md.parent / path).resolve() if path else md
            where = md.relative_to(root)
            if not target.exists():
                broken.append(f"{where}: {link}: no such file")
            elif fragment and target.suffix == ".md" and fragment not in anchors(target):
                broken.append(f"{where}: {link}: no such heading")
    return broken


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parents[2]).resolve()
    broken = broken_links(root)
    for line in broken:
        print(f"docs: broken link in {line}", file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
