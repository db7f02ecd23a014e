"""What this machine gives a kernel, measured beside the grid benchmarks (benchmarks/RESULTS.md).

* one volunteer task of the 8192 product (4096x8192 @ 8192x4096 float64) with 1 BLAS thread, alone;
  two such processes side by side; and with 2 BLAS threads (numpy's setting in matmul.py);
* what fresh memory costs: the first touch of 1 GB, then the second.

Run: ``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/machine.py``
"""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np

M, K, N = 4096, 8192, 4096


def gemm(threads: int) -> float:
    """Seconds of one ``a @ b`` (after a warm-up) with ``threads`` BLAS threads."""
    import threadpoolctl

    threadpoolctl.threadpool_limits(threads)
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((M, K)), rng.standard_normal((K, N))
    a[:64] @ b
    t = time.perf_counter()
    a @ b
    return time.perf_counter() - t


def side_by_side(processes: int) -> list[float]:
    code = f"import sys; sys.path.insert(0, {str(__file__.rsplit('/', 1)[0])!r}); import machine; print(machine.gemm(1))"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    return [float(p.communicate()[0].strip().splitlines()[-1]) for p in procs]


def first_touch() -> tuple[float, float]:
    times = []
    for _ in range(2):
        t = time.perf_counter()
        x = np.ones(2**27)  # 1 GiB
        times.append(time.perf_counter() - t)
        del x
    return times[0], times[1]


def main() -> int:
    import threadpoolctl

    flops = 2.0 * M * K * N
    info = [d for d in threadpoolctl.threadpool_info() if d.get("user_api") == "blas"]
    print("BLAS:", [(d["internal_api"], d.get("version"), d.get("architecture")) for d in info])
    alone = side_by_side(1)[0]
    pair = side_by_side(2)
    two_threads = gemm(2)
    print(f"{M}x{K} @ {K}x{N} float64: 1 thread alone {alone:.2f} s ({flops / alone / 1e9:.0f} GFLOP/s); "
          f"two 1-thread processes side by side {', '.join(f'{t:.2f}' for t in pair)} s "
          f"({2 * flops / max(pair) / 1e9:.0f} GFLOP/s together); 2 threads {two_threads:.2f} s "
          f"({flops / two_threads / 1e9:.0f} GFLOP/s)")
    first, second = first_touch()
    print(f"fresh memory: first touch of 1 GiB {first:.2f} s, second {second:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
