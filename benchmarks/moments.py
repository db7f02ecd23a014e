"""The ``moments`` op (per-block sum and M2, what var/std reduce) with its numba kernel vs NumPy's kernel.

Same process, same block, best of ``--repeats``; one thread (a volunteer task's setting).
Writes its section of benchmarks/RESULTS.md with ``--write``.

Run: ``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/moments.py --write``
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import best, write_section  # noqa: E402

SECTION = "## Reductions: the moments kernel (issue 3)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--write", action="store_true")
    args = p.parse_args(argv)
    import numba

    from goblin_dask.ops import get, warm_up

    numba.set_num_threads(1)
    warm_up()
    op = get("moments")
    rng = np.random.default_rng(0)
    rows = []
    for shape, axis in [((4096, 4096), None), ((4096, 4096), 1), ((4096, 4096), 0), ((64, 512, 512), (1, 2))]:
        for dt in (np.float64, np.float32):
            x = rng.standard_normal(shape).astype(dt)
            t_numba = best(lambda: op.numba(x, axis=axis), args.repeats)
            t_numpy = best(lambda: op.numpy(x, axis=axis), args.repeats)
            rows.append((shape, axis, np.dtype(dt).name, t_numpy, t_numba))
            print(rows[-1], f"{t_numpy / t_numba:.1f}x", flush=True)
    command = "env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/moments.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    lines = [SECTION, "", f"Command: `{command}`", "",
             f"One block, one thread, best of {args.repeats}; numba {numba.__version__}, numpy {np.__version__}.", "",
             "| block | axis | dtype | NumPy kernel | numba kernel | speed-up |", "|---|---|---|---|---|---|"]
    for shape, axis, dt, t_np, t_nb in rows:
        lines.append(f"| {shape} | {axis} | {dt} | {t_np * 1e3:.1f} ms | {t_nb * 1e3:.1f} ms | **{t_np / t_nb:.1f}x** |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        write_section(SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
