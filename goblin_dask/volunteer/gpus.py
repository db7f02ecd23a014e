"""GPUs: one volunteer worker process per GPU, each seeing only its own device.

``goblin volunteer --gpus 0,1`` starts a ``goblin volunteer`` per GPU with its own credential, state
directory and status port; this module plans those processes (pure, so testable without a GPU), checks
the devices exist, and relays their status lines.  cupy is imported only when a GPU is asked for.
"""

from __future__ import annotations

import os
import sys

import click


def parse_gpus(value: str | None) -> list[int] | None:
    """``--gpus 0,1`` -> ``[0, 1]`` (device indices as this process sees them); None: not asked."""
    if value is None:
        return None
    parts = [p.strip() for p in str(value).split(",")]
    if not parts or any(not p.isdigit() for p in parts):
        raise click.BadParameter(f"{value!r}: GPU indices separated by commas, e.g. 0 or 0,1", param_hint="--gpus")
    gpus = [int(p) for p in parts]
    if len(set(gpus)) != len(gpus):
        raise click.BadParameter(f"{value!r} names a GPU twice (one worker per GPU)", param_hint="--gpus")
    return gpus


def check_gpu_memory_fraction(value: float | None) -> float | None:
    if value is not None and not (0.0 < value <= 1.0):
        raise click.BadParameter(f"{value}: a fraction of the GPU's memory, above 0 and at most 1",
                                 param_hint="--gpu-memory-fraction")
    return value


def gpu_worker_plan(gpus: list[int], tokens: list[str], *, environ: dict, address: str, nthreads: int,
                    memory_limit: str, gpu_memory_fraction: float | None = None, state_dir: str | None = None,
                    local_directory: str | None = None, status_port: int = 0, only_when_idle: bool = False,
                    idle_threshold: float = 25.0, max_attempts: int | None = None,
                    lab_hosts: tuple[str, ...] = ()) -> list[dict]:
    """One worker process per GPU: ``[{"gpu", "env", "argv"}]``, ``argv`` for ``goblin volunteer``.

    Each worker sees only its GPU (``CUDA_VISIBLE_DEVICES``; an index counts among the devices this process
    sees, so ``CUDA_VISIBLE_DEVICES=2,3`` with ``--gpus 1`` is device 3) and joins with its own credential
    (``tokens[i]``: the lab node admits a name once; passed in ``GOBLIN_TOKEN``, not on the command line),
    its own state directory and scratch directory (``DIR/gpuN`` when one is given) and status port
    (``PORT + i`` when one is given).  Pure: it starts nothing.
    """
    if len(tokens) != len(gpus):
        raise click.BadParameter(
            f"{len(gpus)} GPU(s) and {len(tokens)} credential(s): each GPU's worker joins with a credential of its "
            "own (ask the lab for one `goblin enroll` per GPU, and pass --token once per GPU)", param_hint="--token")
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    devices = [d.strip() for d in visible.split(",")] if visible else None
    plan = []
    for i, (gpu, token) in enumerate(zip(gpus, tokens)):
        if devices is not None and gpu >= len(devices):
            raise click.BadParameter(f"GPU {gpu}: this process sees {len(devices)} (CUDA_VISIBLE_DEVICES={visible})",
                                     param_hint="--gpus")
        env = {**environ, "CUDA_VISIBLE_DEVICES": devices[gpu] if devices is not None else str(gpu),
               "GOBLIN_TOKEN": token}
        env.pop("GOBLIN_VOLUNTEER_STATE_DIR", None)  # each worker's own, below
        argv = [address, "--gpu", "--nthreads", str(nthreads), "--memory-limit", str(memory_limit),
                "--status-port", str(status_port + i if status_port > 0 else status_port)]
        if gpu_memory_fraction is not None:
            argv += ["--gpu-memory-fraction", repr(float(gpu_memory_fraction))]
        if state_dir is not None:
            argv += ["--state-dir", os.path.join(state_dir, f"gpu{gpu}")]
        if local_directory is not None:
            argv += ["--local-directory", os.path.join(local_directory, f"gpu{gpu}")]
        if only_when_idle:
            argv += ["--only-when-idle", "--idle-threshold", repr(float(idle_threshold))]
        if max_attempts is not None:
            argv += ["--max-attempts", str(max_attempts)]
        for host in lab_hosts:
            argv += ["--lab-host", host]
        plan.append({"gpu": gpu, "env": env, "argv": argv})
    return plan


def require_cupy() -> None:
    """``--gpus`` needs cupy: a clear error without it."""
    import importlib.util

    if importlib.util.find_spec("cupy") is None:
        raise click.UsageError("--gpus needs cupy, which is not installed here (e.g. pip install cupy-cuda12x); "
                               "without it this volunteer computes on the CPU (leave out --gpus)")


def check_gpu_count(gpus: list[int]) -> None:
    """The CUDA devices ``gpus`` exist here: a clear error otherwise."""
    import cupy

    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        raise click.UsageError(f"--gpus: no usable CUDA device ({e})") from e
    missing = [g for g in gpus if g >= count]
    if missing:
        raise click.UsageError(f"--gpus: no GPU {', '.join(map(str, missing))} here ({count} CUDA device(s))")


def run_gpu_workers(plan: list[dict]) -> int:
    """Start ``goblin volunteer`` once per plan entry and wait for them; SIGINT/SIGTERM stop them all.
    Their status lines come through this process, a line per change (each names its volunteer): several
    workers rewriting one terminal line would garble it.  Returns the worst exit code."""
    import signal
    import subprocess
    import threading

    procs = [subprocess.Popen([sys.executable, "-m", "goblin_dask.volunteer", *w["argv"]], env=w["env"],
                              stdout=subprocess.PIPE, text=True, bufsize=1) for w in plan]

    def relay(stream) -> None:
        for line in stream:
            sys.stdout.write(line)
            sys.stdout.flush()

    relays = [threading.Thread(target=relay, args=(proc.stdout,), daemon=True) for proc in procs]
    for thread in relays:
        thread.start()

    def stop(signum, frame):
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    before = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        codes = [proc.wait() for proc in procs]
        for thread in relays:
            thread.join()
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    return max(codes, key=abs, default=0)


def gpu_limits() -> dict | None:
    """The GPUs this process sees and cupy's memory pool limit in bytes (0: none), for the status page."""
    try:
        import cupy

        return {"devices": os.environ.get("CUDA_VISIBLE_DEVICES", "all"),
                "memory_limit": int(cupy.get_default_memory_pool().get_limit())}
    except Exception:
        return None
