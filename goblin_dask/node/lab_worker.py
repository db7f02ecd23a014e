"""The trusted lab worker (``goblin lab-worker``, started by the lab node).

It holds the lab's data, runs glue tasks and every check of a volunteer's result.  Importing
this module imports ``distributed``'s worker: only the lab worker's process does.
"""

from __future__ import annotations

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
from goblin_dask.node.process import close_on_signals, no_spilling
from goblin_dask.roles import LAB_RESOURCE, LAB_SLOTS, LAB_WORKER_NAME
from goblin_dask.validation.checks import is_unverified_key

logger = logging.getLogger("goblin_dask.lab")

#: Unverified results whose source the lab worker remembers (their checks read it when they start).
FETCHED_KEPT = 100_000


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
        link.tune_worker_stream(self)
        self.stream_handlers[link.SHUT_OUT_OP] = link.shut_out_handler  # the scheduler names banned volunteers

    async def gather_dep(self, worker, to_gather, total_nbytes, *, stimulus_id):
        event = await super().gather_dep(worker, to_gather, total_nbytes, stimulus_id=stimulus_id)
        if isinstance(event, GatherDepFailureEvent) and worker.startswith("nat://"):
            # a volunteer that answers a fetch with an error is not believed again (its tasks go
            # elsewhere once it is banned); the fetch counts as a lost connection, not as an error
            # of the lab's task
            link.refuse(worker[len("nat://"):].rsplit(":", 1)[0],
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
