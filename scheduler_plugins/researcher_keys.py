"""Each researcher sees and fetches only the keys its own clients submitted.

distributed's scheduler answers every client about every key: ``has_what``, ``who_has`` and
``processing`` list the whole lab's keys, ``gather(keys=[key])`` returns any of them, and a client may
desire, cancel or resubmit any key it can name (a graph naming another's key under a dummy task
reads that key's value).  On a lab node, researchers are separate people, so every key is owned by
the identities (certificate role and name) whose clients brought it in: a graph that created it, or a
scatter.  A researcher's calls then see only its own keys:

- ``who_has``, ``has_what``, ``processing``, ``nbytes``, ``get_task_status``, ``get_task_stream`` and
  ``stop_task_metadata`` answer about its own keys only (another's key reads as unknown);
- ``gather``, ``retry``, ``get_metadata``, ``scatter`` and a graph (``update-graph``) naming another's
  key are refused with a ``PermissionError`` before anything runs; a graph that submits exactly the
  task held under that key (same function, arguments and input keys: two researchers computing the
  same thing) shares it instead;
- on the client stream, ``client-desires-keys``, ``cancel-keys``, ``report-key`` and ``update-data`` of
  another's keys are dropped (logged).

The lab's own processes and its admin keep the scheduler's full view.  What this does not cover: a
researcher's own Python function runs on the lab worker (:mod:`scheduler_plugins.catalog_only`), and
code there can read that worker's memory; researchers are trusted with code on the lab worker, not with
each other's results through the scheduler.
"""

from __future__ import annotations

import logging
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

from goblin_dask.tls import peer_identity

logger = logging.getLogger("goblin_dask.researcher_keys")

#: The role whose view is narrowed to its own keys.
NARROWED_ROLE = "researcher"


def _refused(op: str, keys: list) -> PermissionError:
    shown = ", ".join(repr(k) for k in keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
    return PermissionError(f"goblin lab node: '{op}' names {len(keys)} key(s) another researcher submitted "
                           f"({shown}); a researcher sees and fetches only what its own client submitted")


class ResearcherKeysPlugin(SchedulerPlugin):
    name = "goblin-researcher-keys"

    def __init__(self, scheduler):
        self.scheduler = scheduler
        #: client id -> (role, name) of the certificate that registered it
        self.clients: dict[str, tuple[str, str]] = {}
        #: key -> identities whose clients brought it in (dropped when the key is forgotten)
        self.owners: dict[Any, set[tuple[str, str]]] = {}

        h = scheduler.handlers
        self._register_client = h["register-client"]
        h["register-client"] = self.register_client
        for op, narrowed in (("who_has", self.who_has), ("has_what", self.has_what), ("processing", self.processing),
                             ("nbytes", self.nbytes), ("get_task_status", self.get_task_status),
                             ("get_task_stream", self.get_task_stream), ("gather", self.gather),
                             ("retry", self.retry), ("get_metadata", self.get_metadata), ("scatter", self.scatter),
                             ("stop_task_metadata", self.stop_task_metadata)):
            setattr(self, f"_orig_{op}", h[op])
            h[op] = narrowed
        s = scheduler.stream_handlers
        for op in ("client-desires-keys", "cancel-keys", "report-key", "update-data"):
            s[op] = self._stream_filter(op, s[op])
        self._create_graph = scheduler._create_taskstate_from_graph
        scheduler._create_taskstate_from_graph = self.create_taskstate_from_graph

    # -- ownership ----------------------------------------------------------------
    def _researcher(self, comm) -> tuple[str, str] | None:
        """The caller's identity when its view is narrowed (a researcher), else None."""
        peer = peer_identity(comm)
        return peer if peer is not None and peer[0] == NARROWED_ROLE else None

    def owns(self, who: tuple[str, str], key) -> bool:
        return who in self.owners.get(key, ())

    def foreign(self, who: tuple[str, str], key) -> bool:
        """Is ``key`` a task of the lab that ``who`` did not bring in?  A key the scheduler does not know,
        or a placeholder no one has submitted yet (a desire that came before its graph), is not."""
        ts = self.scheduler.tasks.get(key)
        if ts is None or self.owns(who, key):
            return False
        return bool(self.owners.get(key)) or ts.run_spec is not None or ts.state == "memory"

    def _same_task(self, key, submitted) -> bool:
        """Did the graph submit exactly the task the lab holds under ``key`` (same function, arguments and
        input keys, compared by dask's token)?  Two researchers computing the same thing share it: either
        could have computed it alone.  A dummy task under someone's key is not the same task."""
        ts = self.scheduler.tasks.get(key)
        return submitted is not None and ts is not None and ts.run_spec is not None and submitted == ts.run_spec

    def _own(self, who, keys) -> None:
        for key in keys:
            if key in self.scheduler.tasks:
                self.owners.setdefault(key, set()).add(who)

    def transition(self, key, start, finish, *args, **kwargs) -> None:
        if finish == "forgotten":
            self.owners.pop(key, None)

    def remove_client(self, scheduler, client: str) -> None:
        self.clients.pop(client, None)

    # -- session --------------------------------------------------------------------
    async def register_client(self, comm, client: str, versions: dict, **kwargs):
        peer = peer_identity(comm)
        if peer is not None:
            self.clients[client] = peer
        return await self._register_client(comm, client=client, versions=versions, **kwargs)

    def create_taskstate_from_graph(self, *, dsk: dict, client: str, keys: set, **kwargs):
        """A graph may name only its submitter's keys, or keys new to the lab (which become its own)."""
        who = self.clients.get(client)
        named = set(dsk) | set(keys)
        shared = []
        if who is not None and who[0] == NARROWED_ROLE:
            foreign = [k for k in named if self.foreign(who, k)]
            shared = [k for k in foreign if self._same_task(k, dsk.get(k))]
            if len(shared) < len(foreign):
                foreign = [k for k in foreign if k not in set(shared)]
                logger.warning("refused a graph of %s %s naming %d key(s) of others", *who, len(foreign))
                raise _refused("update-graph", foreign)
        fresh = [k for k in named if k not in self.scheduler.tasks or not self.owners.get(k)]
        result = self._create_graph(dsk=dsk, client=client, keys=keys, **kwargs)
        if who is not None:
            self._own(who, fresh + shared)
        return result

    def _stream_filter(self, op: str, handler):
        def filtered(**msg):
            who = self.clients.get(msg.get("client"))
            if who is not None and who[0] == NARROWED_ROLE:
                if op == "report-key":
                    if self.foreign(who, msg.get("key")):
                        return None
                elif op == "update-data":
                    if any(self.foreign(who, k) for k in (msg.get("who_has") or {})):
                        logger.warning("dropped update-data of %s %s naming keys of others", *who)
                        return None
                    result = handler(**msg)
                    self._own(who, msg.get("who_has") or {})
                    return result
                else:
                    keys = list(msg.get("keys") or ())
                    mine = [k for k in keys if not self.foreign(who, k)]
                    if len(mine) < len(keys):
                        logger.warning("dropped %s of %d key(s) of others from %s %s", op, len(keys) - len(mine), *who)
                        if op == "client-desires-keys":  # its futures fail at once instead of waiting forever
                            self._tell_refused(msg["client"], op, [k for k in keys if k not in mine])
                    msg["keys"] = mine
            return handler(**msg)

        return filtered

    def _tell_refused(self, client: str, op: str, keys: list) -> None:
        """Fail these keys' futures in ``client`` only (``Scheduler.report`` would tell the owner too)."""
        from distributed.core import error_message

        comm = self.scheduler.client_comms.get(client)
        if comm is None:
            return
        err = error_message(_refused(op, keys))
        for key in keys:
            comm.send({"op": "task-erred", "key": key, "exception": err["exception"], "traceback": err["traceback"]})

    # -- narrowed handlers -------------------------------------------------------------
    def _visible(self, who, keys) -> list:
        return [k for k in keys if self.owns(who, k)]

    def who_has(self, comm, keys=None, **kwargs):
        who = self._researcher(comm)
        if who is None:
            return self._orig_who_has(keys=keys, **kwargs)
        if keys is None:
            return self._orig_who_has(keys=[k for k, o in self.owners.items() if who in o], **kwargs)
        keys = list(keys)
        answer = self._orig_who_has(keys=[k for k in keys if not self.foreign(who, k)], **kwargs)
        return {k: answer.get(k, []) for k in keys}

    def has_what(self, comm, workers=None, **kwargs):
        answer = self._orig_has_what(workers=workers, **kwargs)
        who = self._researcher(comm)
        return answer if who is None else {w: self._visible(who, ks) for w, ks in answer.items()}

    def processing(self, comm, workers=None, **kwargs):
        answer = self._orig_processing(workers=workers, **kwargs)
        who = self._researcher(comm)
        return answer if who is None else {w: self._visible(who, ks) for w, ks in answer.items()}

    def nbytes(self, comm, keys=None, summary=True, **kwargs):
        who = self._researcher(comm)
        if who is not None:
            keys = [k for k in (self.owners if keys is None else keys)
                    if self.owns(who, k) and k in self.scheduler.tasks]
        return self._orig_nbytes(keys=keys, summary=summary, **kwargs)

    def get_task_status(self, comm, keys, **kwargs):
        who = self._researcher(comm)
        if who is None:
            return self._orig_get_task_status(keys=keys, **kwargs)
        keys = list(keys)
        answer = self._orig_get_task_status(keys=[k for k in keys if not self.foreign(who, k)], **kwargs)
        return {k: answer.get(k) for k in keys}

    def get_task_stream(self, comm, **kwargs):
        answer = self._orig_get_task_stream(**kwargs)
        who = self._researcher(comm)
        return answer if who is None else [t for t in answer if self.owns(who, t.get("key"))]

    def stop_task_metadata(self, comm, **kwargs):
        answer = self._orig_stop_task_metadata(**kwargs)
        who = self._researcher(comm)
        if who is None:
            return answer
        return {part: {k: v for k, v in (answer.get(part) or {}).items() if self.owns(who, k)}
                for part in ("metadata", "state")}

    def _refuse_foreign(self, comm, op: str, keys) -> None:
        who = self._researcher(comm)
        if who is not None:
            foreign = [k for k in keys if self.foreign(who, k)]
            if foreign:
                logger.warning("refused '%s' of %s %s naming %d key(s) of others", op, *who, len(foreign))
                raise _refused(op, foreign)

    async def gather(self, comm, keys, **kwargs):
        self._refuse_foreign(comm, "gather", list(keys))
        return await self._orig_gather(keys=keys, **kwargs)

    def retry(self, comm, keys, **kwargs):
        self._refuse_foreign(comm, "retry", list(keys))
        return self._orig_retry(keys=keys, **kwargs)

    def get_metadata(self, comm, keys, **kwargs):
        path = list(keys) if isinstance(keys, (list, tuple)) else [keys]
        self._refuse_foreign(comm, "get_metadata", path[:1])
        return self._orig_get_metadata(keys=keys, **kwargs)

    async def scatter(self, comm, data, **kwargs):
        self._refuse_foreign(comm, "scatter", list(data))
        keys = await self._orig_scatter(data=data, **kwargs)
        who = peer_identity(comm)
        if who is not None:
            self._own(who, keys)
        return keys
