"""A lab node in this process: a real distributed Scheduler with the goblin plugins, over mutual TLS.

The scheduler, the lab worker and the volunteers are real ``distributed`` servers on
127.0.0.1, each presenting its own certificate from the lab's CA (its role and name) and,
for workers, its signed admission token, as the real processes do.  The lab worker is
:class:`goblin_dask.node.lab_worker.LabWorker`, the volunteers the agent's own worker class
(:mod:`goblin_dask.volunteer`).  Left out is what only separate processes have: the NAT
link and its decoding of volunteers' bytes (:mod:`goblin_dask.link` changes the comm layer
of the whole process), the volunteer's safe unpickler, and the processes' startup.  A node
starts in a fraction of a second, so the ledger, admission and placement logic is checked
here in seconds; the real-process grids (``test_grid``, ``test_verification_grid``,
``test_faults``, ...) check the same paths end to end.

Use::

    def test_something(tmp_path):
        async def body(lab: InProcessLab):
            ...
        run_lab(tmp_path, body, volunteers=("alice", "bob"))
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import secrets
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable

import dask
import numpy as np
from dask._task_spec import DataNode, Task, TaskRef
from distributed import Client, Scheduler, Worker
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.worker_state_machine import ExecuteFailureEvent, ExecuteSuccessEvent

import scheduler_plugins
from goblin_dask.array.sources import lab_block
from goblin_dask.credentials import issue_credential
from goblin_dask.ops import CatalogTask, get
from goblin_dask.roles import LAB_RESOURCE, LAB_SLOTS, VOLUNTEER_RESOURCE
from goblin_dask.tls import Credential, LabCA
from goblin_dask.validation.checks import insert_checks, is_unverified_key

#: What every in-process node runs with: the scheduler validates its state after every
#: transition (a plugin that leaves it inconsistent fails the test), and no work stealing
#: (it would move a task between volunteers behind a test's back).
NODE_CONFIG = {
    "distributed.scheduler.work-stealing": False,
    "distributed.scheduler.validate": True,
}


class Recorder(SchedulerPlugin):
    """Which worker finished each key (an observer: it changes nothing)."""

    name = "test-recorder"

    def __init__(self):
        self.finished: list[tuple[Any, str]] = []

    def transition(self, key, start, finish, *args, worker=None, **kwargs):
        if start == "processing" and finish == "memory" and worker:
            self.finished.append((key, worker))

    def workers_of(self, key) -> list[str]:
        return [w for k, w in self.finished if k == key]

    def keys_on(self, address: str) -> list:
        return [k for k, w in self.finished if w == address]


# -- workers ----------------------------------------------------------------------------


@functools.cache
def volunteer_worker() -> type[Worker]:
    """The volunteer agent's own worker class, listening on plain TLS (no NAT link).

    On the wire it behaves as the agent does: it never announces the inputs it fetched, its
    errors travel as text, it refuses non-catalog tasks and worker plugins.
    """
    from goblin_dask.volunteer import volunteer_worker_class

    class InProcessVolunteer(volunteer_worker_class()):
        async def listen(self, port_or_addr=None, allow_offload=True, **kwargs):
            return await Worker.listen(self, port_or_addr, allow_offload=allow_offload, **kwargs)

    return InProcessVolunteer


@functools.cache
def cheating_worker() -> type[Worker]:
    """A volunteer that returns zeros for its ``unverified-`` tasks once ``honest_first`` were honest.

    Its kernel runs; the wrong numbers replace the result before it reports it, as a cheater's
    agent does (``tests.cheaters``).
    """

    class CheatingVolunteer(volunteer_worker()):
        honest_first = 0

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.done = 0

        async def execute(self, key, *, stimulus_id):
            event = await super().execute(key, stimulus_id=stimulus_id)
            result = event.value if isinstance(event, ExecuteSuccessEvent) else None
            if is_unverified_key(key) and isinstance(result, np.ndarray):
                self.done += 1
                if self.done > self.honest_first:
                    event.value = np.zeros_like(event.value)
            return event

    return CheatingVolunteer


@functools.cache
def stalling_worker() -> type[Worker]:
    """A volunteer that holds its ``unverified-`` tasks without finishing them until ``release`` is set."""

    class StallingVolunteer(volunteer_worker()):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.release = asyncio.Event()
            self.held: list = []

        async def execute(self, key, *, stimulus_id):
            if is_unverified_key(key):
                self.held.append(key)
                await self.release.wait()
            return await super().execute(key, stimulus_id=stimulus_id)

    return StallingVolunteer


@functools.cache
def failing_worker() -> type[Worker]:
    """A volunteer whose kernel fails (``MemoryError``) on every ``unverified-`` task."""

    class FailingVolunteer(volunteer_worker()):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.failed: list = []

        async def execute(self, key, *, stimulus_id):
            ts = self.state.tasks.get(key)
            if is_unverified_key(key) and ts is not None:
                self.failed.append(key)
                return ExecuteFailureEvent.from_exception(MemoryError("out of memory in the kernel"), key=key,
                                                          run_id=ts.run_id, stimulus_id=f"failing-{time.time()}")
            return await super().execute(key, stimulus_id=stimulus_id)

    return FailingVolunteer


# -- the node ---------------------------------------------------------------------------


class InProcessLab:
    """A started scheduler with the goblin plugins (``.plugins`` by name), and its workers by name."""

    def __init__(self, state_dir: Path, scheduler: Scheduler, plugins: dict):
        self.state_dir = state_dir
        self.scheduler = scheduler
        self.plugins = plugins
        self.workers: dict[str, Worker] = {}
        self.credentials: dict[str, Credential] = {}
        self.recorder = Recorder()
        scheduler.add_plugin(self.recorder, name=Recorder.name)

    @property
    def admission(self):
        return self.plugins["goblin-admission"]

    @property
    def ledger(self):
        return self.plugins["goblin-verification"]

    @property
    def catalog_only(self):
        return self.plugins["goblin-catalog-only"]

    @property
    def exposure(self):
        return self.plugins["goblin-exposure"]

    @property
    def faults(self):
        return self.plugins["goblin-faults"]

    # -- credentials and workers -----------------------------------------------------
    def credential(self, role: str, name: str) -> Credential:
        return issue_credential(self.state_dir, role, name)

    async def start_worker(self, credential: Credential, *, cls: type[Worker] = Worker, nthreads: int = 1,
                           resources: dict | None = None, **kwargs: Any) -> Worker:
        """A worker presenting ``credential``: its certificate, and its token when it registers.

        A refused worker raises ``ValueError`` (the node's answer to ``register-worker``).
        """
        token = credential.token
        self.credentials.setdefault(credential.name, credential)
        worker = cls(self.scheduler.address, nthreads=nthreads, name=credential.name, host="127.0.0.1",
                     security=credential.security(), resources=resources, dashboard=False,
                     dashboard_address="127.0.0.1:0",
                     startup_information={"goblin": lambda w: {"credential": token}}, **kwargs)
        try:
            await worker
        except BaseException as e:
            await worker.close()
            if isinstance(e, RuntimeError) and isinstance(e.__cause__, ValueError):
                raise e.__cause__ from None  # the node's refusal, as the volunteer agent reads it
            raise
        self.workers[credential.name] = worker
        return worker

    async def add_lab_worker(self, name: str = "lab-worker", nthreads: int = 2) -> Worker:
        from goblin_dask.node.lab_worker import LabWorker

        return await self.start_worker(self.credential("lab", name), cls=LabWorker, nthreads=nthreads,
                                       resources={LAB_RESOURCE: LAB_SLOTS})

    async def add_volunteer(self, name: str, *, cls: type[Worker] | None = None, credential: Credential | None = None,
                            nthreads: int = 1, **kwargs: Any) -> Worker:
        """A volunteer declaring its slots as the agent does (the node sets them from its role anyway)."""
        return await self.start_worker(credential or self.credential("volunteer", name), cls=cls or volunteer_worker(),
                                       nthreads=nthreads, resources={VOLUNTEER_RESOURCE: float(nthreads)}, **kwargs)

    def address_of(self, name: str) -> str:
        return self.workers[name].address

    def client(self, role: str = "researcher", name: str = "ada") -> Client:
        """An asynchronous client (``async with lab.client() as c``) of a researcher, or of another role."""
        return Client(self.scheduler.address, security=self.credential(role, name).security(), asynchronous=True)

    def connected(self) -> set[str]:
        """Names of the workers the scheduler has."""
        return {ws.name for ws in self.scheduler.workers.values()}

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Until ``predicate()`` holds (an event, not a time; pytest-timeout ends a test that hangs)."""
        while not predicate():
            await asyncio.sleep(0.005)

    async def close_workers(self) -> None:
        for worker in self.workers.values():
            if hasattr(worker, "release"):  # a stalling volunteer
                worker.release.set()
        await asyncio.gather(*(w.close() for w in self.workers.values()), return_exceptions=True)


@contextlib.asynccontextmanager
async def lab_node(state_dir: Path, *, volunteers: Iterable[str] = ("alice", "bob"), lab_worker: bool = True):
    """A started in-process lab node with a lab worker and honest volunteers of these names."""
    state_dir = Path(state_dir)
    node_credential = LabCA(state_dir).issue("lab", "lab-node")
    scheduler = Scheduler(host="127.0.0.1", port=0, dashboard=False, protocol="tls",
                          security=node_credential.security(), validate=True)
    plugins = scheduler_plugins.install(scheduler, state_dir)
    async with scheduler:
        lab = InProcessLab(state_dir, scheduler, plugins)
        try:
            if lab_worker:
                await lab.add_lab_worker()
            for name in volunteers:
                await lab.add_volunteer(name)
            yield lab
        finally:
            await lab.close_workers()


def run_lab(state_dir: Path, body: Callable[[InProcessLab], Awaitable[Any]], *, config: dict | None = None,
            **kwargs: Any) -> Any:
    """``await body(lab)`` on a fresh event loop, with an in-process lab node (``kwargs``: :func:`lab_node`'s)."""

    async def main():
        async with lab_node(state_dir, **kwargs) as lab:
            return await body(lab)

    with dask.config.set({**NODE_CONFIG, **(config or {})}):
        return asyncio.run(main())


# -- graphs -----------------------------------------------------------------------------


def _blocks(n: int, block: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + block, n)) for lo in range(0, n, block)]


def product_graph(a: np.ndarray, b: np.ndarray, block: int, *, lab_arrays: bool = False):
    """The verified blocked product C = A @ B: one matmul task per (i, j, k) under checks.

    ``lab_arrays``: the operands' blocks are lab-only source tasks naming their place in
    their lab array (as ``goblin_dask.array.sources`` makes them; the exposure plugin follows
    them), instead of plain data.  Returns (graph, keys of the block products, block counts).
    """
    tok = secrets.token_hex(16)
    dsk: dict = {}
    rows, inner, cols = _blocks(a.shape[0], block), _blocks(a.shape[1], block), _blocks(b.shape[1], block)

    def source(name: str, x: np.ndarray, rb, cb, aid: str):
        for i, (r0, r1) in enumerate(rb):
            for j, (c0, c1) in enumerate(cb):
                key = (name, i, j)
                part = np.ascontiguousarray(x[r0:r1, c0:c1])
                dsk[key] = (Task(key, lab_block, DataNode(None, part), lab_array=(aid, x.shape, ((r0, r1), (c0, c1))))
                            if lab_arrays else DataNode(key, part))

    src_a, src_b, prod = f"source-{tok[:16]}", f"source-{tok[16:]}", f"matmul-{tok}"
    source(src_a, a, rows, inner, "a" + tok[:15])
    source(src_b, b, inner, cols, "b" + tok[:15])
    keys = []
    for i in range(len(rows)):
        for j in range(len(cols)):
            for k in range(len(inner)):
                key = (prod, i, j, k)
                dsk[key] = CatalogTask(key, get("matmul"), TaskRef((src_a, i, k)), TaskRef((src_b, k, j)))
                keys.append(key)
    return insert_checks(dsk), keys, (len(rows), len(cols), len(inner))


def assemble(results: list, keys: list, blocks: tuple) -> np.ndarray:
    by_index = {k[1:]: r for k, r in zip(keys, results)}
    nb_i, nb_j, nb_k = blocks
    return np.block([[sum(by_index[(i, j, k)] for k in range(nb_k)) for j in range(nb_j)] for i in range(nb_i)])


async def compute_product(client: Client, a: np.ndarray, b: np.ndarray, block: int, **kwargs: Any) -> list:
    """Compute A @ B by verified blocks on the node; asserts the answer; returns the product keys."""
    dsk, keys, blocks = product_graph(a, b, block, **kwargs)
    results = await client.gather(client.get(dsk, keys, sync=False))
    np.testing.assert_allclose(assemble(results, keys, blocks), a @ b, rtol=1e-12, atol=1e-12)
    return keys


def random_graph(blocks: int, seed: int, shape=(24, 24)):
    """Random blocks (a replica-method op: no product check covers it) under checks; (graph, keys, expected)."""
    tok = secrets.token_hex(16)
    op = get("random_standard_normal")
    dsk, keys, expected = {}, [], []
    for i in range(blocks):
        key = (f"random_standard_normal-{tok}", i)
        dsk[key] = CatalogTask(key, op, shape=shape, dtype="float64", seed=(seed, i))
        keys.append(key)
        expected.append(np.random.Generator(np.random.PCG64([seed, i])).standard_normal(shape))
    return insert_checks(dsk), keys, expected


def matrices(seed: int, n: int = 64) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, n)), rng.standard_normal((n, n))
