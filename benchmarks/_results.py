"""Writes a benchmark's figures into its own section of benchmarks/RESULTS.md."""

from __future__ import annotations

import sys
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def write_section(name: str, title: str, body: str, command: str) -> None:
    """Replace the section between `<!-- name:start -->` and `<!-- name:end -->`, or append it."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\nCommand: `{command}`\n\n{body}\n{end}"
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + f"\n\n## {title}\n\n" + block + "\n"
    RESULTS.write_text(text)
    print(f"wrote {RESULTS}", file=sys.stderr)
