"""The embedded default: the whole grid on this machine (:class:`LabNode`), and :func:`connect`.

``LabNode.local()`` starts each part as a separate OS process the way its command starts it
(``goblin node``, the lab worker, ``goblin volunteer``), all on 127.0.0.1.
"""

from __future__ import annotations

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
from goblin_dask.node import admin, rpc
from goblin_dask.node.process import stop_process
from goblin_dask.node.scheduler import read_node_file
from goblin_dask.roles import LAB_WORKER_NAME


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
        self._threads = 1  # of a volunteer that add_volunteer starts
        self._memory_limit: str | int | float = "auto"

    # -- construction -------------------------------------------------------
    @classmethod
    def local(cls, volunteers: int = 2, threads_per_volunteer: int = 1, memory_limit: str | int | float | None = None,
              *, state_dir: str | os.PathLike | None = None, lab_threads: int = 2,
              lab_memory_limit: str | int | float = "auto", dashboard: bool = True,
              timeout: float = 120) -> "LabNode":
        """Start a whole grid on 127.0.0.1: scheduler, lab worker and ``volunteers`` agents.

        volunteers: volunteer processes to start (more: :meth:`add_volunteer`).
        threads_per_volunteer: task threads of each volunteer.
        memory_limit: each volunteer's memory limit (bytes or "4GB"); None: "auto".
        state_dir: the node's state directory; None: a new temporary directory, removed on close.
        lab_threads: task threads of the lab worker (its glue tasks and checks).
        lab_memory_limit: the lab worker's memory limit ("auto": the machine's).
        dashboard: serve the dashboard (on a free port; ``.dashboard_link``).
        timeout: seconds to wait for each part to start and join.

        The node takes the caller's ``goblin.*`` dask config (``goblin.smtp`` and ``goblin.admins`` make
        its dashboard's ``/goblin/signin`` work).
        """
        if volunteers < 0 or threads_per_volunteer < 1:
            raise ValueError("LabNode.local: volunteers must be >= 0 and threads_per_volunteer >= 1")
        owns = state_dir is None
        node = cls("", state_dir=Path(state_dir or tempfile.mkdtemp(prefix="goblin-lab-")), owns_state_dir=owns)
        node._memory_limit = memory_limit or "auto"
        node._threads = threads_per_volunteer
        try:
            node._start_scheduler(bool(dashboard), float(timeout))
            lab_credential = issue_credential(node.state_dir, "lab", LAB_WORKER_NAME)
            node._start_part(LAB_WORKER_NAME, [
                "-m", "goblin_dask.cli", "lab-worker", node.address, "--credential",
                str(lab_credential.save(node.state_dir / "lab-worker.credential")), "--nthreads", str(int(lab_threads)),
                "--memory-limit", str(lab_memory_limit), "--host", "127.0.0.1",
            ])
            names = [node.add_volunteer(wait=False) for _ in range(volunteers)]
            node._connect(1 + volunteers, float(timeout), [LAB_WORKER_NAME, *names])
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
        args = ["-m", "goblin_dask.cli", "node", "--host", "127.0.0.1", "--port", "0", "--state-dir", str(self.state_dir),
                "--no-lab-worker"]  # started below, as a part of its own (its log, its process)
        args += ["--dashboard-port", "0"] if dashboard else ["--no-dashboard"]
        inherited = dask.config.serialize({"goblin": dask.config.get("goblin")})
        proc = self._start_part("scheduler", args, env={"DASK_INTERNAL_INHERIT_CONFIG": inherited})
        deadline = time.monotonic() + timeout

        def started() -> bool:  # its own node file (another node's, or a stale one, is not ours to remove)
            try:
                return read_node_file(self.state_dir).get("pid") == proc.pid
            except (FileNotFoundError, ValueError):
                return False

        while not started():
            if proc.poll() is not None:
                raise self._failure("scheduler", f"exited with code {proc.returncode} before it was ready")
            if time.monotonic() > deadline:
                raise self._failure("scheduler", f"was not ready after {timeout:.0f} s")
            time.sleep(0.05)
        info = read_node_file(self.state_dir)
        self.address, self.dashboard_link = info["address"], info["dashboard_link"]

    def _connect(self, n_workers: int, timeout: float, parts: list[str]) -> None:
        self.client = admin.admin_client(self.state_dir, self.address, set_as_default=True, timeout=timeout)
        from goblin_dask.array.placement import watch

        watch(self.client)  # it says when no task of a computation leaves the lab
        self._wait_until_joined(lambda: len(self.client.scheduler_info(n_workers=-1)["workers"]) >= n_workers, parts,
                                timeout, lambda: f"only {len(self.client.scheduler_info()['workers'])} of {n_workers} "
                                             f"workers joined within {timeout:.0f} s")

    def _wait_until_joined(self, joined, parts: list[str], timeout: float, failure) -> None:
        """Poll ``joined()`` until true; a part that exits first, or the timeout, is a LabNodeStartError."""
        deadline = time.monotonic() + timeout
        while not joined():
            for part in parts:
                proc = self.processes[part]
                if proc.poll() is not None:
                    raise self._failure(part, f"exited with code {proc.returncode} before joining")
            if time.monotonic() > deadline:
                raise LabNodeStartError(failure())
            time.sleep(0.1)

    # -- volunteers ---------------------------------------------------------
    def enroll(self, name: str | None = None, person: str | None = None) -> str:
        """A new volunteer credential, held by ``person`` (as ``goblin enroll --person``; default: its name);
        with ``.address`` it is all a volunteer needs."""
        return issue_credential(self.state_dir, "volunteer", name, person).encode()

    def add_volunteer(self, credential: str | None = None, *, nthreads: int | None = None, memory_limit=None,
                      wait: bool = True, timeout: float = 120, extra_args: tuple[str, ...] = (),
                      module: str = "goblin_dask.volunteer", env: dict[str, str] | None = None) -> str:
        """Start one more local volunteer process (as ``goblin volunteer`` would); returns its name.

        ``module`` is the program run with ``python -m`` (tests start deliberately faulty agents this way);
        ``env``: variables set for it alone (another BLAS kernel, as on another CPU).
        """
        from goblin_dask.tls import Credential

        credential = credential or self.enroll()
        name = Credential.decode(credential).name
        path = self.state_dir / "credentials" / f"{name}.credential"  # a file, never argv (/proc/PID/cmdline)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(credential.strip() + "\n")
        self._start_part(name, [
            "-m", module, self.address, "--token", str(path),
            "--nthreads", str(nthreads or self._threads),
            "--memory-limit", str(memory_limit or self._memory_limit),
            "--state-dir", str(self.state_dir / "volunteers" / name),  # its control page's files: gone with the grid
            *extra_args,
        ], env=env)
        if wait:
            self._wait_until_joined(lambda: name in self.volunteer_names(), [name], timeout,
                                    lambda: f"volunteer {name} did not join within {timeout:.0f} s")
        return name

    def volunteer_names(self) -> list[str]:
        return sorted(v["name"] for v in self._workers().values() if v["role"] == "volunteer")

    def volunteer_addresses(self) -> dict[str, str]:
        return {v["name"]: a for a, v in self._workers().items() if v["role"] == "volunteer"}

    def lab_worker_address(self) -> str:
        return next(a for a, v in self._workers().items() if v["role"] == "lab")

    def _workers(self) -> dict[str, dict]:
        return self.client.sync(getattr(self.client.scheduler, rpc.WORKERS))

    def kill_volunteer(self, name: str) -> None:
        """SIGKILL a local volunteer process (fault injection)."""
        proc = self.processes[name]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def revoke(self, name: str) -> list[str]:
        """Revoke ``name``'s credential and disconnect it; it is refused from now on (as ``goblin revoke``)."""
        return admin.revoke(self.state_dir, name, self.client)

    def report(self) -> dict[str, Any]:
        """The verification ledger: tasks, accepted, rejected, by_method, volunteers, overhead."""
        return self.client.sync(getattr(self.client.scheduler, rpc.REPORT))

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
                stop_process(self.processes[part])
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


def connect(address: str, credential: str | os.PathLike | None = None, **kwargs: Any):
    """A ``distributed.Client`` for a researcher to a running lab node.

    ``credential``: the file (or string) that ``goblin researchers issue NAME`` or ``goblin researchers approve``
    issued.  What cannot succeed by retrying (a ``tcp://`` address, a volunteer's credential, another lab's, a
    revoked one) raises :class:`goblin_dask.errors.FatalConnectError` at once, saying what to do.
    """
    from distributed import Client

    from goblin_dask.errors import EXIT_WRONG_ROLE, FatalConnectError, fatal_connect_error, wrong_role_message
    from goblin_dask.tls import CLIENT_ROLES, Credential

    if credential is None:
        raise ValueError("connect: a lab node only accepts researchers with a credential (credential=PATH); "
                         "the lab's admin issues one with `goblin researchers issue NAME`")
    fatal = fatal_connect_error(address, "")  # the scheme alone
    if fatal is not None:
        raise fatal
    cred = Credential.load(credential)
    role = cred.certificate_role()
    if role not in CLIENT_ROLES:
        raise FatalConnectError(wrong_role_message(role, address), EXIT_WRONG_ROLE)
    if _revoked_on_node(address, cred, float(kwargs.get("timeout") or 10)):
        raise fatal_connect_error(address, f"credential of {cred.name!r} was revoked")
    try:
        from goblin_dask.array.placement import watch

        return watch(Client(address, security=cred.security(), **kwargs))  # it says when no task leaves the lab
    except (OSError, TimeoutError) as e:
        fatal = fatal_connect_error(address, _causes(e))
        if fatal is not None:
            raise fatal from None
        raise


def _revoked_on_node(address: str, cred, timeout: float) -> bool:
    """Does the node say ``cred`` was revoked (``goblin_check_credential``)?  Asked before the Client connects:
    the node refuses a revoked researcher's ``register-client``, which a Client does not wait an answer for (it
    would time out, saying nothing).  False when the node cannot be asked: the Client's own errors say why."""
    import asyncio
    import concurrent.futures

    from distributed.comm import connect as comm_connect

    from goblin_dask.node import rpc as handlers

    async def ask() -> bool:
        comm = await comm_connect(address, timeout=timeout, **cred.security().get_connection_args("client"))
        try:
            await comm.write({"op": handlers.CHECK_CREDENTIAL, "reply": True})
            answer = await asyncio.wait_for(comm.read(), timeout)
        finally:
            await comm.close()
        return isinstance(answer, dict) and answer.get("revoked") is True

    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # its own event loop, whatever runs in this thread
        try:
            return pool.submit(asyncio.run, ask()).result()
        except Exception:
            return False


def _causes(e: BaseException) -> str:
    """The messages of ``e`` and its causes (distributed wraps the comm's error in a timeout)."""
    parts = []
    while e is not None and len(parts) < 8:
        parts.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    return " <- ".join(parts)
