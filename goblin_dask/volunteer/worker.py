"""The volunteer's Dask worker: it computes catalog operations and refuses everything else.

Kept apart from the agent around it (connection, pause, status page) because this class is what the
lab node can reach: every handler it answers, every message it sends and every task it runs passes
here, so what a hostile lab could ask of a volunteer is read in one file.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)

#: Worker RPC handlers a volunteer refuses, and why (listed in docs/design.md).
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


def realign(data: dict) -> None:
    """Replace each array of ``data`` (what a fetch received) that is not aligned to its itemsize by an aligned copy.

    A received array is a view into its message's buffer, at whatever offset its frame landed (which depends on the
    keys fetched together).  NumPy computes a product with an unaligned strided operand (a stage program's transposed
    weight) in its own loop instead of BLAS, whose rounding differs from the lab's recomputation on its aligned copy:
    honest stage results whose outputs are zero but for rounding (a bias gradient before a BatchNorm) were rejected."""
    import numpy as np

    for key, value in data.items():
        if type(value) is np.ndarray and not value.flags.aligned:
            data[key] = value.copy(order="K")


def fetch_nearest_first(available) -> None:
    """Re-order ``available`` (a worker's inputs to fetch from one peer) before it picks the next: the inputs of
    the task with the fewest inputs still to fetch go first, then by that task's priority.

    distributed orders fetches by the priority each input got from the first task that named it, so a task
    that arrived first (its inputs ready sooner at the lab) and one input of which is already here waits for
    every input of tasks of higher priority that arrived after it.  Over a home link a 32 MB panel takes more
    than a second: a volunteer's first result (and so its uploads) started one panel late (issue 30)."""
    items = list(available)
    changed = False
    for ts in items:
        nearest = min(((sum(1 for d in t.dependencies if d.state not in ("memory", "flight")), *t.priority)
                       for t in ts.dependents if t.state == "waiting" and t.priority), default=None)
        if nearest is not None and nearest != ts.priority:
            ts.priority = nearest
            changed = True
    if changed:
        available.clear()
        for ts in items:
            available.add(ts)


def volunteer_worker_class():
    """The ``VolunteerWorker`` class, made on call: distributed and numpy load when the agent starts, not on import."""
    import numpy as np
    from distributed import Worker
    from distributed.core import Status
    from distributed.worker_state_machine import ComputeTaskEvent, ExecuteFailureEvent, FreeKeysEvent
    from distributed.worker_state_machine import GatherDepSuccessEvent
    from distributed.worker_state_machine import UpdateDataEvent, WorkerState

    from goblin_dask import link
    from goblin_dask.ops import task_violation
    from tornado.ioloop import PeriodicCallback

    from goblin_dask.volunteer.panel_cache import HINT_INTERVAL, PanelCache, cache_limit, cacheable_key

    class VolunteerState(WorkerState):
        """distributed's worker state machine, fetching inputs nearest-task first (:func:`fetch_nearest_first`)."""

        __slots__ = ()

        def _select_keys_for_gather(self, available):
            fetch_nearest_first(available)
            return super()._select_keys_for_gather(available)

    class VolunteerWorker(Worker):
        """A distributed Worker that refuses everything but catalog operations.

        It also speaks to the lab only as the lab accepts (docs/design.md, "What the lab accepts
        from a volunteer"): it never announces the inputs it fetched (``add-keys``: a
        volunteer is no source of lab data; it frees them itself once its tasks used
        them), and its errors travel as text, never as pickled exceptions.

        Input blocks of the lab's data it received stay in a bounded cache in its memory
        (:mod:`goblin_dask.volunteer.panel_cache`): a later task that reads one is served from there, not
        fetched again, and the lab node is told which keys it holds (placement prefers it).  Its other
        inputs (results the lab accepted) stay there too until the lab node lets them go (``free-keys``).
        """

        #: its state machine: it fetches the inputs of the task nearest to runnable first
        goblin_state_class = VolunteerState

        def __init__(self, *args, **kwargs):
            self.goblin_paused = False  # the volunteer paused it (goblin volunteer pause): no new tasks
            #: (key, run id) of the tasks handed back while paused (each is handed back once)
            self.goblin_given_back: set = set()
            super().__init__(*args, WorkerStateClass=self.goblin_state_class, **kwargs)
            self.goblin_fetched: set = set()
            link.tune_worker_stream(self)
            self.goblin_done = 0  # tasks it finished
            self.goblin_cache = PanelCache(cache_limit(self.memory_manager.memory_limit))
            self.goblin_hinted = -HINT_INTERVAL  # when it last told the lab node what it keeps (time.monotonic)
            self.periodic_callbacks["goblin-cache-hint"] = PeriodicCallback(self._goblin_hint, HINT_INTERVAL * 1000)

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
            return self._goblin_give_back(f"goblin-paused-{time.time()}")

        def _goblin_give_back(self, stimulus: str) -> int:
            """Hand back (``reschedule``) each task given to it and not started, once per run of the task.

            At the pause, and again whenever a task arrives while paused: the scheduler may have sent it
            before it read the pause (the worker-status-change crossed its compute-task on the wire), and
            a paused worker never starts it, so kept it would wait for a resume that may never come (a
            computation hung on it until the lab's deadline, and the volunteer was marked late)."""
            held = {(ts.key, ts.run_id) for ts in self.state.tasks.values()
                    if ts.state in ("waiting", "ready", "constrained") and ts.run_spec is not None}
            given_back = self.goblin_given_back
            given_back &= held  # those the scheduler took back (free-keys) are gone from the worker
            waiting = [key for key, run_id in held if (key, run_id) not in given_back]
            given_back |= held
            for key in waiting:  # the scheduler releases them here (free-keys) and places them elsewhere
                super().batched_send({"op": "reschedule", "key": key, "stimulus_id": stimulus})
            return len(waiting)

        def goblin_resume(self) -> None:
            self.goblin_paused = False
            self.goblin_given_back.clear()
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
            for ev in stims:  # the lab let these keys go (free-keys): a held copy is stale from now on
                if isinstance(ev, FreeKeysEvent):
                    self.goblin_cache.release(ev.keys)
            arrived = any(isinstance(ev, ComputeTaskEvent) for ev in stims)
            if arrived and self.goblin_cache.limit > 0:
                stims = self._goblin_from_cache(stims)
            super().handle_stimulus(*stims)
            if arrived and self.goblin_paused:  # sent before the scheduler read the pause: it goes back too
                self._goblin_give_back(f"goblin-paused-arrival-{time.time()}")

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
                        # a lab data block is looked up even when absent (a miss counts); a held result only when kept
                        kept = cacheable_key(dep) or dep in self.goblin_cache
                        if (ts is None or ts.state == "released") and kept:
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
                realign(ev.data)
                cache = self.goblin_cache
                for key, value in ev.data.items():
                    cache.fetched_bytes += int(getattr(value, "nbytes", 0) or 0)
                    if type(value) is not np.ndarray:
                        continue
                    ts = self.state.tasks.get(key)
                    if cacheable_key(key):
                        cache.put(key, value, ts.nbytes if ts is not None else None)
                    elif ts is not None and ts.state == "flight":  # a result the lab holds, until it lets it go
                        # (not one released while in flight: its free-keys came first, and the lab may compute
                        # another value of the key)
                        cache.put(key, value, ts.nbytes, held=True)
                self._goblin_hint()
            return ev

        def _goblin_hint(self) -> None:
            """Tell the lab node which lab blocks it keeps now (placement prefers it for tasks reading them), at
            most once per ``HINT_INTERVAL``: each hint spends its call budget, whatever this volunteer's speed."""
            now = time.monotonic()
            if now - self.goblin_hinted < HINT_INTERVAL:
                return  # kept for the next one (the periodic callback sends it when no fetch does)
            hint = self.goblin_cache.take_hint()
            if hint is not None:
                self.goblin_hinted = now
                super().batched_send(hint)

        async def close(self, *args, **kwargs):
            self.goblin_cache.clear()  # memory only: nothing outlives the worker
            return await super().close(*args, **kwargs)

        def free_used_inputs(self):
            """Free fetched inputs that no task of this volunteer still needs (the cache keeps its copies: the release
            goes to distributed's state machine directly, past :meth:`handle_stimulus`, which drops held copies)."""
            busy = ("waiting", "ready", "constrained", "executing", "long-running", "resumed", "cancelled")
            done = []
            for key in list(self.goblin_fetched):
                ts = self.state.tasks.get(key)
                if ts is None:
                    self.goblin_fetched.discard(key)
                elif ts.state == "memory" and not any(d.state in busy for d in ts.dependents):
                    done.append(key)
            if done:  # their release-worker-data messages are dropped above
                super().handle_stimulus(FreeKeysEvent(keys=done, stimulus_id=f"goblin-used-inputs-{time.time()}"))

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
