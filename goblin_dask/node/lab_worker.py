"""The trusted lab worker (``goblin lab-worker``, started by the lab node).

It holds the lab's data, runs glue tasks and every check of a volunteer's result.  Importing
this module imports ``distributed``'s worker: only the lab worker's process does.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import OrderedDict

import dask
from distributed import Worker
from distributed.worker_state_machine import (
    GatherDepFailureEvent,
    GatherDepNetworkFailureEvent,
    GatherDepSuccessEvent,
)

from goblin_dask import link
from goblin_dask.node import rpc
from goblin_dask.node.process import close_on_signals, no_spilling, quiet_monitors
from goblin_dask.roles import LAB_RESOURCE, LAB_SLOTS, LAB_WORKER_NAME
from goblin_dask.validation.checks import as_key, is_unverified_key

logger = logging.getLogger("goblin_dask.lab")

#: Unverified results whose source the lab worker remembers (their checks read it when they start).
FETCHED_KEPT = 100_000
#: The lab worker's handlers a volunteer's connection may call: the inputs of its tasks, nothing else (not
#: ``keys``, ``update_data``, ``free_keys``, ``terminate``, ``get_logs``, ...).
VOLUNTEER_LAB_HANDLERS = frozenset({"get_data"})
#: Per volunteer, the keys of this worker it may fetch (inputs of tasks the scheduler gave it), most recent
#: last; the oldest are forgotten beyond this many.
MAY_FETCH_KEPT = 20_000
#: Seconds a volunteer's fetch of a key it may not fetch (yet) waits for the scheduler's word that it may:
#: the task and that word leave the scheduler together, on two streams.
MAY_FETCH_WAIT = 10.0


class LabWorker(Worker):
    """A ``distributed.Worker`` that remembers which volunteer sent each unverified result.

    A check blames the volunteer whose bytes it checked (``goblin_fetched_from``, read by
    :mod:`goblin_dask.validation.checks`).  Asking the scheduler who computed the key instead
    would race with a recomputation: when a banned volunteer is removed while the lab checks
    one of its results, the key may be recomputed by an honest one before the verdict arrives.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.goblin_fetched_from: OrderedDict = OrderedDict()
        #: volunteer name -> keys of this worker it may fetch (:meth:`may_fetch`)
        self.goblin_may_fetch: dict[str, OrderedDict] = {}
        self._may_fetch_changed = asyncio.Condition()
        link.tune_worker_stream(self)
        self.stream_handlers[link.SHUT_OUT_OP] = link.shut_out_handler  # the scheduler names banned volunteers
        self.stream_handlers[rpc.MAY_FETCH] = self.may_fetch
        for op, handler in list(self.handlers.items()):
            self.handlers[op] = _volunteers_call_only_their_fetches(op, handler)
        self.handlers["get_data"] = self.get_data_of_own_tasks  # its signature as distributed's (serializers)

    def may_fetch(self, volunteer: str = "", keys=()) -> None:
        """The scheduler's word that ``volunteer`` was given tasks whose inputs this worker holds (``keys``)."""
        allowed = self.goblin_may_fetch.setdefault(str(volunteer), OrderedDict())
        for key in keys:
            key = as_key(key)
            allowed[key] = None
            allowed.move_to_end(key)
        while len(allowed) > MAY_FETCH_KEPT:
            allowed.popitem(last=False)

        async def tell():
            async with self._may_fetch_changed:
                self._may_fetch_changed.notify_all()

        self.loop.add_callback(tell)

    async def get_data_of_own_tasks(self, comm, keys=(), who=None, serializers=None):
        """``get_data``; a volunteer fetches only the inputs of the tasks the scheduler gave it (the lab's
        other data, the other volunteers' results, ... are refused: max-share and max-exposure are planned
        per task).  A key it may not fetch yet is waited for, a while (:data:`MAY_FETCH_WAIT`)."""
        name = getattr(comm, "volunteer", None)
        if name is not None:
            def foreign():
                allowed = self.goblin_may_fetch.get(name, {})
                try:
                    return [k for k in keys if as_key(k) not in allowed]
                except TypeError:  # not a list of keys
                    return [keys]

            try:
                async with self._may_fetch_changed:
                    await asyncio.wait_for(self._may_fetch_changed.wait_for(lambda: not foreign()), MAY_FETCH_WAIT)
            except asyncio.TimeoutError:
                bad = foreign()
                logger.warning("refused volunteer %s's fetch of %d key(s) it was given no task for (%s)", name,
                               len(bad), str(bad[0])[:120])
                raise PermissionError(f"goblin lab worker: volunteer {name} may fetch only the inputs of its own "
                                      f"tasks, not {str(bad[0])[:120]}") from None
        return await super().get_data(comm, keys=keys, who=who, serializers=serializers)

    async def execute(self, key, *, stimulus_id):
        # computed here now (its volunteer left after the fetch, or it never had one): whoever sent the bytes
        # of an earlier fetch did not send these, and a check of them must blame or credit nobody
        self.goblin_fetched_from.pop(key, None)
        return await super().execute(key, stimulus_id=stimulus_id)

    async def gather_dep(self, worker, to_gather, total_nbytes, *, stimulus_id):
        event = await super().gather_dep(worker, to_gather, total_nbytes, stimulus_id=stimulus_id)
        if isinstance(event, GatherDepFailureEvent) and link.nat_name(worker) is not None:
            # a volunteer that answers a fetch with an error is not believed again (its tasks go
            # elsewhere once it is banned); the fetch counts as a lost connection, not as an error
            # of the lab's task
            link.refuse(link.nat_name(worker),
                        f"answered the lab worker's fetch with an error: {str(event.exception_text)[:200]}")
            return GatherDepNetworkFailureEvent(worker=worker, total_nbytes=total_nbytes,
                                                stimulus_id=f"goblin-refused-{time.time()}")
        if isinstance(event, GatherDepSuccessEvent):
            for key in event.data:
                if is_unverified_key(key):
                    self.goblin_fetched_from[key] = worker
                    self.goblin_fetched_from.move_to_end(key)
            while len(self.goblin_fetched_from) > FETCHED_KEPT:
                self.goblin_fetched_from.popitem(last=False)
        return event


def _volunteers_call_only_their_fetches(op: str, handler):
    """``handler`` of the lab worker; a volunteer's connection calls only :data:`VOLUNTEER_LAB_HANDLERS`."""
    call = rpc.handler_caller(handler)

    async def lab_handler(comm, **msg):
        if isinstance(comm, link.VolunteerComm) and op not in VOLUNTEER_LAB_HANDLERS:
            logger.warning("refused '%s' from volunteer %s", op, comm.volunteer)
            raise PermissionError(f"goblin lab worker: '{op}' is not allowed for volunteer {comm.volunteer}")
        return await call(comm, msg)

    lab_handler.__name__ = getattr(handler, "__name__", op)
    return lab_handler


def _warm_up() -> None:
    from goblin_dask import ops

    try:
        logger.info("%d numba kernels ready", ops.warm_up())
    except Exception as e:  # a kernel that cannot compile here compiles (or fails) where it is used
        logger.warning("warming up the catalog's kernels failed: %s", e)


async def serve_lab_worker(address: str, credential: str, *, nthreads: int, memory_limit, host: str | None,
                           local_directory: str | None = None, port: int = 0) -> None:
    """Run the trusted lab worker: it holds the lab's data and runs glue and checks."""
    from goblin_dask.tls import Credential

    cred = Credential.load(credential)
    link.install_lab_side()  # before the worker listens: volunteers' bytes are read as data only
    no_spilling()
    quiet_monitors()
    # It holds the only accepted copy of every result and runs every check: pausing it when
    # memory is high would stall the grid for good (volunteers cannot take its data).
    dask.config.set({"distributed.worker.memory.pause": False})
    # No sampling profiler unless the admin asks for one (DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED=True):
    # it walks every thread's stack 100 times a second, about 5 % of this process's CPU under a training
    # round, and this process's CPU bounds how fast the grid goes.
    if "DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED" not in os.environ:
        dask.config.set({"distributed.worker.profile.enabled": False})
    # One BLAS thread per task thread, as dask's nanny sets for its workers: checks run side by
    # side, and their CPU time is the calling thread's (the ledger's check_cpu).
    import numpy  # noqa: F401  (loads its BLAS, so that the limit reaches it)
    import threadpoolctl

    threadpoolctl.threadpool_limits(limits=1)
    worker = LabWorker(address, nthreads=nthreads, name=LAB_WORKER_NAME, memory_limit=memory_limit, host=host,
                       port=port, resources={LAB_RESOURCE: LAB_SLOTS}, local_directory=local_directory,
                       security=cred.security(),
                       startup_information={"goblin": lambda w: {"credential": cred.token}})

    async def report_refusal(name: str, reason: str, ban: bool) -> None:
        try:  # the scheduler keeps the record and bans; this process only logged it
            await getattr(worker.scheduler, rpc.REFUSE_VOLUNTEER)(name=name, reason=reason, ban=ban)
        except Exception as e:
            logger.warning("could not report the refusal of volunteer %s to the scheduler: %s", name, e)

    link.set_refusal_handler(report_refusal)
    # The catalog's numba kernels (the lab-only ops, and any volunteer op the lab computes itself)
    # compile or load from numba's cache in the background, not in a researcher's first computation.
    threading.Thread(target=_warm_up, name="goblin-warm-up", daemon=True).start()
    async with worker:
        close_on_signals(worker)
        await worker.finished()
