"""Check every catalog op's cupy kernel against its NumPy kernel, and time both.

Run on a machine with a GPU and cupy (``pip install cupy-cuda12x``)::

    python benchmarks/gpu_check.py [--n 256] [--repeat 5] [--only matmul,exp,...]

For every op with a cupy kernel and each of float32/float64, it runs the op's example
calls (``goblin_dask.ops._samples``) on NumPy and on the GPU, accepts the GPU result the
way the lab would verify it (a Freivalds check for products, the replica comparison of
``goblin_dask.validation.checks.same_result`` otherwise), and prints a table: status,
NumPy time, cupy time on device-resident data, and cupy time including the transfers a
volunteer pays (``OpSpec.kernel("gpu")``).  Exit status 1 if any kernel failed.
Without cupy or a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Callable

import numpy as np


def _gpu_available() -> str | None:
    """The device name, or None (printing why) when there is no usable GPU."""
    try:
        import cupy
    except ImportError:
        print("gpu_check: cupy is not installed; nothing to check (run this on a machine with a GPU and cupy).")
        return None
    try:
        props = cupy.cuda.runtime.getDeviceProperties(0)
    except Exception as e:  # no driver, no device
        print(f"gpu_check: cupy {cupy.__version__} is installed but no GPU is usable ({type(e).__name__}: {e}).")
        return None
    name = props["name"]
    return f"{name.decode() if isinstance(name, bytes) else name}, cupy {cupy.__version__}"


def _seconds(fn: Callable[[], Any], repeat: int, sync: Callable[[], None] = lambda: None) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def _accepted(spec, args: tuple, params: dict, got: Any, want: Any) -> tuple[bool, str]:
    """Would the lab accept ``got``? (the op's own verification), and the max relative error."""
    from goblin_dask.validation.checks import judge

    got, want = np.asarray(got), np.asarray(want)
    if got.dtype != want.dtype or got.shape != want.shape:
        return False, f"got {got.dtype}{got.shape}, want {want.dtype}{want.shape}"
    finite = np.isfinite(want) if want.dtype.kind in "fc" else np.ones(want.shape, bool)
    scale = float(np.abs(want[finite]).max(initial=0.0)) or 1.0
    err = float(np.abs(got[finite].astype(np.complex128) - want[finite]).max(initial=0.0)) / scale
    return judge(spec, args, params, got), f"{err:.1e}"


def check(names: list[str], n: int, repeat: int) -> int:
    import cupy

    from goblin_dask.ops import catalog
    from goblin_dask.ops._samples import example_calls

    sync = cupy.cuda.Device().synchronize
    failures = 0
    header = f"{'op':24} {'dtype':8} {'status':8} {'rel err':>8} {'numpy ms':>9} {'cupy ms':>9} {'speedup':>8} {'+transfer ms':>12}"
    print(header)
    print("-" * len(header))
    for name in names:
        spec = catalog()[name]
        if spec.cupy is None:
            print(f"{name:24} {'-':8} {'no cupy kernel (runs numba/NumPy on the host)'}")
            continue
        for dtype in ("float32", "float64"):
            for args, params in example_calls(name, n, np.random.default_rng(0), dtype):
                on_device = [cupy.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
                try:
                    with np.errstate(all="ignore"):
                        want = spec.numpy(*args, **params)
                        got = cupy.asnumpy(spec.cupy(*on_device, **params))
                        ok, err = _accepted(spec, args, params, got, want)
                    t_np = _seconds(lambda: spec.numpy(*args, **params), repeat)
                    t_gpu = _seconds(lambda: spec.cupy(*on_device, **params), repeat, sync)
                    t_transfer = _seconds(lambda: spec.kernel("gpu")(*args, **params), repeat, sync)
                except Exception as e:  # report and go on: one table shows every kernel
                    failures += 1
                    print(f"{name:24} {dtype:8} {'ERROR':8} {type(e).__name__}: {str(e).splitlines()[0][:100]}")
                    continue
                failures += not ok
                print(
                    f"{name:24} {dtype:8} {'ok' if ok else 'WRONG':8} {err:>8} {t_np * 1e3:9.3f} {t_gpu * 1e3:9.3f} "
                    f"{t_np / max(t_gpu, 1e-9):7.1f}x {t_transfer * 1e3:12.3f}"
                )
    print(f"\n{failures} failure(s)")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=256,
                        help="blocks are about n x n (default 256: at 1024 numpy's conv2d example alone takes 20 s)")
    parser.add_argument("--repeat", type=int, default=5, help="timing repetitions, best kept (default 5)")
    parser.add_argument("--only", default="", help="comma-separated op names (default: every op)")
    args = parser.parse_args(argv)
    device = _gpu_available()
    if device is None:
        return 0
    from goblin_dask.ops import catalog

    names = [s for s in args.only.split(",") if s] or sorted(catalog())
    unknown = sorted(set(names) - set(catalog()))
    if unknown:
        parser.error(f"unknown ops: {unknown}")
    print(f"gpu_check on {device}, n={args.n}, repeat={args.repeat}\n")
    return check(names, args.n, args.repeat)


if __name__ == "__main__":
    sys.exit(main())
