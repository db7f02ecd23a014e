"""A whole local grid on a GPU machine: its volunteers take the cupy backend, and the lab accepts their results.

Run where cupy and a CUDA device are (the volunteers find the GPU themselves)::

    python benchmarks/gpu_grid.py [--n 8192] [--volunteers 2]

``benchmarks/gpu_check.py`` checks each cupy kernel alone; this checks what a GPU volunteer's results meet on
the lab node: Freivalds checks of its products (computed on the lab's CPU, in float64) and the comparison of
replicas and of the lab's own recomputation (numpy) for the other ops.  An honest GPU must never be rejected
for rounding the way a GPU rounds.  It prints each volunteer's backend (from its log), each case's error
against numpy in float64, the ledger, and times (numpy on the host, the grid).  Exit status 1 if a volunteer
is not on the GPU, a result is wrong, or an honest result was rejected.  Without cupy or a GPU it says so
and exits 0.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import _gpu_available  # noqa: E402


def _cases(n: int, rng: np.random.Generator):
    """(name, build(ga) -> ga.Array, numpy float64 reference, rtol)."""
    a32 = rng.standard_normal((n, n)).astype(np.float32)
    b32 = rng.standard_normal((n, n)).astype(np.float32)
    a64, b64 = a32.astype(np.float64), b32.astype(np.float64)
    m = n // 4
    x = rng.standard_normal((m, m)).astype(np.float32)
    y = rng.standard_normal((m, m)).astype(np.float32)
    xs, ys = x.astype(np.float64), y.astype(np.float64)
    e = np.exp(xs - xs.max(axis=1, keepdims=True))
    return [
        (f"matmul float32 {n}", lambda ga: ga.from_array(a32, chunks=n // 2) @ ga.from_array(b32, chunks=n // 2),
         a64 @ b64, 1e-4),
        (f"matmul float64 {n}", lambda ga: ga.from_array(a64, chunks=n // 2) @ ga.from_array(b64, chunks=n // 2),
         a64 @ b64, 1e-10),
        (f"exp*tanh+1 float32 {m}", lambda ga: ga.exp(ga.from_array(x, chunks=m // 2))
         * ga.tanh(ga.from_array(y, chunks=m // 2)) + 1.0, np.exp(xs) * np.tanh(ys) + 1.0, 1e-5),
        (f"softmax float32 {m}", lambda ga: ga.softmax(ga.from_array(x, chunks=(m // 2, m)), axis=1),
         e / e.sum(axis=1, keepdims=True), 1e-5),
        (f"sum of squares float32 {m}", lambda ga: (ga.from_array(x, chunks=m // 2) ** 2).sum(axis=0),
         (xs ** 2).sum(axis=0), 1e-5),
    ]


def run(n: int, volunteers: int) -> int:
    import dask

    import goblin_dask.array as ga
    from goblin_dask.node.local import LabNode

    failures = 0
    rng = np.random.default_rng(0)
    # every op to the volunteers: the elementwise and reduction cases too, not only the large products
    every_op = {"goblin.placement.min-flops": 0, "goblin.placement.min-intensity": 0,
                "goblin.placement.min-product-intensity": 0}
    with dask.config.set(every_op):
        t = time.perf_counter()
        node = LabNode.local(volunteers=volunteers, dashboard=False, timeout=600)
        print(f"grid started in {time.perf_counter() - t:.1f} s")
        try:
            logs = node.state_dir / "logs"
            for name in node.volunteer_names():
                log = (logs / f"{name}.log").read_text(errors="replace") if (logs / f"{name}.log").exists() else ""
                ready = [line for line in log.splitlines() if "catalog ready" in line]
                print(f"volunteer {name}: {ready[-1].split('catalog ready: ')[-1] if ready else 'no catalog line'}")
                failures += not (ready and ready[-1].endswith("backend gpu"))
            with node.client.as_current():
                for name, build, want, rtol in _cases(n, rng):
                    expr = build(ga)
                    t = time.perf_counter()
                    got = expr.compute()
                    first = time.perf_counter() - t
                    t = time.perf_counter()
                    got = expr.compute()
                    second = time.perf_counter() - t
                    err = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
                    ok = err <= rtol
                    failures += not ok
                    print(f"{name:28} {'ok' if ok else 'WRONG':6} rel err {err:.1e} (<= {rtol:g})  grid {first:7.3f} s, "
                          f"again {second:7.3f} s")
            report = node.report()
        finally:
            node.close()
    vols = report["volunteers"]
    print(f"\nledger: accepted {report['accepted']}, rejected {report['rejected']}, by method {report['by_method']}")
    for name, v in sorted(vols.items()):
        print(f"  {name}: accepted {v['accepted']}, rejected {v['rejected']}")
    if report["rejected"] or any(v["rejected"] for v in vols.values()):
        failures += 1
        print("an honest GPU volunteer's result was rejected")
    if not sum(v["accepted"] for v in vols.values()):
        failures += 1
        print("no volunteer result was accepted: nothing ran on the GPUs")
    a = rng.standard_normal((n, n)).astype(np.float32)
    t = time.perf_counter()
    a @ a
    print(f"\nnumpy on the host, one {n} float32 product: {time.perf_counter() - t:.3f} s")
    print(f"\n{failures} failure(s)")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8192, help="the products are n x n in 2 x 2 blocks (default 8192)")
    parser.add_argument("--volunteers", type=int, default=2, help="volunteer processes, all on GPU 0 (default 2)")
    args = parser.parse_args(argv)
    device = _gpu_available()
    if device is None:
        return 0
    print(f"gpu_grid on {device}, n={args.n}, {args.volunteers} volunteers\n")
    return run(args.n, args.volunteers)


if __name__ == "__main__":
    sys.exit(main())
