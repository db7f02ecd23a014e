"""The volunteer agent: a ``dask worker`` that runs catalog operations and nothing else.

It holds that line by itself, whatever the lab node sends (see README, "What a
volunteer accepts"):

1. every unpickling in the process goes through :mod:`goblin_dask.safe_pickle`
   (catalog ops by name, catalog tasks, numeric arrays, numbers, tuples, slices);
2. handlers that run code, ingest objects or leak the machine's state are blocked
   (:data:`BLOCKED_HANDLERS`), and worker plugins are refused even when the node sends
   them at registration;
3. before running a task, the agent re-checks it with the catalog's allow-list
   (:func:`goblin_dask.ops.task_violation`) and fails it otherwise;
4. there is no nanny and no preload; numba's cache is private to the agent's user, and
   the scratch directory is removed on exit.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import click
import dask

from goblin_dask.errors import EXIT_GAVE_UP, EXIT_REFUSED, FatalConnectError, fatal_connect_error

logger = logging.getLogger("goblin_dask.volunteer")

#: Worker RPC handlers a volunteer refuses, and why (listed in README.md).
BLOCKED_HANDLERS = {
    "run": "runs a pickled function (client.run)",
    "run_coroutine": "runs a pickled coroutine",
    "plugin-add": "installs a pickled worker plugin",
    "plugin-remove": "removes worker plugins",
    "upload_file": "writes a file onto sys.path and imports it",
    "actor_execute": "calls a method of an actor object",
    "actor_attribute": "reads an attribute of an actor object",
    "update_data": "pushes arbitrary objects into the worker's memory",
    "gather": "makes the worker fetch arbitrary keys from arbitrary peers",
    "connection_stream": "opens a stream that accepts compute-task from any peer",
    "dump_state": "leaks the worker's state",
    "get_story": "leaks the worker's task history",
    "keys": "leaks the worker's keys",
    "get_logs": "leaks the machine's logs",
    "call_stack": "leaks the running call stacks",
    "profile": "leaks profiling data",
    "profile_metadata": "leaks profiling data",
    "get_monitor_info": "leaks the machine's monitor data",
    "benchmark_disk": "burns the volunteer's disk",
    "benchmark_memory": "burns the volunteer's memory",
    "benchmark_network": "burns the volunteer's network",
}

#: Worker plugins every lab node's scheduler sends at registration (distributed installs them by default);
#: a volunteer skips them like any plugin, but says so without a warning.
EXPECTED_WORKER_PLUGINS = {"shuffle": "dask's shuffle extension, unused by catalog operations"}

#: First and longest wait between connection attempts (each drawn between half and all of it): a home
#: link back after an outage, or a lab node restarted, has its volunteers computing within seconds.
DEFAULT_BACKOFF = (1.0, 5.0)
#: Refusals that clear by themselves, so the agent retries them: its previous run's registration (a
#: link that dropped without a word) is replaced once the lab has not heard from it for a few seconds.
CLEARABLE_REFUSALS = ("is already connected",)


def refusal_can_clear(message: str) -> bool:
    """Does the lab node's refusal ``message`` clear by waiting (retry) rather than by the lab's admin (exit)?"""
    return any(phrase in message for phrase in CLEARABLE_REFUSALS)


class RefusedByNode(RuntimeError):
    """The lab node refused this volunteer (bad, revoked or banned credential)."""


def _volunteer_worker_class():
    import numpy as np
    from distributed import Worker
    from distributed.core import Status
    from distributed.worker_state_machine import ComputeTaskEvent, ExecuteFailureEvent, GatherDepSuccessEvent
    from distributed.worker_state_machine import UpdateDataEvent

    from goblin_dask import link
    from goblin_dask.ops import task_violation
    from goblin_dask.panel_cache import PanelCache, cache_limit, cacheable_key

    class VolunteerWorker(Worker):
        """A distributed Worker that refuses everything but catalog operations.

        It also speaks to the lab only as the lab accepts (README, "What the lab accepts
        from a volunteer"): it never announces the inputs it fetched (``add-keys``: a
        volunteer is no source of lab data; it frees them itself once its tasks used
        them), and its errors travel as text, never as pickled exceptions.

        Input blocks of the lab's data it received stay in a bounded cache in its memory
        (:mod:`goblin_dask.panel_cache`): a later task that reads one is served from there, not
        fetched again, and the lab node is told which keys it holds (placement prefers it).
        """

        def __init__(self, *args, **kwargs):
            self.goblin_paused = False  # the volunteer paused it (goblin volunteer pause): no new tasks
            super().__init__(*args, **kwargs)
            self.goblin_fetched: set = set()
            link.tune_worker_stream(self)
            self.goblin_done = 0  # tasks it finished
            self.goblin_cache = PanelCache(cache_limit(self.memory_manager.memory_limit))

        @property
        def status(self):
            return Worker.status.fget(self)

        @status.setter
        def status(self, value):
            # distributed's memory monitor unpauses a worker it paused; the volunteer's own pause holds
            if value == Status.running and getattr(self, "goblin_paused", False):
                return
            Worker.status.fset(self, value)

        def goblin_pause(self) -> int:
            """Take no new tasks: the scheduler gives a paused worker none, and the tasks given but not
            started go back to the lab (tasks running now finish).  Returns how many went back."""
            self.goblin_paused = True
            monitor = self.periodic_callbacks.get("memory_monitor")
            if monitor is not None:  # it would unpause (and say so every 100 ms): no new tasks, no need
                monitor.stop()
            if Worker.status.fget(self) == Status.running:
                Worker.status.fset(self, Status.paused)  # tells the scheduler (worker-status-change)
            stimulus = f"goblin-paused-{time.time()}"
            waiting = [ts.key for ts in self.state.tasks.values()
                       if ts.state in ("waiting", "ready", "constrained") and ts.run_spec is not None]
            for key in waiting:  # the scheduler releases them here (free-keys) and places them elsewhere
                super().batched_send({"op": "reschedule", "key": key, "stimulus_id": stimulus})
            return len(waiting)

        def goblin_resume(self) -> None:
            self.goblin_paused = False
            if Worker.status.fget(self) == Status.paused:
                Worker.status.fset(self, Status.running)
            monitor = self.periodic_callbacks.get("memory_monitor")
            if monitor is not None and not monitor.is_running() and self.status == Status.running:
                monitor.start()

        def goblin_computing(self) -> list[str]:
            """The catalog operations it computes now."""
            return sorted(getattr(getattr(ts.run_spec, "func", None), "name", "?") for ts in list(self.state.executing))

        async def listen(self, port_or_addr=None, allow_offload=True, **kwargs):
            # the nat listener opens no socket: it dials the lab node with the worker's own credential
            await super().listen(port_or_addr, allow_offload=allow_offload, goblin_lab=self.scheduler.address,
                                 goblin_dial=self.connection_args, **kwargs)

        def start_http_server(self, *args, **kwargs):
            """No HTTP port on a volunteer (its /metrics, /health and /sitemap.json stay private)."""

        def batched_send(self, msg):
            op = msg.get("op")
            if op == "add-keys":
                self.goblin_fetched.update(msg.get("keys") or ())
                return
            if op == "release-worker-data" and msg.get("key") in self.goblin_fetched:
                self.goblin_fetched.discard(msg["key"])  # the scheduler never knew this volunteer held it
                return
            if op == "task-erred":
                msg = {**msg, "exception": None, "traceback": None}
            super().batched_send(msg)
            if op == "task-finished":
                self.goblin_done += 1
            if op in ("task-finished", "task-erred", "reschedule") and self.goblin_fetched:
                self.loop.add_callback(self.free_used_inputs)

        def handle_stimulus(self, *stims):
            if self.goblin_cache.limit > 0 and any(isinstance(ev, ComputeTaskEvent) for ev in stims):
                stims = self._goblin_from_cache(stims)
            super().handle_stimulus(*stims)

        def _goblin_from_cache(self, stims) -> list:
            """Before each task's arrival, its inputs this volunteer keeps go into memory (no transfer).

            They enter as data the scheduler does not know of (as a scatter would: no message), and
            are freed once used like fetched inputs (they stay in the cache)."""
            out = []
            for ev in stims:
                if isinstance(ev, ComputeTaskEvent):
                    data = {}
                    for dep, nbytes in ev.nbytes.items():
                        ts = self.state.tasks.get(dep)
                        if (ts is None or ts.state == "released") and cacheable_key(dep):
                            value = self.goblin_cache.get(dep, nbytes)
                            if value is not None:
                                data[dep] = value
                    if data:
                        self.goblin_fetched.update(data)
                        out.append(UpdateDataEvent(data=data, stimulus_id=f"goblin-cache-{ev.stimulus_id}"))
                out.append(ev)
            return out

        async def gather_dep(self, worker, to_gather, total_nbytes, *, stimulus_id):
            ev = await super().gather_dep(worker, to_gather, total_nbytes, stimulus_id=stimulus_id)
            if isinstance(ev, GatherDepSuccessEvent):
                cache = self.goblin_cache
                for key, value in ev.data.items():
                    cache.fetched_bytes += int(getattr(value, "nbytes", 0) or 0)
                    if type(value) is np.ndarray and cacheable_key(key):
                        ts = self.state.tasks.get(key)
                        cache.put(key, value, ts.nbytes if ts is not None else None)
                hint = cache.take_hint()
                if hint is not None:  # which keys it holds: placement prefers it for tasks reading them
                    super().batched_send(hint)
            return ev

        async def close(self, *args, **kwargs):
            self.goblin_cache.clear()  # memory only: nothing outlives the worker
            return await super().close(*args, **kwargs)

        def free_used_inputs(self):
            """Free fetched inputs that no task of this volunteer still needs."""
            from distributed.worker_state_machine import FreeKeysEvent

            busy = ("waiting", "ready", "constrained", "executing", "long-running", "resumed", "cancelled")
            done = []
            for key in list(self.goblin_fetched):
                ts = self.state.tasks.get(key)
                if ts is None:
                    self.goblin_fetched.discard(key)
                elif ts.state == "memory" and not any(d.state in busy for d in ts.dependents):
                    done.append(key)
            if done:  # their release-worker-data messages are dropped above
                self.handle_stimulus(FreeKeysEvent(keys=done, stimulus_id=f"goblin-used-inputs-{time.time()}"))

        async def plugin_add(self, plugin=None, name=None, catch_errors=True):
            if name in EXPECTED_WORKER_PLUGINS:  # every lab node sends it: nothing to alarm the volunteer
                logger.info("skipped worker plugin %r (%s): volunteers install no plugins", name,
                            EXPECTED_WORKER_PLUGINS[name])
            else:
                logger.warning("refused worker plugin %r: volunteers install no plugins", name)
            return {"status": "error", "exception": None, "traceback": None,
                    "exception_text": "volunteers refuse worker plugins", "traceback_text": ""}

        async def execute(self, key, *, stimulus_id):
            ts = self.state.tasks.get(key)
            why = task_violation(ts.run_spec, where=f"task {key!r}") if ts is not None else None
            if why is not None:
                logger.warning("refused %s", why)
                return ExecuteFailureEvent.from_exception(
                    PermissionError(f"volunteer refused {why}"),
                    key=key,
                    run_id=ts.run_id,
                    stimulus_id=f"goblin-refused-{time.time()}",
                )
            return await super().execute(key, stimulus_id=stimulus_id)

    return VolunteerWorker


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


# -- GPUs: one worker process per GPU ---------------------------------------------------------


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
                    idle_threshold: float = 25.0, max_attempts: int | None = None) -> list[dict]:
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


def _gpu_limits() -> dict | None:
    """The GPUs this process sees and cupy's memory pool limit in bytes (0: none), for the status page."""
    try:
        import cupy

        return {"devices": os.environ.get("CUDA_VISIBLE_DEVICES", "all"),
                "memory_limit": int(cupy.get_default_memory_pool().get_limit())}
    except Exception:
        return None


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


# -- what the volunteer sees: its status line and its control page on 127.0.0.1 ----------------

#: Files of a running agent in its state directory (both 0600, the directory 0700; removed on exit).
CONTROL_FILE = "control.json"  # {"url", "pid", "name"}
TOKEN_FILE = "control-token"  # the token every request to the control page must carry


def default_state_dir(name: str) -> Path:
    """``$XDG_STATE_HOME/goblin-dask/volunteers/NAME`` (``~/.local/state/...``)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "goblin-dask" / "volunteers" / name


def _flops(x: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.0f} FLOP"


class Agent:
    """One ``goblin volunteer``: its limits, its worker of the moment, pause, and its record at the lab."""

    def __init__(self, name: str, address: str, *, nthreads: int, memory_limit, backend: str = "cpu"):
        self.name, self.address = name, address
        self.nthreads, self.memory_limit, self.backend = nthreads, memory_limit, backend
        self.worker = None  # the VolunteerWorker while joined
        #: why it takes no new tasks: "you" (goblin volunteer pause), "busy" (--only-when-idle)
        self.paused_by: set[str] = set()
        self.done_before = 0  # tasks finished by earlier workers of this agent (before a reconnection)
        #: its own record at the lab (goblin_volunteer_status): credit, accepted, rejected, trust
        self.lab: dict = {}
        self.started = time.time()

    @property
    def paused(self) -> bool:
        return bool(self.paused_by)

    def attach(self, worker) -> None:
        self.worker = worker
        if self.paused:
            worker.goblin_pause()

    def detach(self) -> None:
        if self.worker is not None:
            self.done_before += self.worker.goblin_done
        self.worker = None

    def pause(self, why: str = "you") -> int:
        was = self.paused
        self.paused_by.add(why)
        back = self.worker.goblin_pause() if self.worker is not None and not was else 0
        if not was:
            logger.info("paused (%s): no new tasks (%d not started went back to the lab)", _WHY[why], back)
        return back

    def resume(self, why: str = "you") -> None:
        self.paused_by.discard(why)
        if self.paused:
            logger.info("still paused: %s", ", ".join(_WHY[w] for w in sorted(self.paused_by)))
            return
        if self.worker is not None:
            self.worker.goblin_resume()
        logger.info("resumed")

    def status(self) -> dict:
        w = self.worker
        memory = getattr(getattr(w, "memory_manager", None), "memory_limit", None) if w is not None else None
        state = ("paused" + ("" if self.paused_by == {"you"} else f" ({', '.join(_WHY[r] for r in sorted(self.paused_by))})")
                 if self.paused else ("computing" if w is not None else "connecting"))
        return {
            "name": self.name, "lab": self.address, "state": state,
            "tasks_done": self.done_before + (w.goblin_done if w is not None else 0),
            "computing": w.goblin_computing() if w is not None else [],
            "credit_flops": float(self.lab.get("credit", 0.0)),
            "accepted": int(self.lab.get("accepted", 0)), "rejected": int(self.lab.get("rejected", 0)),
            "trust": int(self.lab.get("trust", 0)),
            "limits": {"threads": self.nthreads, "memory": memory or self.memory_limit, "backend": self.backend,
                       "gpu": _gpu_limits() if self.backend == "gpu" else None},
            "uptime": time.time() - self.started,
            # the panels it keeps for later tasks (goblin_dask.panel_cache): hits, bytes, limit, fetched_bytes
            "cache": w.goblin_cache.stats() if w is not None and hasattr(w, "goblin_cache") else {},
        }

    def line(self) -> str:
        st = self.status()
        now = ", ".join(st["computing"]) or "-"
        return (f"goblin volunteer {self.name}: {st['state']} | {st['tasks_done']} tasks done | verified "
                f"{st['accepted']} ({st['rejected']} rejected) | credit {_flops(st['credit_flops'])} | "
                f"trust {st['trust']} | now: {now}")

    async def refresh(self) -> None:
        """Ask the lab for this volunteer's record (the lab computes credit; the volunteer only shows it)."""
        from goblin_dask.node import rpc

        from distributed.core import Status

        w = self.worker
        if w is None or w.status not in (Status.running, Status.paused):
            return
        try:
            record = await getattr(w.scheduler, rpc.VOLUNTEER_STATUS)()
        except Exception as e:  # the lab is away or busy: keep the last record
            logger.debug("no status from the lab: %s", e)
            return
        if isinstance(record, dict):
            self.lab = record


_WHY = {"you": "by you", "busy": "the machine is busy"}


async def pause_when_busy(agent: Agent, threshold: float, interval: float = 5.0) -> None:
    """``--only-when-idle``: pause while the machine's other processes use ``threshold`` percent of its CPU
    or more (this agent's own use not counted), resume when they use less."""
    import psutil

    me, ncpu = psutil.Process(), psutil.cpu_count() or 1
    psutil.cpu_percent(interval=None)
    me.cpu_percent(interval=None)
    while True:
        await asyncio.sleep(interval)
        others = max(0.0, psutil.cpu_percent(interval=None) - me.cpu_percent(interval=None) / ncpu)
        if others >= threshold and "busy" not in agent.paused_by:
            logger.info("the machine is busy (%.0f%% CPU used by others): pausing", others)
            agent.pause("busy")
        elif others < threshold and "busy" in agent.paused_by:
            logger.info("the machine is idle again (%.0f%% CPU used by others)", others)
            agent.resume("busy")


#: seconds between a volunteer's asks for its record at the lab (one small RPC; the lab serves many)
LAB_REFRESH = 5.0


async def report_status(agent: Agent, interval: float, out=None) -> None:
    """Keep one status line up to date: rewritten in place every ``interval`` seconds on a terminal,
    printed when it changes (at most every ``5 * interval`` seconds) otherwise."""
    out = out or sys.stdout
    tty = out.isatty()
    last, last_at, asked_at = "", 0.0, -LAB_REFRESH
    while True:
        now = time.monotonic()
        if now - asked_at >= LAB_REFRESH:
            asked_at = now
            await agent.refresh()
        line = agent.line()
        if tty:
            out.write("\r" + line[:200] + "\x1b[K")
            out.flush()
        elif line != last and now - last_at >= 5 * interval:
            print(line, file=out, flush=True)
            last, last_at = line, now
        await asyncio.sleep(interval)


_PAGE = """<!doctype html><html><head><meta charset="utf-8"><meta http-equiv="refresh" content="2">
<title>goblin volunteer {name}</title><style>body{{font-family:sans-serif;margin:2em}}td{{padding:2px 12px}}</style>
</head><body><h1>goblin volunteer {name}</h1><table>{rows}</table>
<form method="post" action="/{action}"><input type="hidden" name="token" value="{token}">
<button type="submit">{action}</button></form>
<p>This machine computes only the operations of the lab's catalog (numeric kernels of goblin-dask) on the
numbers the lab sends, in memory; it runs no code of the lab's and writes none of its data to disk.</p>
</body></html>"""


def _control_app(agent: Agent, token: str, port_of):
    """The control page: ``/`` (HTML, ``?token=``), ``/api/status`` (JSON), ``POST /pause`` ``/resume``
    (or ``/api/pause``, ``/api/resume``); every request carries the token (``Authorization: Bearer`` or
    ``token=``) and names 127.0.0.1 or localhost as its host (no DNS rebinding)."""
    import hmac
    import html
    import json

    from tornado import web

    class Handler(web.RequestHandler):
        def prepare(self):
            host = (self.request.host or "").rsplit(":", 1)
            if host[0] not in ("127.0.0.1", "localhost") or (len(host) > 1 and host[1] != str(port_of())):
                raise web.HTTPError(403)
            header = self.request.headers.get("Authorization", "")
            given = header[7:] if header.startswith("Bearer ") else self.get_argument("token", "")
            if not hmac.compare_digest(given.encode(), token.encode()):
                raise web.HTTPError(403)

        def check_xsrf_cookie(self):  # the token is the check (a page elsewhere cannot know it)
            pass

        def set_default_headers(self):
            self.set_header("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'; "
                            "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
            self.set_header("Referrer-Policy", "no-referrer")  # the page's address carries the token
            self.set_header("X-Content-Type-Options", "nosniff")

        def send_status(self):
            self.set_header("Content-Type", "application/json")
            self.set_header("Cache-Control", "no-store")
            self.write(json.dumps(agent.status()))

    class Page(Handler):
        def get(self):
            st = agent.status()
            gpu = st["limits"].get("gpu")
            gpu = f" (GPU {gpu['devices']}, memory pool limit {gpu['memory_limit'] or 'none'} B)" if gpu else ""
            rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(str(v))}</td></tr>" for k, v in (
                ("state", st["state"]), ("lab", st["lab"]), ("tasks done", st["tasks_done"]),
                ("verified", f"{st['accepted']} accepted, {st['rejected']} rejected"),
                ("credit", _flops(st["credit_flops"])), ("trust", st["trust"]),
                ("computing now", ", ".join(st["computing"]) or "-"),
                ("limits", f"{st['limits']['threads']} threads, memory {st['limits']['memory']}, "
                           f"{st['limits']['backend']}{gpu}")))
            self.set_header("Cache-Control", "no-store")
            self.write(_PAGE.format(name=html.escape(agent.name), rows=rows, token=html.escape(token),
                                    action="resume" if "you" in agent.paused_by else "pause"))

    class Status(Handler):
        def get(self):
            self.send_status()

    class Act(Handler):
        def post(self, action):
            agent.pause() if action == "pause" else agent.resume()
            if self.request.path.startswith("/api/"):
                self.send_status()
            else:
                self.redirect(f"/?token={token}")

    return web.Application([(r"/", Page), (r"/api/status", Status), (r"/(?:api/)?(pause|resume)", Act)])


class ControlPage:
    """The control page on 127.0.0.1, and its files in the volunteer's state directory."""

    def __init__(self, agent: Agent, state_dir: Path, port: int = 0):
        self.agent, self.state_dir, self.port = agent, Path(state_dir), port
        self.server = None

    def start(self) -> str:
        import json
        import secrets

        from tornado.httpserver import HTTPServer
        from tornado.netutil import bind_sockets

        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.state_dir, 0o700)
        token = secrets.token_urlsafe(32)
        sockets = bind_sockets(self.port, address="127.0.0.1")
        self.port = sockets[0].getsockname()[1]
        self.server = HTTPServer(_control_app(self.agent, token, lambda: self.port))
        self.server.add_sockets(sockets)
        url = f"http://127.0.0.1:{self.port}"
        _write_private(self.state_dir / TOKEN_FILE, token + "\n")
        _write_private(self.state_dir / CONTROL_FILE, json.dumps({"url": url, "pid": os.getpid(),
                                                                  "name": self.agent.name}) + "\n")
        logger.info("status page: %s/?token=... (the token is in %s)", url, self.state_dir / TOKEN_FILE)
        return url

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        for f in (CONTROL_FILE, TOKEN_FILE):
            (self.state_dir / f).unlink(missing_ok=True)
        try:
            self.state_dir.rmdir()  # when nothing else is kept there
        except OSError:
            pass


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def control(action: str, state_dir: Path) -> dict:
    """``goblin volunteer pause|resume|status``: ask the agent running from ``state_dir``; returns its status."""
    import json
    import urllib.error
    import urllib.request

    try:
        info = json.loads((state_dir / CONTROL_FILE).read_text())
        token = (state_dir / TOKEN_FILE).read_text().strip()
    except (OSError, ValueError) as e:
        raise click.ClickException(f"no running volunteer in {state_dir} ({e})") from None
    path = "/api/status" if action == "status" else f"/api/{action}"
    req = urllib.request.Request(info["url"] + path, method="GET" if action == "status" else "POST", data=None,
                                 headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, OSError) as e:
        raise click.ClickException(f"the volunteer of {state_dir} does not answer at {info['url']}: {e}") from None


def _alive(control_file: Path) -> bool:
    """Is the agent that wrote ``control_file`` still running (a killed one leaves its files behind)?"""
    import json

    try:
        os.kill(int(json.loads(control_file.read_text())["pid"]), 0)
    except PermissionError:
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


def _find_state_dir(state_dir: str | None, name: str | None) -> Path:
    if state_dir:
        return Path(state_dir)
    if name:
        return default_state_dir(name)
    base = default_state_dir("x").parent
    running = sorted(p for p in base.glob(f"*/{CONTROL_FILE}") if _alive(p)) if base.is_dir() else []
    if len(running) == 1:
        return running[0].parent
    if not running:
        raise click.ClickException(f"no running volunteer under {base} (give --state-dir or --name)")
    names = ", ".join(p.parent.name for p in running)
    raise click.ClickException(f"several volunteers run here ({names}): say which with --name")


async def _reachable(address: str, connection_args: dict, timeout: float) -> str | None:
    """None when the node answers, else why not."""
    from distributed.comm import connect

    try:
        comm = await connect(address, timeout=timeout, **connection_args)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    await comm.close()
    return None


async def run_volunteer(address: str, credential, *, nthreads: int = 1, memory_limit="auto",
                        local_directory: str | None = None, backoff=DEFAULT_BACKOFF,
                        max_attempts: int | None = None, state_dir: str | os.PathLike | None = None,
                        status_port: int | None = 0, status_interval: float = 1.0, backend: str = "cpu",
                        idle_threshold: float | None = None) -> None:
    """Join the lab node at ``address`` and compute until it closes; reconnect with backoff.

    ``credential`` is a :class:`goblin_dask.tls.Credential` (or its encoded string).
    ``state_dir``: the volunteer's own directory (default :func:`default_state_dir`), where the control
    page's address and token are while it runs; ``status_port``: the control page's port on 127.0.0.1
    (0: any free one; None: no page, so no pause/resume); ``status_interval``: seconds between status lines;
    ``idle_threshold``: pause while other processes use this percent of the CPU or more (None: never).
    """
    from goblin_dask.node.process import no_spilling

    from goblin_dask import link

    link.install_volunteer_side()
    VolunteerWorker = _volunteer_worker_class()
    no_spilling()  # the lab's numbers never reach the volunteer's disk
    # No sampling profiler on a lent machine: every task is a catalog kernel (nothing to learn
    # from its stacks) and sampling busy threads every 10 ms costs the lender's CPU.
    dask.config.set({"distributed.worker.profile.enabled": False})
    # The lab reads no compressed frames from a volunteer (README, "What the lab accepts").
    dask.config.set({"distributed.comm.compression": False})

    from goblin_dask.tls import Credential

    if not isinstance(credential, Credential):
        credential = Credential.load(credential)
    name = credential.name
    security = credential.security()
    connection_args = security.get_connection_args("worker")
    agent = Agent(name, address, nthreads=nthreads, memory_limit=memory_limit, backend=backend)
    page = ControlPage(agent, Path(state_dir) if state_dir else default_state_dir(name), status_port or 0)
    if status_port is not None:
        page.start()
    status = asyncio.ensure_future(report_status(agent, status_interval))
    idle = asyncio.ensure_future(pause_when_busy(agent, idle_threshold)) if idle_threshold is not None else None
    stopping: list = []
    _stop_on_signals(agent, stopping)
    try:
        await _join_and_compute(agent, address, credential, security, connection_args, VolunteerWorker,
                                nthreads=nthreads, memory_limit=memory_limit, local_directory=local_directory,
                                backoff=backoff, max_attempts=max_attempts, stopping=stopping)
    except asyncio.CancelledError:
        if not stopping:
            raise
    finally:
        status.cancel()
        if idle is not None:
            idle.cancel()
        page.stop()
        if sys.stdout.isatty():  # end the status line
            print(file=sys.stdout, flush=True)


def _stop_on_signals(agent: Agent, stopping: list) -> None:
    """SIGTERM/SIGINT stop the agent gracefully whatever it is doing: its worker closes when joined, else
    the connection attempts end; either way its clean-ups run (scratch directory, control page files)."""
    import signal

    loop = asyncio.get_running_loop()
    main = asyncio.current_task()

    def stop():
        stopping.append(True)
        if agent.worker is not None:
            asyncio.ensure_future(agent.worker.close())
        else:
            main.cancel()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)


async def _join_and_compute(agent, address, credential, security, connection_args, VolunteerWorker, *, nthreads,
                            memory_limit, local_directory, backoff, max_attempts, stopping: list) -> None:
    from goblin_dask.roles import VOLUNTEER_RESOURCE

    name = credential.name
    wait, attempts = backoff[0], 0
    while True:
        why = await _reachable(address, connection_args, timeout=max(wait, 3.0))
        fatal = fatal_connect_error(address, why) if why is not None else None
        if fatal is not None:  # retrying cannot help (wrong scheme, another lab's credential)
            raise fatal
        if why is None:
            attempts = 0
            wait = backoff[0]
            worker = VolunteerWorker(
                address, nthreads=nthreads, name=name, memory_limit=memory_limit, nanny=None,
                protocol="nat", host=name, dashboard=False,
                resources={VOLUNTEER_RESOURCE: float(nthreads)}, local_directory=local_directory,
                blocked_handlers=list(BLOCKED_HANDLERS), preload=[], preload_argv=[],
                startup_information={"goblin": lambda w: {"credential": credential.token}},
                security=security,
            )
            why = None
            try:
                await worker
            except (ValueError, RuntimeError) as e:
                cause = e.__cause__ if isinstance(e, RuntimeError) else e
                await worker.close()
                fatal = fatal_connect_error(address, cause)
                if fatal is not None:
                    raise fatal from None
                if isinstance(cause, ValueError) and "refused" in str(cause):
                    refusal = str(cause).split("'message': ")[-1].rstrip("}").strip("'\"")
                    if not refusal_can_clear(refusal):
                        raise RefusedByNode(refusal) from None
                    why = f"it refused this volunteer for now ({refusal})"  # e.g. its previous run's registration
                else:
                    raise
            if why is None:
                logger.info("joined lab node %s as %s", address, name)
                agent.attach(worker)
                try:
                    await worker.finished()
                finally:
                    agent.detach()
                if stopping:
                    return
                why = "lost the connection to the lab node"
        attempts += 1
        if max_attempts is not None and attempts >= max_attempts:
            raise ConnectionError(f"cannot reach lab node at {address}: {why} (gave up after {attempts} attempts)")
        pause = wait * random.uniform(0.5, 1.0)  # jitter: volunteers cut off together do not return together
        print(f"goblin volunteer: cannot reach lab node at {address}: {why}; retrying in {pause:.1f} s",
              file=sys.stderr, flush=True)
        await asyncio.sleep(pause)
        wait = min(wait * 2, backoff[1])


CONTROL_ACTIONS = ("pause", "resume", "status")


@click.command("volunteer", context_settings={"show_default": True})
@click.argument("address", metavar="ADDRESS|pause|resume|status")
@click.option("--token", "token", multiple=True, envvar="GOBLIN_TOKEN", metavar="FILE",
              help="the credential file from `goblin enroll` (mode 0600; or the credential itself in GOBLIN_TOKEN, "
                   "never on the command line); with --gpus, one per GPU")
@click.option("--name", default=None,
              help="the name the credential was issued for (checked); with pause|resume|status: which volunteer")
@click.option("--nthreads", default=1, type=int, help="threads that compute catalog operations")
@click.option("--memory-limit", default="auto", help="memory this volunteer lends, e.g. 4GB")
@click.option("--gpu/--no-gpu", default=None, help="use cupy kernels on a GPU (default: when one is usable)")
@click.option("--gpus", default=None, metavar="I,J,...",
              help="which GPUs: one worker process per GPU, each seeing only its own (CUDA_VISIBLE_DEVICES) and "
                   "joining with its own --token; needs cupy")
@click.option("--gpu-memory-fraction", default=None, type=float,
              help="share of each GPU's memory the volunteer's kernels may hold (cupy's memory pool), e.g. 0.5")
@click.option("--local-directory", default=None, help="scratch directory (default: a private temporary one)")
@click.option("--state-dir", default=None, envvar="GOBLIN_VOLUNTEER_STATE_DIR",
              help="this volunteer's directory: its control page's address and token while it runs "
                   "[default: ~/.local/state/goblin-dask/volunteers/NAME]")
@click.option("--status-port", default=0, type=int,
              help="port of the status and control page on 127.0.0.1 (0: any free one; -1: no page, no pause)")
@click.option("--only-when-idle", is_flag=True,
              help="pause while the machine's other processes keep its CPU busy (see --idle-threshold)")
@click.option("--idle-threshold", default=25.0, type=float,
              help="with --only-when-idle: percent of the CPU used by other processes that pauses it")
@click.option("--host", default=None, hidden=True,
              help="ignored: a volunteer opens no listening socket (its link to the lab is outbound only)")
@click.option("--max-attempts", default=None, type=int, help="give up after this many failed connection attempts")
def volunteer_command(address, token, name, nthreads, memory_limit, gpu, gpus, gpu_memory_fraction, local_directory,
                      state_dir, status_port, only_when_idle, idle_threshold, host, max_attempts):
    """Lend this machine to a lab node: compute its catalog operations, nothing else.

    \b
    What runs here: only the numeric operations of goblin-dask's catalog (matmul, sums, activations...),
    on numbers the lab sends, in this process's memory, with at most --nthreads threads and --memory-limit
    (on GPUs: only those of --gpus, at most --gpu-memory-fraction of each).
    What does not: no code of the lab's (no pickled functions, plugins or files; anything else is refused),
    no writes of the lab's data to disk (no spilling; the scratch directory is removed on exit), and no
    port the network can reach (the link to the lab is outbound; the status page listens on 127.0.0.1 only).

    \b
    goblin volunteer ADDRESS --token FILE         join the lab node at ADDRESS and compute (FILE: from
                                                  `goblin enroll`, readable by you only)
    goblin volunteer ADDRESS --gpus 0,1 --token F0 --token F1   a worker per GPU, each with its credential
    goblin volunteer pause|resume [--name NAME]   the running volunteer takes no new tasks / takes them again
    goblin volunteer status [--name NAME]         its status: tasks done, verified work, credit, trust
    """
    if address in CONTROL_ACTIONS:
        st = control(address, _find_state_dir(state_dir, name))
        click.echo(f"{st['name']}: {st['state']} | {st['tasks_done']} tasks done | verified {st['accepted']} "
                   f"({st['rejected']} rejected) | credit {_flops(st['credit_flops'])} | trust {st['trust']}")
        return
    if not token:
        raise click.BadParameter("a credential is needed to join a lab node (ask the lab for `goblin enroll`)",
                                 param_hint="--token")
    wrong_scheme = fatal_connect_error(address, "")  # before anything starts: no attempt can succeed
    if wrong_scheme is not None:
        click.echo(f"goblin volunteer: {wrong_scheme}", err=True)
        sys.exit(wrong_scheme.exit_code)
    gpu_list = parse_gpus(gpus)
    check_gpu_memory_fraction(gpu_memory_fraction)
    if gpu_list is not None:
        if gpu is False:
            raise click.BadParameter("--gpus with --no-gpu: leave out one of them", param_hint="--gpus")
        gpu = True
        require_cupy()
        if len(gpu_list) > 1 and name is not None:
            raise click.BadParameter("with several GPUs each worker has its credential's name: leave out --name",
                                     param_hint="--name")
        plan = gpu_worker_plan(gpu_list, list(token), environ=dict(os.environ), address=address,
                               nthreads=nthreads, memory_limit=memory_limit, gpu_memory_fraction=gpu_memory_fraction,
                               state_dir=state_dir, local_directory=local_directory, status_port=status_port,
                               only_when_idle=only_when_idle, idle_threshold=idle_threshold, max_attempts=max_attempts)
        if len(plan) > 1:  # a worker process per GPU, each with its own credential
            names = [_load_credential(t).name for t in token]
            if len(set(names)) != len(names):
                raise click.BadParameter("the same credential twice: each GPU's worker needs its own",
                                         param_hint="--token")
            check_gpu_count(gpu_list)
            sys.exit(run_gpu_workers(plan))
        os.environ["CUDA_VISIBLE_DEVICES"] = plan[0]["env"]["CUDA_VISIBLE_DEVICES"]  # before cupy starts CUDA
        check_gpu_count([0])  # the one it now sees
    if len(token) > 1:
        raise click.BadParameter(f"{len(token)} credentials for one worker (several: one per GPU of --gpus)",
                                 param_hint="--token")
    token = token[0]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s goblin volunteer %(levelname)s %(message)s")
    credential = _load_credential(token)
    if name is not None and name != credential.name:
        raise click.BadParameter(f"this credential was issued for {credential.name!r}, not {name!r}", param_hint="--name")
    scratch = None if local_directory else tempfile.mkdtemp(prefix="goblin-volunteer-")
    local_directory = local_directory or scratch
    backend = prepare_process(gpu, gpu_memory_fraction)
    try:
        asyncio.run(run_volunteer(address, credential, nthreads=nthreads, memory_limit=memory_limit,
                                  local_directory=local_directory, max_attempts=max_attempts, state_dir=state_dir,
                                  status_port=None if status_port < 0 else status_port, backend=backend,
                                  idle_threshold=idle_threshold if only_when_idle else None))
    except RefusedByNode as e:
        click.echo(f"goblin volunteer: the lab node refused this volunteer: {e}", err=True)
        sys.exit(EXIT_REFUSED)
    except FatalConnectError as e:
        click.echo(f"goblin volunteer: {e}", err=True)
        sys.exit(e.exit_code)
    except ConnectionError as e:
        click.echo(f"goblin volunteer: {e}", err=True)
        sys.exit(EXIT_GAVE_UP)
    except KeyboardInterrupt:
        pass
    finally:
        if scratch is not None:  # what the lab sent leaves nothing behind on this disk
            shutil.rmtree(scratch, ignore_errors=True)


def _load_credential(token: str):
    """The credential of ``--token``: a file only its owner can read, or (in ``GOBLIN_TOKEN`` only) the
    credential itself; never the credential on the command line, where every local user reads it."""
    from goblin_dask.credentials import CREDENTIAL_ENV, CredentialError, read_credential_file
    from goblin_dask.tls import CREDENTIAL_PREFIX, Credential

    ctx = click.get_current_context(silent=True)
    from_env = ctx is not None and ctx.get_parameter_source("token") == click.core.ParameterSource.ENVIRONMENT
    try:
        if token.strip().startswith(CREDENTIAL_PREFIX):
            if not from_env:
                raise click.BadParameter(
                    "the credential itself on the command line can be read by every user of this machine "
                    "(/proc/PID/cmdline): save it in a file only you can read (chmod 600 FILE) and pass "
                    f"--token FILE, or put it in the environment variable {CREDENTIAL_ENV}", param_hint="--token")
            return Credential.decode(token)
        return Credential.decode(read_credential_file(token))
    except (ValueError, CredentialError) as e:
        raise click.BadParameter(f"{e} (ask the lab for `goblin enroll`)", param_hint="--token") from None


def main(argv: list[str]) -> None:
    """Do exactly what ``goblin volunteer ARGV...`` does (blocking)."""
    volunteer_command.main(args=list(argv), prog_name="goblin volunteer", standalone_mode=True)


if __name__ == "__main__":
    main(sys.argv[1:])
