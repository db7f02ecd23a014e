"""Shared by the benchmarks: best-of timing, and benchmarks/RESULTS.md, where each benchmark owns one
``## `` section and rewrites only that one."""

from __future__ import annotations

import re
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def write_section(section: str, text: str) -> None:
    """Replace the section titled ``section`` (a ``## `` heading line) with ``text``, or append it."""
    old = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    pattern = re.compile(rf"^{re.escape(section)}\n.*?(?=^## |\Z)", re.S | re.M)
    new = pattern.sub(lambda _: text.rstrip("\n") + "\n\n", old) if pattern.search(old) else (
        old.rstrip("\n") + "\n\n" + text.rstrip("\n") + "\n")
    RESULTS.write_text(new)


def publish(section: str, text: str, write: bool) -> None:
    """Print a benchmark's section, and with ``write`` put it in RESULTS.md."""
    print(text)
    if write:
        write_section(section, text)


def best(fn, repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` calls of ``fn()``."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)
