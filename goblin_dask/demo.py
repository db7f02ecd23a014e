"""``goblin demo``: the main job on the embedded default grid, checked against numpy."""

from __future__ import annotations

import time
from typing import Any, Callable

import dask
import numpy as np


def run_demo(n: int = 2048, chunk: int | None = None, volunteers: int = 2, dtype: str = "float64",
             echo: Callable[[str], Any] | None = print) -> dict[str, Any]:
    """Start a local grid, compute a verified chunked product of two n x n matrices, check it."""
    import goblin_dask.array as ga
    from goblin_dask.node.local import LabNode

    say = echo or (lambda s: None)
    say(f"starting a local grid: lab node + lab worker + {volunteers} volunteer processes on 127.0.0.1 ...")
    t0 = time.perf_counter()
    # The inputs are the lab's own numbers, sent in the graph on purpose (blocks to the lab worker).
    quiet = dask.config.set({"distributed.admin.large-graph-warning-threshold": "4GB"})
    with quiet, LabNode.local(volunteers=volunteers) as node:
        started = time.perf_counter() - t0
        say(f"grid up in {started:.1f} s at {node.address}; volunteers: {', '.join(node.volunteer_names())}")
        rng = np.random.default_rng(2026)
        a = rng.standard_normal((n, n)).astype(dtype)
        b = rng.standard_normal((n, n)).astype(dtype)
        x = ga.from_array(a, chunks=chunk or "auto")
        y = ga.from_array(b, chunks=chunk or "auto")
        product = x @ y
        say(f"C = A @ B, {n}x{n} {dtype}, blocks {product.chunksize} ({product.npartitions} output blocks)")
        t = time.perf_counter()
        c = product.compute()
        grid_seconds = time.perf_counter() - t
        t = time.perf_counter()
        reference = a.astype(np.float64) @ b.astype(np.float64)
        numpy_seconds = time.perf_counter() - t
        rel_error = float(np.abs(c - reference).max() / np.abs(reference).max())
        tolerance = 1e-12 if dtype == "float64" else 1e-4
        report = node.report()
        result = {
            "n": n,
            "dtype": dtype,
            "blocks": list(product.chunksize),
            "matches_numpy": rel_error <= tolerance,
            "max_relative_error": rel_error,
            "grid_seconds": grid_seconds,
            "numpy_float64_seconds": numpy_seconds,
            "startup_seconds": started,
            "report": report,
            "dashboard_link": node.dashboard_link,
        }
    verdict = "matches" if result["matches_numpy"] else "DOES NOT match"
    say(f"result check: {verdict} numpy's float64 product (max relative error {rel_error:.2e}, tolerance {tolerance:.0e})")
    say(f"timings: grid {grid_seconds:.2f} s, numpy (this process) {numpy_seconds:.2f} s, grid start-up {started:.1f} s")
    say(f"verification: {report['tasks']} volunteer results, {report['accepted']} accepted, {report['rejected']} rejected, "
        f"methods {report['by_method']}, check overhead {report['overhead']:.1%} of compute time")
    placed = report.get("placement") or {}
    kept = ", ".join(f"{why}: {n}" for why, n in (placed.get("kept") or {}).items())
    say(f"where tasks ran: {placed.get('volunteer', 0)} on volunteers, {placed.get('lab', 0)} kept at the lab"
        + (f" ({kept})" if kept else ""))
    for name, v in report["volunteers"].items():
        say(f"  {name}: accepted {v['accepted']}, rejected {v['rejected']}, trust {v['trust']}, banned {v['banned']}")
    say(f"dashboard (while the grid ran): {result['dashboard_link']}")
    return result
