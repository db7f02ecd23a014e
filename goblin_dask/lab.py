"""The lab node: a Dask scheduler with the goblin plugins, plus the trusted lab worker.

``LabNode.local()`` is the embedded default: the whole grid on this machine, each
part a separate OS process started the way its command starts it (``goblin node``,
the lab worker, ``goblin volunteer``), all on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import dask

from goblin_dask.credentials import issue_credential

logger = logging.getLogger("goblin_dask.lab")

NODE_FILE = "node.json"
LAB_WORKER_NAME = "lab-worker"


def default_state_dir() -> Path:
    return Path(os.environ.get("GOBLIN_STATE_DIR") or Path.home() / ".local" / "share" / "goblin-dask" / "node")


def read_node_file(state_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(state_dir) / NODE_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"no lab node is running with state directory {state_dir} ({path} is missing)") from None


# -- the node process ---------------------------------------------------------------


async def serve_node(host: str, port: int, dashboard_port: int | None, state_dir: str | os.PathLike,
                     ready=None) -> None:
    """Run the lab node's scheduler until it is closed (``goblin node``)."""
    from distributed import Scheduler

    import scheduler_plugins
    from goblin_dask.credentials import admin_credential
    from goblin_dask.tls import LabCA

    from goblin_dask import link

    link.install_lab_side()  # before the scheduler listens: volunteers' bytes are read as data only
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    admin_credential(state_dir)  # so `goblin revoke` & co. can reach the node
    node_credential = LabCA(state_dir).issue("lab", "lab-node")
    dashboard = dashboard_port is not None
    scheduler = Scheduler(host=host, port=port, dashboard=dashboard, protocol="tls",
                          security=node_credential.security(),
                          dashboard_address=f"{host}:{dashboard_port}" if dashboard else None,
                          validate=False)
    plugins = scheduler_plugins.install(scheduler, state_dir)
    link.install_scheduler_side(scheduler, plugins["goblin-admission"])
    async with scheduler:
        close_on_signals(scheduler)
        info = {"address": scheduler.address, "dashboard_link": _dashboard_link(scheduler, host), "pid": os.getpid()}
        tmp = state_dir / (NODE_FILE + ".tmp")
        tmp.write_text(json.dumps(info))
        tmp.replace(state_dir / NODE_FILE)
        if ready is not None:
            ready(info)
        try:
            await scheduler.finished()
        finally:
            (state_dir / NODE_FILE).unlink(missing_ok=True)


def _dashboard_link(scheduler, host: str) -> str | None:
    port = scheduler.services.get("dashboard") and scheduler.http_server.port
    scheme = "https" if dask.config.get("distributed.scheduler.dashboard.tls.cert", None) else "http"
    return f"{scheme}://{host}:{port}/status" if port else None


async def serve_lab_worker(address: str, credential: str, *, nthreads: int, memory_limit, host: str | None,
                           local_directory: str | None = None, port: int = 0) -> None:
    """Run the trusted lab worker: it holds the lab's data and runs glue and checks."""
    from goblin_dask.roles import LAB_RESOURCE, LAB_SLOTS
    from goblin_dask.tls import Credential

    from goblin_dask import link

    cred = Credential.load(credential)
    link.install_lab_side()  # before the worker listens: volunteers' bytes are read as data only
    no_spilling()
    # It holds the only accepted copy of every result and runs every check: pausing it when
    # memory is high would stall the grid for good (volunteers cannot take its data).
    dask.config.set({"distributed.worker.memory.pause": False})
    # One BLAS thread per task thread, as dask's nanny sets for its workers: checks run side by
    # side, and their CPU time is the calling thread's (the ledger's check_cpu).
    import numpy  # noqa: F401  (loads its BLAS, so that the limit reaches it)
    import threadpoolctl

    threadpoolctl.threadpool_limits(limits=1)
    worker = _lab_worker_class()(address, nthreads=nthreads, name=LAB_WORKER_NAME, memory_limit=memory_limit, host=host,
                    port=port,
                    resources={LAB_RESOURCE: LAB_SLOTS}, local_directory=local_directory,
                    security=cred.security(),
                    startup_information={"goblin": lambda w: {"credential": cred.token}})

    async def report_refusal(name: str, reason: str, ban: bool) -> None:
        try:  # the scheduler keeps the record and bans; this process only logged it
            await worker.scheduler.goblin_refuse_volunteer(name=name, reason=reason, ban=ban)
        except Exception as e:
            logger.warning("could not report the refusal of volunteer %s to the scheduler: %s", name, e)

    link.set_refusal_handler(report_refusal)
    async with worker:
        close_on_signals(worker)
        await worker.finished()


#: Unverified results whose source the lab worker remembers (their checks read it when they start).
_FETCHED_KEPT = 100_000


def _lab_worker_class():
    """The lab worker: a ``distributed.Worker`` that remembers which volunteer sent each unverified result.

    A check blames the volunteer whose bytes it checked.  Asking the scheduler who computed
    the key instead would race with a recomputation: when a banned volunteer is removed
    while the lab checks one of its results, the key may be recomputed by an honest one
    before the verdict arrives.
    """
    from collections import OrderedDict

    from distributed import Worker
    from distributed.worker_state_machine import (
        GatherDepFailureEvent,
        GatherDepNetworkFailureEvent,
        GatherDepSuccessEvent,
    )

    from goblin_dask.validation.checks import is_unverified_key

    class LabWorker(Worker):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.goblin_fetched_from: OrderedDict = OrderedDict()

        async def gather_dep(self, worker, to_gather, total_nbytes, *, stimulus_id):
            event = await super().gather_dep(worker, to_gather, total_nbytes, stimulus_id=stimulus_id)
            if isinstance(event, GatherDepFailureEvent) and worker.startswith("nat://"):
                # a volunteer that answers a fetch with an error is not believed again (its tasks go
                # elsewhere once it is banned); the fetch counts as a lost connection, not as an error
                # of the lab's task
                from goblin_dask.link import refuse

                refuse(worker[len("nat://"):].rsplit(":", 1)[0],
                       f"answered the lab worker's fetch with an error: {str(event.exception_text)[:200]}")
                return GatherDepNetworkFailureEvent(worker=worker, total_nbytes=total_nbytes,
                                                    stimulus_id=f"goblin-refused-{time.time()}")
            if isinstance(event, GatherDepSuccessEvent):
                for key in event.data:
                    if is_unverified_key(key):
                        self.goblin_fetched_from[key] = worker
                        self.goblin_fetched_from.move_to_end(key)
                while len(self.goblin_fetched_from) > _FETCHED_KEPT:
                    self.goblin_fetched_from.popitem(last=False)
            return event

    return LabWorker


def no_spilling() -> None:
    """Workers of a grid keep research data in memory: nothing spills to disk unasked."""
    dask.config.set({"distributed.worker.memory.target": False, "distributed.worker.memory.spill": False})


def close_on_signals(server, on_close=None) -> None:
    """SIGTERM/SIGINT close ``server`` gracefully (so its ``finally`` clean-ups run)."""
    loop = asyncio.get_running_loop()

    def close():
        if on_close is not None:
            on_close()
        asyncio.ensure_future(server.close())

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, close)


# -- the embedded grid --------------------------------------------------------------


class LabNodeStartError(RuntimeError):
    """A part of a local lab node did not start; the message says which and why."""


class LabNode:
    """A running lab node with its researcher client (``.client``)."""

    def __init__(self, address: str, *, state_dir: Path, dashboard_link: str | None = None,
                 processes: dict[str, subprocess.Popen] | None = None, owns_state_dir: bool = False,
                 client=None):
        from goblin_dask.credentials import LabKeys

        self.address = address
        self.state_dir = Path(state_dir)
        self.dashboard_link = dashboard_link
        self.processes: dict[str, subprocess.Popen] = dict(processes or {})
        self.keys = LabKeys(self.state_dir)
        self._owns_state_dir = owns_state_dir
        self.client = client
        self._closed = False

    # -- construction -------------------------------------------------------
    @classmethod
    def local(cls, volunteers: int = 2, threads_per_volunteer: int = 1, memory_limit=None, **options: Any) -> "LabNode":
        """Start a whole grid on 127.0.0.1: scheduler, lab worker and ``volunteers`` agents.

        options: ``state_dir`` (default: a new temporary directory, removed on close),
        ``lab_threads`` (2), ``lab_memory_limit`` ("auto"), ``dashboard`` (True),
        ``timeout`` (seconds to wait for every part, 120).  The node takes the caller's ``goblin.*``
        dask config (``goblin.smtp`` and ``goblin.admins`` make its dashboard's ``/goblin/signin`` work).
        """
        state_dir = options.pop("state_dir", None)
        owns = state_dir is None
        state_dir = Path(state_dir or tempfile.mkdtemp(prefix="goblin-lab-"))
        lab_threads = int(options.pop("lab_threads", 2))
        lab_memory_limit = options.pop("lab_memory_limit", "auto")
        dashboard = bool(options.pop("dashboard", True))
        timeout = float(options.pop("timeout", 120))
        if options:
            raise TypeError(f"LabNode.local: unknown option(s) {sorted(options)}")
        if volunteers < 0 or threads_per_volunteer < 1:
            raise ValueError("LabNode.local: volunteers must be >= 0 and threads_per_volunteer >= 1")
        node = cls("", state_dir=state_dir, owns_state_dir=owns)
        node._memory_limit = memory_limit or "auto"
        node._threads = threads_per_volunteer
        try:
            node._start_scheduler(dashboard, timeout)
            lab_credential = issue_credential(node.state_dir, "lab", LAB_WORKER_NAME)
            node._start_part(LAB_WORKER_NAME, [
                "-m", "goblin_dask.cli", "lab-worker", node.address, "--credential",
                str(lab_credential.save(node.state_dir / "lab-worker.credential")), "--nthreads", str(lab_threads),
                "--memory-limit", str(lab_memory_limit), "--host", "127.0.0.1",
            ])
            names = [node.add_volunteer(wait=False) for _ in range(volunteers)]
            node._connect(1 + volunteers, timeout, [LAB_WORKER_NAME, *names])
        except BaseException:
            node.close()
            raise
        return node

    def _log_path(self, part: str) -> Path:
        logs = self.state_dir / "logs"
        logs.mkdir(exist_ok=True)
        return logs / f"{part}.log"

    def _start_part(self, part: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self._log_path(part), "ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        proc = subprocess.Popen([sys.executable, *args], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env, cwd=str(self.state_dir))
        log.close()
        self.processes[part] = proc
        return proc

    def _failure(self, part: str, what: str) -> LabNodeStartError:
        tail = self._log_path(part).read_text(errors="replace").strip().splitlines()[-15:]
        return LabNodeStartError(f"lab node part '{part}' {what}; last lines of its log:\n" + "\n".join(tail))

    def _start_scheduler(self, dashboard: bool, timeout: float) -> None:
        args = ["-m", "goblin_dask.cli", "node", "--host", "127.0.0.1", "--port", "0", "--state-dir", str(self.state_dir)]
        args += ["--dashboard-port", "0"] if dashboard else ["--no-dashboard"]
        (self.state_dir / NODE_FILE).unlink(missing_ok=True)
        inherited = dask.config.serialize({"goblin": dask.config.get("goblin", {})})
        proc = self._start_part("scheduler", args, env={"DASK_INTERNAL_INHERIT_CONFIG": inherited})
        deadline = time.monotonic() + timeout
        while not (self.state_dir / NODE_FILE).exists():
            if proc.poll() is not None:
                raise self._failure("scheduler", f"exited with code {proc.returncode} before it was ready")
            if time.monotonic() > deadline:
                raise self._failure("scheduler", f"was not ready after {timeout:.0f} s")
            time.sleep(0.05)
        info = read_node_file(self.state_dir)
        self.address, self.dashboard_link = info["address"], info["dashboard_link"]

    def _connect(self, n_workers: int, timeout: float, parts: list[str]) -> None:
        from distributed import Client

        from goblin_dask.credentials import admin_credential

        self.client = Client(self.address, set_as_default=True, timeout=timeout,
                             security=admin_credential(self.state_dir).security())
        deadline = time.monotonic() + timeout
        while len(self.client.scheduler_info(n_workers=-1)["workers"]) < n_workers:
            for part in parts:
                proc = self.processes[part]
                if proc.poll() is not None:
                    raise self._failure(part, f"exited with code {proc.returncode} before joining")
            if time.monotonic() > deadline:
                raise LabNodeStartError(f"only {len(self.client.scheduler_info()['workers'])} of {n_workers} workers joined within {timeout:.0f} s")
            time.sleep(0.1)

    # -- volunteers ---------------------------------------------------------
    def enroll(self, name: str | None = None) -> str:
        """A new volunteer credential; with ``.address`` it is all a volunteer needs."""
        return issue_credential(self.state_dir, "volunteer", name).encode()

    def add_volunteer(self, credential: str | None = None, *, nthreads: int | None = None, memory_limit=None,
                      wait: bool = True, timeout: float = 120, extra_args: tuple[str, ...] = (),
                      module: str = "goblin_dask.volunteer") -> str:
        """Start one more local volunteer process (as ``goblin volunteer`` would); returns its name.

        ``module`` is the program run with ``python -m`` (tests start deliberately faulty agents this way).
        """
        from goblin_dask.tls import Credential

        credential = credential or self.enroll()
        name = Credential.decode(credential).name
        self._start_part(name, [
            "-m", module, self.address, "--token", credential,
            "--nthreads", str(nthreads or getattr(self, "_threads", 1)),
            "--memory-limit", str(memory_limit or getattr(self, "_memory_limit", "auto")), *extra_args,
        ])
        if wait:
            deadline = time.monotonic() + timeout
            while name not in self.volunteer_names():
                proc = self.processes[name]
                if proc.poll() is not None:
                    raise self._failure(name, f"exited with code {proc.returncode} before joining")
                if time.monotonic() > deadline:
                    raise LabNodeStartError(f"volunteer {name} did not join within {timeout:.0f} s")
                time.sleep(0.1)
        return name

    def volunteer_names(self) -> list[str]:
        return sorted(v["name"] for v in self._workers().values() if v["role"] == "volunteer")

    def volunteer_addresses(self) -> dict[str, str]:
        return {v["name"]: a for a, v in self._workers().items() if v["role"] == "volunteer"}

    def lab_worker_address(self) -> str:
        return next(a for a, v in self._workers().items() if v["role"] == "lab")

    def _workers(self) -> dict[str, dict]:
        return self.client.sync(self.client.scheduler.goblin_workers)

    def kill_volunteer(self, name: str) -> None:
        """SIGKILL a local volunteer process (fault injection)."""
        proc = self.processes[name]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def revoke(self, name: str) -> list[str]:
        """Revoke ``name``'s credential and disconnect it; it is refused from now on."""
        return self.client.sync(self.client.scheduler.goblin_revoke, name=name)["closed"]

    def report(self) -> dict[str, Any]:
        """The verification ledger: tasks, accepted, rejected, by_method, volunteers, overhead."""
        return self.client.sync(self.client.scheduler.goblin_report)

    # -- shutdown -----------------------------------------------------------
    def close(self) -> None:
        """Close the client and stop every process of the grid; leaves none behind."""
        if self._closed:
            return
        self._closed = True
        if self.client is not None:
            try:
                self.client.close(timeout=10)
            except Exception:  # the node may already be gone
                pass
        order = [p for p in self.processes if p not in ("scheduler", LAB_WORKER_NAME)] + [LAB_WORKER_NAME, "scheduler"]
        for part in order:
            if part in self.processes:
                _stop(self.processes[part])
        if self._owns_state_dir:
            shutil.rmtree(self.state_dir, ignore_errors=True)

    def __enter__(self) -> "LabNode":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if not getattr(self, "_closed", True):
            self.close()

    def __repr__(self) -> str:
        return f"<LabNode {self.address} parts={sorted(self.processes)}>"


def _stop(proc: subprocess.Popen, grace: float = 5.0) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(grace)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever the group still holds
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        pass


def connect(address: str, credential: str | os.PathLike | None = None, **kwargs: Any):
    """A ``distributed.Client`` for a researcher to a running lab node.

    ``credential``: the file (or string) that ``goblin researchers approve`` issued.
    """
    from distributed import Client

    from goblin_dask.tls import Credential

    if credential is None:
        raise ValueError("connect: a lab node only accepts researchers with a credential (credential=PATH)")
    return Client(address, security=Credential.load(credential).security(), **kwargs)


def run_async(coro) -> None:
    try:
        asyncio.run(coro)
    except KeyboardInterrupt:
        pass
