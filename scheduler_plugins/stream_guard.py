"""The worker stream of a volunteer: only reports on its own tasks, each from itself.

distributed's scheduler reads each worker's batched stream with ``handle_stream``, which
calls ``handler(**merge(extra, msg))``: a ``worker`` field in a message overrides the
connection's own address, and every stream handler (worker and client ones alike, they
share one table) is reachable.  This plugin takes over that reading for the scheduler's
connections (:meth:`StreamGuardPlugin.handle_stream`):

* **Volunteers** may send only what a worker needs to report on the tasks the scheduler
  gave it (:data:`VOLUNTEER_STREAM_OPS`), always attributed to the connection itself:

  - ``task-finished`` / ``task-erred`` / ``reschedule`` / ``steal-response`` about a
    (key, run) the scheduler sent it in a ``compute-task`` (tracked by wrapping its
    ``BatchedSend``; kept until the key is forgotten, then kept as stale for a while:
    a late report of a task the scheduler took back is passed on, the scheduler ignores it);
    a ``task-finished`` carries no ``goblin-*`` metadata (the ledger's verdicts come from
    the lab worker only), its metadata and pickled ``type`` are dropped; a
    ``task-erred`` carries its error as text only;
  - ``release-worker-data`` of a key the scheduler thinks it holds (any other is dropped:
    a no-op for the scheduler, and honest volunteers send stale ones);
  - ``worker-status-change`` of itself to running, paused or closing;
  - ``keep-alive``, ``log-event`` (plain data, under its own topics), and
    ``request-refresh-who-has`` (answered for the inputs of its own tasks only);
  - ``goblin-cached``: the lab data blocks it keeps (:mod:`goblin_dask.volunteer.panel_cache`), lists
    ``add`` and ``remove`` of at most ``MAX_HINT_KEYS`` keys ``(source-<token>, i, ...)`` each,
    nothing else (a placement hint, :mod:`scheduler_plugins.volunteer_cache`).

  Anything else (``add-keys``, ``long-running``, a ``worker`` field naming someone else,
  a task it was not given, a status for another worker, a client op, an unknown op) is
  refused: logged with the volunteer's name and the reason, recorded in the report
  (``refusals``), the volunteer banned at once (``bans``) and its connection closed.
* **The lab worker** is trusted, but its messages are attributed to its connection too
  (the ledger reads verdicts with the connection's own address).
* **Clients** (researchers, the admin) may not send worker messages on their stream
  (a forged ``task-finished`` of a check would carry verdicts): such a message is dropped
  and recorded as a refusal.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Any

from distributed.comm.core import CommClosedError
from distributed.diagnostics.plugin import SchedulerPlugin

from goblin_dask.node import rpc
from goblin_dask.volunteer.panel_cache import HINT_OP, MAX_HINT_KEYS, cacheable_key
from goblin_dask.tls import peer_identity
from goblin_dask.validation.checks import as_key
from scheduler_plugins.admission import AdmissionPlugin, call_cost

logger = logging.getLogger("goblin_dask.stream_guard")

#: What a volunteer may send on its worker stream (each op is further checked below).
VOLUNTEER_STREAM_OPS = frozenset({
    "task-finished", "task-erred", "release-worker-data", "reschedule", "steal-response", "keep-alive",
    "log-event", "worker-status-change", "request-refresh-who-has", HINT_OP,
})
#: Worker-to-scheduler stream ops of distributed 2026.8 (``Scheduler.__init__`` ``worker_handlers``,
#: plus work stealing's ``steal-response``); a client's stream may send none of them.
WORKER_STREAM_OPS = frozenset({
    "task-finished", "task-erred", "release-worker-data", "add-keys", "long-running", "reschedule", "keep-alive",
    "log-event", "worker-status-change", "request-refresh-who-has", "steal-response",
    HINT_OP,  # goblin's own (a volunteer's cache hint); no client may send it either
})
#: Stream messages that report on no task the scheduler gave the volunteer, so nothing bounds how many it
#: sends but its :class:`~scheduler_plugins.admission.CallBudget` (the one its calls spend, by
#: :func:`~scheduler_plugins.admission.call_cost`: one call plus one per 100 keys); over it they are dropped.
BUDGETED_STREAM_OPS = frozenset({"keep-alive", "log-event", "request-refresh-who-has", HINT_OP})
#: Statuses a volunteer may report for itself (``closing``: an honest worker says so when it stops).
VOLUNTEER_STATUSES = frozenset({"running", "paused", "closing", "closing_gracefully", "closed"})
#: Event topics an honest worker logs besides its own address (distributed's worker and state machine).
WORKER_EVENT_TOPICS = frozenset({
    "worker-fail-hard", "invalid-worker-transition", "invalid-worker-task-state", "transition-counter-max-exceeded",
})
#: (key, run ids) kept per volunteer after the key is forgotten: a late report about it is stale, not forged.
STALE_KEPT = 10_000
#: Largest log-event message (its msgpack-able content, roughly) passed on.
MAX_EVENT_CHARS = 10_000


class Refused(Exception):
    """A volunteer's stream message that is refused; the volunteer is banned."""


class StreamGuardPlugin(SchedulerPlugin):
    name = "goblin-stream-guard"

    def __init__(self, scheduler, admission: AdmissionPlugin):
        self.scheduler = scheduler
        self.admission = admission
        #: volunteer address -> {key: run ids the scheduler sent it}
        self.given: dict[str, dict[Any, set[int]]] = {}
        #: volunteer address -> forgotten keys it had been given, most recent last
        self.stale: dict[str, OrderedDict[Any, set[int]]] = {}
        #: key -> volunteer addresses it was given to (to drop it when it is forgotten)
        self._given_to: dict[Any, set[str]] = {}
        self.refused = 0
        #: budgeted stream messages dropped over the volunteer's call budget (:data:`BUDGETED_STREAM_OPS`)
        self.over_budget = 0
        self._handle_stream = scheduler.handle_stream
        scheduler.handle_stream = self.handle_stream

    # -- what the scheduler gave each volunteer ----------------------------------------
    def add_worker(self, scheduler, worker: str) -> None:
        if not self.admission.is_volunteer(worker):
            return
        self.given[worker] = {}
        self.stale[worker] = OrderedDict()
        bsend = scheduler.stream_comms.get(worker)
        if bsend is None:
            return
        send = bsend.send

        def recording_send(*msgs: Any) -> None:
            for msg in msgs:
                if isinstance(msg, dict) and msg.get("op") == "compute-task":
                    self._give(worker, msg.get("key"), msg.get("run_id"))
                    self._may_fetch(worker, msg.get("who_has") or {})
            return send(*msgs)

        bsend.send = recording_send

    def _may_fetch(self, worker: str, inputs: dict) -> None:
        """Tell the lab workers that volunteer ``worker`` may fetch the inputs of the task it is being given
        (a lab worker answers a volunteer's ``get_data`` of nothing else: :mod:`goblin_dask.node.lab_worker`)."""
        if not inputs:
            return
        by_holder: dict[str, list] = {}  # only the lab workers that hold an input: no scan of the workers per task
        for key, holders in inputs.items():
            for holder in holders or ():
                if self.admission.is_lab(holder):
                    by_holder.setdefault(holder, []).append(key)
        volunteer = self.admission.names.get(worker, worker)
        for lab, keys in by_holder.items():
            stream = self.scheduler.stream_comms.get(lab)
            if stream is not None:
                stream.send({"op": rpc.MAY_FETCH, "volunteer": volunteer, "keys": keys})

    def _give(self, worker: str, key: Any, run_id: Any) -> None:
        given = self.given.get(worker)
        if given is None:
            return
        given.setdefault(key, set()).add(run_id)
        self._given_to.setdefault(key, set()).add(worker)

    def remove_worker(self, scheduler, worker: str, **kwargs) -> None:
        for key in self.given.pop(worker, {}):
            holders = self._given_to.get(key)
            if holders is not None:
                holders.discard(worker)
                if not holders:
                    del self._given_to[key]
        self.stale.pop(worker, None)

    def transition(self, key, start, finish, *args, **kwargs) -> None:
        if finish != "forgotten" or key not in self._given_to:
            return
        for worker in self._given_to.pop(key):
            runs = self.given.get(worker, {}).pop(key, None)
            stale = self.stale.get(worker)
            if runs is not None and stale is not None:
                stale[key] = runs
                while len(stale) > STALE_KEPT:
                    stale.popitem(last=False)

    def was_given(self, worker: str, key: Any, run_id: Any = None) -> bool:
        """Did the scheduler send ``key`` (in run ``run_id``, if given) to ``worker``?"""
        try:
            runs = self.given.get(worker, {}).get(key) or self.stale.get(worker, {}).get(key)
        except TypeError:  # an unhashable "key"
            return False
        return bool(runs) and (run_id is None or run_id in runs)

    # -- the streams -------------------------------------------------------------------
    async def handle_stream(self, comm, extra: dict | None = None) -> None:
        """``Server.handle_stream``, for the scheduler's worker and client connections."""
        extra = extra or {}
        if "worker" in extra:
            peer = peer_identity(comm)
            volunteer = (peer is None or peer[0] == "volunteer") or self.admission.is_volunteer(extra["worker"])
            return await self._read(comm, extra, self._volunteer_message if volunteer else self._lab_message)
        if "client" in extra:
            return await self._read(comm, extra, self._client_message)
        return await self._handle_stream(comm, extra=extra)

    async def _read(self, comm, extra: dict, judge) -> None:
        """distributed's stream loop, with each message judged before its handler runs."""
        handlers = self.scheduler.stream_handlers
        closed = False
        try:
            while not closed:
                try:
                    msgs = await comm.read()
                except CommClosedError:
                    break
                if not isinstance(msgs, (tuple, list)):
                    msgs = (msgs,)
                for msg in msgs:
                    if msg == "OK":
                        break
                    if not isinstance(msg, dict):
                        msg = {"op": object()}  # refused below, as an unknown op
                    op = msg.pop("op", None)
                    if op == "close-stream":
                        closed = True
                        break
                    call = judge(op, msg, extra)
                    if call is None:
                        continue
                    if call is False:  # refused: the connection ends here
                        closed = True
                        break
                    handler = handlers[op]
                    result = handler(**call)
                    if asyncio.iscoroutine(result):
                        await result
                await asyncio.sleep(0)
        finally:
            await comm.close()

    def _lab_message(self, op: Any, msg: dict, extra: dict):
        if op not in self.scheduler.stream_handlers:
            logger.error("odd message from lab worker %s: %r", extra.get("worker"), op)
            return None
        if "worker" in msg and msg["worker"] != extra["worker"]:
            logger.warning("lab worker %s sent '%s' naming worker %s: attributed to itself", extra["worker"], op,
                           msg["worker"])
        return {**msg, **extra}

    def _client_message(self, op: Any, msg: dict, extra: dict):
        if op in WORKER_STREAM_OPS or op not in self.scheduler.stream_handlers:
            reason = f"a client may not send '{_text(op)}' on its stream"
            logger.warning("refused '%s' from client %s: %s", _text(op), extra.get("client"), reason)
            self.admission.refusals.append({"address": str(extra.get("client")), "op": _text(op), "reason": reason})
            self.refused += 1
            return None
        return {**msg, **extra}

    def _volunteer_message(self, op: Any, msg: dict, extra: dict):
        worker = extra["worker"]
        if self.admission.is_shut_out(self.admission.names.get(worker, worker)):
            return False  # banned or revoked: nothing more of it is read (its connection is being closed)
        try:
            return self.check(worker, op, msg)
        except Refused as e:
            self.refuse(worker, op, str(e))
            return False
        except Exception as e:  # a message that breaks a check is no honest message either
            self.refuse(worker, op, f"malformed message ({type(e).__name__}: {_text(e)})")
            return False

    def refuse(self, worker: str, op: Any, reason: str) -> None:
        name = self.admission.names.get(worker, worker)
        why = f"stream message '{_text(op)}' refused: {reason}"
        logger.warning("refused '%s' from volunteer %s at %s: %s", _text(op), name, worker, reason)
        self.admission.refusals.append({"address": worker, "name": name, "op": _text(op), "reason": reason})
        self.refused += 1
        self.admission.ban(name, why)

    # -- the volunteer's messages, one by one -------------------------------------------
    def check(self, worker: str, op: Any, msg: dict) -> dict | None:
        """The handler's arguments for ``msg`` from volunteer ``worker``; None: drop it; raises :class:`Refused`."""
        if not isinstance(op, str) or op not in VOLUNTEER_STREAM_OPS:
            raise Refused("a volunteer reports on its own tasks only" if op in WORKER_STREAM_OPS
                          else "not a message a volunteer sends")
        if op not in self.scheduler.stream_handlers:
            raise Refused("no such stream handler on this node")
        if "worker" in msg and msg["worker"] != worker:
            raise Refused(f"it names another worker ({_text(msg['worker'])})")
        if op in BUDGETED_STREAM_OPS and not self._within_budget(worker, op, msg):
            self.over_budget += 1
            return None
        out = {**msg, "worker": worker}
        if "key" in out:
            out["key"] = as_key(out["key"])
        return getattr(self, "_" + op.replace("-", "_"))(worker, out)

    def _within_budget(self, worker: str, op: str, msg: dict) -> bool:
        """Spend what ``msg`` costs from the volunteer's call budget (its keys: the handler's work)."""
        if op == HINT_OP:
            keys = [*_listed(msg.get("add")), *_listed(msg.get("remove"))]
        else:
            keys = _listed(msg.get("keys")) if op == "request-refresh-who-has" else ()
        return self.admission.within_budget(self.admission.names.get(worker, worker), op, call_cost(keys))

    def _known(self, key: Any) -> bool:
        try:
            return key in self.scheduler.tasks
        except TypeError:
            raise Refused("its key is not a key") from None

    def _own_task(self, worker: str, msg: dict, with_run: bool) -> dict | None:
        key = msg.get("key")
        if self.was_given(worker, key, msg.get("run_id") if with_run else None):
            return msg
        if not self._known(key):
            return msg if with_run else None  # the scheduler forgot it long ago: it answers free-keys
        raise Refused(f"task {_text(key, 120)} (run {_text(msg.get('run_id'))}) was not given to it")

    def _task_finished(self, worker: str, msg: dict) -> dict | None:
        metadata = msg.get("metadata") or {}
        if not isinstance(metadata, dict) or any(str(k).startswith("goblin") for k in metadata):
            raise Refused("task metadata for the lab's ledger (only the lab worker reports verdicts)")
        nbytes = msg.get("nbytes")
        if nbytes is not None and (not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0):
            raise Refused(f"nbytes is not a size ({_text(nbytes)})")
        msg = self._own_task(worker, msg, with_run=True)
        if msg is not None:  # the pickled type would be unpickled by whoever wants the key: dropped
            msg.update(metadata={}, type=None, typename=_text(msg.get("typename"), 80))
        return msg

    def _task_erred(self, worker: str, msg: dict) -> dict | None:
        if msg.get("exception") is not None or msg.get("traceback") is not None:
            raise Refused("a pickled exception (a volunteer's errors travel as text)")
        return self._own_task(worker, msg, with_run=True)

    def _reschedule(self, worker: str, msg: dict) -> dict | None:
        return self._own_task(worker, msg, with_run=False)

    def _steal_response(self, worker: str, msg: dict) -> dict | None:
        return self._own_task(worker, msg, with_run=False)

    def _release_worker_data(self, worker: str, msg: dict) -> dict | None:
        key = msg.get("key")
        if not self._known(key):
            return None
        ts = self.scheduler.tasks[key]
        ws = self.scheduler.workers.get(worker)
        if ws is not None and ws in (ts.who_has or ()):
            return msg
        # Not a holder as far as the scheduler knows: a no-op for the scheduler, dropped.  Not
        # refused: an honest volunteer releases inputs it fetched, and stale copies (seen in the
        # grid tests); naming another holder is what the attack needs, and that is refused above.
        logger.debug("dropped release of %s from volunteer %s, which does not hold it", _text(key, 120),
                     self.admission.names.get(worker, worker))
        return None

    def _worker_status_change(self, worker: str, msg: dict) -> dict | None:
        status = msg.get("status")
        if status not in VOLUNTEER_STATUSES:
            raise Refused(f"status {_text(status)} (a volunteer runs, pauses or closes)")
        return msg

    def _keep_alive(self, worker: str, msg: dict) -> dict | None:
        return {"worker": worker}

    def _log_event(self, worker: str, msg: dict) -> dict | None:
        topic, event = msg.get("topic"), msg.get("msg")
        topics = [topic] if isinstance(topic, str) else topic
        if not isinstance(topics, (list, tuple)) or not all(isinstance(t, str) for t in topics):
            raise Refused("an event topic that is not text")
        if not _plain(event):
            raise Refused("an event that is not plain data")
        kept = [t for t in topics if t == worker or t in WORKER_EVENT_TOPICS]
        if not kept or len(repr(event)) > MAX_EVENT_CHARS:
            logger.info("dropped an event of volunteer %s (topics %s)", self.admission.names.get(worker, worker),
                        _text(topics, 120))
            return None
        return {"worker": worker, "topic": kept, "msg": event}

    def _request_refresh_who_has(self, worker: str, msg: dict) -> dict | None:
        keys = [as_key(k) for k in msg.get("keys") or ()]
        own = set()
        for key in keys:  # only the inputs of tasks it was given
            ts = self.scheduler.tasks.get(key) if self._known(key) else None
            if ts is None or any(self.was_given(worker, d.key) for d in ts.dependents):
                own.add(key)
        if not own:
            return None
        return {**msg, "keys": [k for k in keys if k in own]}

    def _goblin_cached(self, worker: str, msg: dict) -> dict | None:
        extra = set(msg) - {"worker", "add", "remove"}
        if extra:
            raise Refused(f"a cache hint with fields {_text(sorted(map(str, extra)), 120)}")
        out = {"worker": worker}
        for field in ("add", "remove"):
            keys = msg.get(field, ())
            if not isinstance(keys, (list, tuple)) or len(keys) > MAX_HINT_KEYS:
                raise Refused(f"a cache hint whose '{field}' is not a list of at most {MAX_HINT_KEYS} keys")
            keys = [as_key(k) for k in keys]
            bad = next((k for k in keys if not cacheable_key(k)), None)
            if bad is not None:
                raise Refused(f"a cache hint naming {_text(bad, 120)}, not a block of the lab's data")
            out[field] = keys
        return out


def _listed(value: Any) -> list | tuple:
    return value if isinstance(value, (list, tuple)) else ()


def _plain(value: Any, depth: int = 0) -> bool:
    """Plain msgpack data: no object of a class (a pickle would be unpickled by its reader)."""
    if depth > 20:
        return False
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, (str, int, float, bool)) and _plain(v, depth + 1) for k, v in value.items())
    return False


def _text(value: Any, limit: int = 200) -> str:
    from scheduler_plugins.faults import short_text

    return short_text(value if isinstance(value, str) else repr(value), limit)
