"""What a Freivalds check costs the lab against the product it checks, at the sizes captured models make.

For each product shape and dtype, one BLAS thread (a lab worker's check runs beside other tasks): the
product's time, the lab's check of an honest result (``goblin_dask.validation.freivalds.check_product``),
their ratio, and the share of the check that cProfile puts in ``freivalds._times`` (the thin float64
products of C, B and A with the Gaussian vectors).

Run: ``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/check_cost.py [--repeats 10] [--write]``
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import best, write_section  # noqa: E402

SECTION = "## Freivalds checks against their products (issues 17 and 18)"
SHAPES = [(1024, 256, 1024), (1024, 1024, 256), (256, 1024, 1024), (2048, 2048, 2048)]


def measure(m: int, k: int, n: int, dtype: str, repeats: int) -> dict:
    from threadpoolctl import threadpool_limits

    from goblin_dask.validation.freivalds import check_product

    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    with threadpool_limits(1):
        c = a @ b
        assert check_product(c, a, b), "an honest product was not accepted"
        product = best(lambda: a @ b, repeats)
        check = best(lambda: check_product(c, a, b), repeats)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(repeats):
            check_product(c, a, b)
        prof.disable()
    stats = pstats.Stats(prof).stats
    total = sum(ct for (_, _, name), (_, _, _, ct, _) in stats.items() if name == "check_product")
    times = sum(ct for (_, _, name), (_, _, _, ct, _) in stats.items() if name == "_times")
    return {"product": product, "check": check, "times_share": times / total if total else float("nan")}


def main(argv: list[str] | None = None) -> int:
    from threadpoolctl import threadpool_info

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--write", action="store_true", help="record the table in benchmarks/RESULTS.md")
    args = p.parse_args(argv)
    blas = ", ".join(f"{i['internal_api']} {i['version']} ({i.get('architecture')})" for i in threadpool_info()
                     if i.get("user_api") == "blas")
    rows = ["| product (m x k @ k x n) | dtype | product ms | check ms | check / product | `_times` share of the check |",
            "| --- | --- | ---: | ---: | ---: | ---: |"]
    for m, k, n in SHAPES:
        for dtype in ("float32", "float64"):
            r = measure(m, k, n, dtype, args.repeats)
            rows.append(f"| {m}x{k} @ {k}x{n} | {dtype} | {r['product'] * 1e3:.1f} | {r['check'] * 1e3:.1f} | "
                        f"{r['check'] / r['product']:.2f} | {100 * r['times_share']:.0f}% |")
            print(rows[-1], flush=True)
    text = "\n".join([
        SECTION, "",
        f"`env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/check_cost.py --repeats {args.repeats}`: "
        f"one BLAS thread ({blas}), best of {args.repeats}, an honest result checked "
        f"(`check_product`, 9 Gaussian vectors: `vectors_for()` at escape probability 1e-9); the `_times` share is "
        "cProfile's cumulative time in the thin float64 products over the checks' total.", "",
        *rows, "",
        "At inner dimension 256 (a d_model-256 layer) a check costs the lab a large part of what the volunteer's "
        "product costs; the share grows as the inner dimension shrinks, since the check's work does not depend on it.",
    ])
    if args.write:
        write_section(SECTION, text)
    else:
        print("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
