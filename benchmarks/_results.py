"""benchmarks/RESULTS.md: each benchmark owns one ``## `` section and rewrites only that one."""

from __future__ import annotations

import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def write_section(section: str, text: str) -> None:
    """Replace the section titled ``section`` (a ``## `` heading line) with ``text``, or append it."""
    old = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    pattern = re.compile(rf"^{re.escape(section)}\n.*?(?=^## |\Z)", re.S | re.M)
    new = pattern.sub(lambda _: text.rstrip("\n") + "\n\n", old) if pattern.search(old) else (
        old.rstrip("\n") + "\n\n" + text.rstrip("\n") + "\n")
    RESULTS.write_text(new)
