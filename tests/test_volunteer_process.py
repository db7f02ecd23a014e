"""How ``goblin volunteer`` prepares its process before it joins (run in a fresh interpreter, as it starts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = """
import json, sys, threadpoolctl
from goblin_dask.volunteer import prepare_process
numba_before = 'numba' in sys.modules
backend = prepare_process(False)
import numba, numba.core.config
print(json.dumps({"numba_before": numba_before, "backend": backend, "cache": numba.core.config.CACHE_DIR,
                  "numba_threads": numba.get_num_threads(),
                  "pools": {d["user_api"]: d["num_threads"] for d in threadpoolctl.threadpool_info()}}))
"""


def test_a_volunteer_computes_with_one_blas_thread_per_task_thread_and_a_private_kernel_cache(tmp_path):
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
    env.pop("NUMBA_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    assert probe["backend"] == "cpu" and not probe["numba_before"]
    # --nthreads N lends N threads: BLAS (and OpenMP) under each of them must not fan out over every core
    assert probe["pools"].get("blas") == 1 and probe["numba_threads"] == 1, probe
    assert probe["pools"].get("openmp", 1) == 1, probe
    # numba read NUMBA_CACHE_DIR after prepare_process set it: compiled kernels stay in the private cache
    assert probe["cache"] == str(tmp_path / "cache" / "goblin-dask" / "numba"), probe
