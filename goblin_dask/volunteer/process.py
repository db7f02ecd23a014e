"""The volunteer's process, hardened and warmed before it joins: one BLAS thread per task thread,
safe unpickling, errors as text, a private numba cache, the catalog's kernels compiled.

Done once per process (it changes process-wide state), before any connection, so that the first
task the lab sends finds nothing left to set up.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import click

logger = logging.getLogger(__name__)


def prepare_process(gpu: bool | None, gpu_memory_fraction: float | None = None) -> str:
    """Harden and warm up this process; returns the kernel backend chosen.

    ``gpu_memory_fraction``: on the GPU backend, the share of the GPU's memory cupy's memory pool may hold
    (``cupy.get_default_memory_pool().set_limit(fraction=...)``); without a usable GPU, a warning.

    BLAS and numba run one thread per task thread, as in a ``dask worker`` under its
    nanny (``OMP/OPENBLAS/MKL_NUM_THREADS=1``): ``--nthreads`` is what the volunteer
    lends, and a multi-threaded BLAS under every task thread would oversubscribe it.
    """
    import numpy  # noqa: F401  (loads its BLAS, so that the limit reaches it)
    import threadpoolctl

    from goblin_dask import safe_pickle

    # numba's cache holds only kernels compiled from this package; private and kept across runs
    # (set before numba is imported: it reads NUMBA_CACHE_DIR then)
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "goblin-dask" / "numba"
    cache.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.environ.setdefault("NUMBA_CACHE_DIR", str(cache))
    import numba

    numba.set_num_threads(1)
    threadpoolctl.threadpool_limits(limits=1)  # BLAS and OpenMP; stays for the process (not a context)
    safe_pickle.install()
    text_errors()
    from goblin_dask import ops

    backend = "cpu"
    if gpu is not False:
        try:
            import cupy

            cupy.cuda.runtime.getDeviceCount()
            backend = "gpu"
        except Exception as e:  # no cupy or no device
            if gpu:
                seen = os.environ.get("CUDA_VISIBLE_DEVICES")
                raise click.UsageError(f"--gpu asked, but no usable GPU{f' (CUDA_VISIBLE_DEVICES={seen})' if seen else ''}"
                                       f": {e}") from e
    if gpu_memory_fraction is not None:
        if backend == "gpu":
            cupy.get_default_memory_pool().set_limit(fraction=gpu_memory_fraction)
            logger.info("GPU memory: at most %.0f%% of the GPU's memory", 100 * gpu_memory_fraction)
        else:
            logger.warning("--gpu-memory-fraction %s ignored: no usable GPU (cupy and a CUDA device)",
                           gpu_memory_fraction)
    ops.set_backend(backend)
    compiled = ops.warm_up()
    logger.info("catalog ready: %d ops, %d numba kernels compiled, backend %s", len(ops.catalog()), compiled, backend)
    return backend


def text_errors() -> None:
    """Errors this volunteer reports travel as text (the lab reads no exception object of a volunteer)."""
    import distributed.core as core
    import distributed.worker as worker
    import distributed.worker_state_machine as wsm

    pickled = core.error_message

    def error_message(e, status="error"):
        msg = pickled(e, status=status)
        return {**msg, "exception": str(msg.get("exception_text") or type(e).__name__), "traceback": None}

    core.error_message = worker.error_message = wsm.error_message = error_message
