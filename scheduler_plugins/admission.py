"""Admission and authorization: who may talk to the lab node, and do what.

Every peer is authenticated by mutual TLS under the lab's CA; its certificate names
its role and name (:func:`goblin_dask.tls.peer_identity`).  Each scheduler handler is
wrapped to check that role: volunteers may only register and heartbeat
(:data:`VOLUNTEER_HANDLERS`), researchers only what a ``distributed.Client`` needs
(:data:`RESEARCHER_HANDLERS`, an allow-list), and no
certificate means no handler at all.  A worker also presents its signed admission
token (``extra["goblin"]["credential"]`` of ``register-worker``), which must name the
same holder as its certificate.  The lab's trusted worker holds a ``lab`` credential,
volunteers a ``volunteer`` one.  The role, not anything the worker claims, decides its
resources: volunteers get ``goblin-volunteer`` slots, the lab worker ``goblin-lab``;
scheduling by these resources is what keeps non-catalog work off volunteers.

A volunteer's calls are also budgeted (:class:`CallBudget`), by what they cost (:func:`call_cost`: one call
plus the keys they name): a few a second are what an honest agent makes (heartbeats, its status), so a flood
of them is refused before any handler runs, and a volunteer that keeps flooding is banned (the stream
messages that report on no task spend the same budget: :mod:`scheduler_plugins.stream_guard`; how fast the
scheduler reads a volunteer's bytes at all: :class:`goblin_dask.link.ReadRate`); ``who_has`` must name its
keys, at most :data:`VOLUNTEER_WHO_HAS_KEYS`
(without keys it would answer with every key of the lab and who holds it, at the cost of a scan).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

from goblin_dask import link
from goblin_dask.credentials import CredentialError, LabKeys
from goblin_dask.node import rpc
from goblin_dask.roles import LAB_RESOURCE, LAB_SLOTS, VOLUNTEER_RESOURCE
from goblin_dask.tls import CLIENT_ROLES, peer_identity  # CLIENT_ROLES: goblin_dask.connect checks it too

logger = logging.getLogger("goblin_dask.admission")



#: What a banned or revoked volunteer is still answered: why it is refused.
SHUT_OUT_TOLD = frozenset({"register-worker", rpc.CHECK_CREDENTIAL})
#: The scheduler handlers a volunteer's connection may call.
VOLUNTEER_HANDLERS = frozenset({"register-worker", "heartbeat_worker", "who_has", "identity", rpc.LINK_ENDPOINTS,
                                rpc.VOLUNTEER_STATUS, rpc.CHECK_CREDENTIAL})
#: A volunteer's calls to the scheduler's handlers: on average at most this many a second, in bursts of at
#: most :data:`VOLUNTEER_CALL_BURST` (an honest agent makes a few a second: heartbeats and its status).
VOLUNTEER_CALLS_PER_SECOND = 50.0
VOLUNTEER_CALL_BURST = 500
#: Calls refused over the budget after which the volunteer is banned: a flood, not a burst.  Counted with a
#: decay (:data:`VOLUNTEER_FLOOD_MEMORY`), so that a long-lived honest agent refused now and then (a burst after
#: a reconnection) is never banned by refusals summed over weeks; a flood is refused hundreds of times a second.
VOLUNTEER_FLOOD_BAN = 1000
#: Seconds over which the flood count decays by a factor e: a volunteer is banned once refused about
#: :data:`VOLUNTEER_FLOOD_BAN` times within this long (more slowly than 1000 / 60, about 17 a second: never).
VOLUNTEER_FLOOD_MEMORY = 60.0
#: The most keys a volunteer may ask ``who_has`` about in one call.
VOLUNTEER_WHO_HAS_KEYS = 10_000
#: What a call or stream message costs from the budget beyond its one call (:func:`call_cost`): one call's
#: worth per this many keys it names, and per this many bytes of their text.  The budget counted calls alone
#: before: 10 credentials each asking ``who_has`` about 10,000 keys of 100 characters stayed under it and
#: slowed a researcher's one-task job from 7 ms to over a second (issue 29).
VOLUNTEER_KEYS_PER_CALL = 100
VOLUNTEER_KEY_BYTES_PER_CALL = 16 * 2**10
#: What a joining volunteer may claim: at most this many task threads, and a memory limit (when it sets
#: one) of at least this many bytes, and of at least ``goblin.admission.min-memory-per-thread`` per thread.
#: The lab sizes every product's tiles from the volunteers' claims
#: (:func:`goblin_dask.array.linalg.volunteer_capacity`: the smallest memory per thread, the threads in
#: all), so one volunteer claiming a million threads or a few bytes per thread would cut every product of
#: the lab into tiles so small that the lab computes them itself (issue 29: 256 threads in 64 MiB).
VOLUNTEER_MAX_THREADS = 256
VOLUNTEER_MIN_MEMORY = 64 * 2**20
#: What a joining volunteer's ``register-worker`` may carry beside its claims, per field: at most this many
#: entries (dict entries and list elements, nested ones included) and this many bytes of text (strings and keys;
#: a number counts 8), measured before distributed reads any of it.  Issue 29: 16 MiB of ``versions`` (read
#: within the read rate) stalled the scheduler's loop 4.66 s in distributed's version comparison, which runs
#: again for every worker and client that joins after it, over every worker's versions.  What the real agent
#: sends (``distributed.versions.get_versions`` names a fixed list of about 10 packages; the credential is its
#: only startup information), measured by ``tests/test_admission_fast.py``, is at least 10x below each.
VOLUNTEER_HELLO_LIMITS = {
    "versions": (256, 8 * 2**10),  # real: ~20 entries, ~0.5 KiB; compared on every join
    "metrics": (2048, 64 * 2**10),  # real: ~60 entries, ~1.5 KiB; distributed's heartbeat metrics
    "services": (16, 2**10),
    "resources": (16, 2**10),  # replaced by the role's slots at admission
}
#: Every other field of a volunteer's ``register-worker`` (its name, server_id, address, local_directory, ...):
#: at most this many entries and bytes of text each (a path fits).  ``extra`` (startup information) has its own
#: setting, ``goblin.admission.max-startup-information``.
VOLUNTEER_HELLO_FIELD = (64, 4 * 2**10)
#: A volunteer's registration is stale after this many of its heartbeat intervals without one
#: (``goblin.link.heartbeat``, 2 s, or distributed's where longer), and never under :data:`STALE_MIN_SECONDS`;
#: a new connection proven by the same certificate then replaces it (:meth:`AdmissionPlugin.stale_registration`).
STALE_HEARTBEATS = 4
STALE_MIN_SECONDS = 3.0
#: Refusals kept for the report (the oldest are dropped first; the log keeps every one).
REFUSALS_KEPT = 1000
#: The scheduler handlers a researcher's connection may call: what a ``distributed.Client``
#: needs to compute, gather, scatter (to the lab worker), publish, coordinate (variables,
#: queues, events, locks, semaphores) and read its own progress, plus the goblin read-only
#: handlers.  An allow-list: a handler added later is closed to researchers until listed here.
RESEARCHER_HANDLERS = frozenset({
    # session and cluster overview
    "register-client", "identity", "versions", "ncores", "ncores_running", "who_has", "has_what", "nbytes",
    "processing",
    # computing
    "gather", "scatter", "retry", "broadcast", "get_task_status", "get_task_stream", "get_metadata",
    "start_task_metadata", "stop_task_metadata", "events", "log_event",
    # published datasets and coordination primitives
    "publish_list", "publish_put", "publish_get", "publish_delete", "variable_set", "variable_get",
    "queue_create", "queue_put", "queue_get", "queue_qsize", "event_wait", "event_set", "event_clear",
    "event_is_set", "semaphore_register", "semaphore_acquire", "semaphore_release", "semaphore_close",
    "semaphore_refresh_leases", "semaphore_value", "multi_lock_acquire", "multi_lock_release",
    # goblin: the report (read-only); a Trainer's finished rounds, numbers only (scheduler_plugins.training)
    rpc.REPORT, rpc.TRAINING_ROUND,
    # goblin doctor: how the node sees this credential, and where volunteers reach the lab worker
    rpc.CHECK_CREDENTIAL, rpc.LINK_ENDPOINTS,
})


def call_cost(keys: Any = ()) -> float:
    """What a volunteer's call or stream message costs from its :class:`CallBudget`: one call, plus one per
    :data:`VOLUNTEER_KEYS_PER_CALL` keys in ``keys`` and one per :data:`VOLUNTEER_KEY_BYTES_PER_CALL` bytes of
    their text (a key is a string or a tuple of strings and numbers; the handler's work grows with both)."""
    if not isinstance(keys, (list, tuple)):
        return 1.0
    text = 0
    for key in keys:
        if isinstance(key, (str, bytes)):
            text += len(key)
        elif isinstance(key, (list, tuple)):
            text += sum(len(part) if isinstance(part, (str, bytes)) else 8 for part in key)
        else:
            text += 8
    return 1.0 + len(keys) / VOLUNTEER_KEYS_PER_CALL + text / VOLUNTEER_KEY_BYTES_PER_CALL


class CallBudget:
    """A token bucket per volunteer name: what a flood of calls costs the scheduler is bounded.

    ``spend(name, cost)`` takes ``cost`` calls' worth (:func:`call_cost`) from ``name``'s bucket (``burst``
    calls, refilled at ``rate`` a second): False, and nothing taken, when less than one call is left, and
    ``refused[name]`` counts those (for the report); :meth:`recent_refusals` counts them decayed by a factor e
    every ``memory`` seconds (what a ban for flooding reads).  A costly call may leave the bucket in debt: it
    runs, and the calls after it wait until the debt is paid back.  Names are those of admitted credentials (the
    lab's CA signed them), so the table grows with the volunteers enrolled, not with what they send.
    """

    def __init__(self, rate: float = VOLUNTEER_CALLS_PER_SECOND, burst: int = VOLUNTEER_CALL_BURST,
                 clock=time.monotonic, memory: float = VOLUNTEER_FLOOD_MEMORY):
        self.rate, self.burst, self.clock, self.memory = float(rate), float(burst), clock, float(memory)
        self.tokens: dict[str, tuple[float, float]] = {}  # name -> (tokens, when counted)
        self.refused: dict[str, int] = {}
        self._recent: dict[str, tuple[float, float]] = {}  # name -> (decayed refusals, when counted)

    def recent_refusals(self, name: str) -> float:
        """``name``'s refusals, each weighted ``exp(-age / memory)``."""
        count, then = self._recent.get(name, (0.0, self.clock()))
        return count * math.exp(-max(0.0, self.clock() - then) / self.memory)

    def spend(self, name: str, cost: float = 1.0) -> bool:
        now = self.clock()
        tokens, then = self.tokens.get(name, (self.burst, now))
        tokens = min(self.burst, tokens + (now - then) * self.rate)
        if tokens >= 1.0:
            self.tokens[name] = (tokens - max(1.0, float(cost)), now)
            return True
        self.tokens[name] = (tokens, now)
        self.refused[name] = self.refused.get(name, 0) + 1
        self._recent[name] = (self.recent_refusals(name) + 1.0, now)
        return False


class AdmissionPlugin(SchedulerPlugin):
    name = "goblin-admission"

    def __init__(self, scheduler, keys: LabKeys):
        self.scheduler = scheduler
        self.keys = keys
        self.roles: dict[str, str] = {}  # worker address -> "lab" | "volunteer"
        self.names: dict[str, str] = {}  # worker address -> credential name
        #: volunteer credential name -> its person, read from the lab's registry when it joins (kept after it leaves)
        self.persons: dict[str, str] = {}
        self.banned: set[str] = set()  # names banned in this node's lifetime
        #: the latest refusals (bounded: a flood of refused connections must not grow the scheduler)
        self.refusals: deque[dict[str, str]] = deque(maxlen=REFUSALS_KEPT)
        #: every ban, first one per name: {"name", "reason", "time"} (the report's ``bans``)
        self.bans: list[dict[str, Any]] = []
        #: each volunteer's calls to the scheduler's handlers (:class:`CallBudget`)
        self.calls = CallBudget()
        #: stale registrations replaced by their volunteer's new connection: {"name", "old", "new", "silent"}
        self.replaced: deque[dict[str, Any]] = deque(maxlen=REFUSALS_KEPT)
        #: ``goblin.link.heartbeat``, read (and a bad value refused) at the node's start
        self.heartbeat = link.heartbeat()

        self._add_worker = scheduler.handlers["register-worker"]
        scheduler.handlers["register-worker"] = self.register_worker
        scheduler.handlers["set_resources"] = self.refuse_set_resources
        self._heartbeat = scheduler.handlers["heartbeat_worker"]
        scheduler.handlers["heartbeat_worker"] = self.heartbeat_worker
        scheduler.handlers[rpc.REVOKE] = self.revoke_handler
        scheduler.handlers[rpc.BAN] = self.ban_handler
        scheduler.handlers[rpc.WORKERS] = self.workers_handler
        scheduler.handlers[rpc.CHECK_CREDENTIAL] = self.check_credential_handler
        link.start_shut_out(keys.revoked())  # no byte of a banned or revoked volunteer is read (goblin_dask.link)

    # -- queries -----------------------------------------------------------------
    def lab_workers(self) -> list[str]:
        return [a for a, r in self.roles.items() if r == "lab" and a in self.scheduler.workers]

    def volunteers(self) -> list[str]:
        return [a for a, r in self.roles.items() if r == "volunteer" and a in self.scheduler.workers]

    def is_volunteer(self, address: str) -> bool:
        return self.roles.get(address) == "volunteer"

    def is_lab(self, address: str) -> bool:
        """A connected lab worker?  O(1): asked for every check's verdicts, never a scan of the workers."""
        return self.roles.get(address) == "lab" and address in self.scheduler.workers

    def person(self, name: str | None) -> str | None:
        """Who holds volunteer credential ``name`` (:meth:`goblin_dask.credentials.LabKeys.person`)."""
        if name is None:
            return None
        person = self.persons.get(name)
        return person if person is not None else self.keys.person(name)

    def has_volunteer_besides(self, name: str | None) -> bool:
        """Is a volunteer of another person than ``name``'s connected?  Stops at the first one (asked per
        replica decision): two credentials of one person agree on whatever they like."""
        person = self.person(name)
        return any(r == "volunteer" and a in self.scheduler.workers and self.person(self.names.get(a)) != person
                   for a, r in self.roles.items())

    # -- handlers ----------------------------------------------------------------
    async def register_worker(self, comm, *, address: str, name: Any = None, extra: dict | None = None,
                              resources: dict | None = None, nthreads: int = 1, **kwargs):
        peer = peer_identity(comm)
        sizes: dict[str, tuple[int, int]] = {}
        try:
            if peer is not None and peer[0] == "volunteer":  # what it sent, before anything reads it
                sizes = _check_volunteer_hello({"address": address, "name": name, "extra": extra,
                                                "resources": resources, **kwargs})
            credential = ((extra or {}).get("goblin") or {}).get("credential", "")
            ident = self.keys.verify(credential)
            if peer != (ident.role, ident.name):
                raise CredentialError(f"its certificate ({peer}) does not match its token ({ident.role}, {ident.name})")
            if ident.name in self.banned:
                raise CredentialError(f"{ident.name!r} is banned from this lab node")
            stale = None
            if ident.name in self.names.values():
                stale = self.stale_registration(ident.name) if ident.role == "volunteer" else None
                if stale is None:
                    raise CredentialError(f"{ident.name!r} is already connected")
            if ident.role == "volunteer":
                _check_volunteer_claims(nthreads, kwargs.get("memory_limit"))
                person = self.keys.person(ident.name)
        except CredentialError as e:
            where = str(address)[:200]  # what the worker says its address is: any text, when it is refused for size
            self.refusals.append({"address": where, "reason": str(e)})
            logger.warning("refused worker %s (%s): %s", where, f"{peer[0]} {peer[1]}" if peer else "no certificate", e)
            await comm.write({"status": "error", "time": time.time(), "message": f"goblin lab node refused this worker: {e}"})
            return
        if stale is not None:
            await self.replace_stale(ident.name, stale, address)
        self.roles[address] = ident.role
        self.names[address] = ident.name
        if ident.role == "volunteer":
            self.persons[ident.name] = person
        slots = {VOLUNTEER_RESOURCE: float(nthreads)} if ident.role == "volunteer" else {LAB_RESOURCE: LAB_SLOTS}
        if ident.role == "volunteer":
            logger.info("admitted volunteer %s at %s (person %s); its register-worker's (entries, bytes of text): %s",
                        ident.name, address, person, ", ".join(f"{f} {n}/{b}" for f, (n, b) in sorted(sizes.items())))
        else:
            logger.info("admitted %s %s at %s", ident.role, ident.name, address)
        return await self._add_worker(comm, address=address, name=ident.name, extra=extra or {},
                                      resources=slots, nthreads=nthreads, **kwargs)

    def stale_registration(self, name: str, now: float | None = None) -> str | None:
        """The address of volunteer ``name``'s registration if it is stale, else None.

        Stale: nothing heard from it (heartbeats) for :data:`STALE_HEARTBEATS` of its heartbeat intervals
        (:func:`goblin_dask.link.volunteer_heartbeat`).  A volunteer whose link dropped and that started again
        is such a case: its old connections are half-open at the lab (no FIN ever arrived), and its new
        connection, proven by the same certificate, replaces them (:meth:`replace_stale`) instead of waiting
        for ``goblin.link.dead-after``.  Two live agents with one credential are not stale: the second one is
        refused with "already connected" (and retries) while the first one heartbeats.
        """
        now = time.time() if now is None else now
        workers = self.scheduler.workers
        limit = max(STALE_MIN_SECONDS, STALE_HEARTBEATS * link.volunteer_heartbeat(len(workers), self.heartbeat))
        for address, held in self.names.items():
            ws = workers.get(address)
            if held == name and self.roles.get(address) == "volunteer" and ws is not None \
                    and now - ws.last_seen > limit:
                return address
        return None

    async def replace_stale(self, name: str, stale: str, address: str) -> None:
        """Remove volunteer ``name``'s stale registration at ``stale`` (its tasks are reissued, as for a
        volunteer lost), so that its new connection from ``address`` is admitted."""
        ws = self.scheduler.workers.get(stale)
        silent = time.time() - ws.last_seen if ws is not None else 0.0
        logger.warning("volunteer %s rejoined from %s: its registration at %s (silent for %.1f s) is removed, "
                       "its tasks reissued", name, address, stale, silent)
        self.replaced.append({"name": name, "old": stale, "new": address, "silent": round(silent, 1)})
        await self.scheduler.remove_worker(stale, stimulus_id=f"goblin-rejoined-{name}-{time.time()}", close=True,
                                           expected=False)
        self.roles.pop(stale, None)
        self.names.pop(stale, None)

    def heartbeat_worker(self, comm, *, address: str, resources: dict | None = None, **kwargs):
        # Resources come from the role at admission; a heartbeat may not change them.
        peer = peer_identity(comm)
        if peer is not None and peer[0] == "volunteer":
            named = self.names.get(address)
            if named is not None and named != peer[1]:  # a volunteer heartbeats for itself only
                reason = f"sent a heartbeat for another worker ({named} at {address})"
                self.ban(peer[1], reason)
                raise PermissionError(f"goblin lab node: {reason}")
            entries, text = VOLUNTEER_HELLO_LIMITS["metrics"]
            if measure(kwargs.get("metrics"), entries, text) is None:  # distributed reads them at every heartbeat
                reason = (f"its heartbeat's 'metrics' is larger than this lab reads from a volunteer (at most {entries} "
                          f"entries and {text} bytes of text)")
                self.refusals.append({"address": str(address)[:200], "reason": reason})
                logger.warning("refused a heartbeat of volunteer %s: %s", peer[1], reason)
                raise PermissionError(f"goblin lab node: {reason}")
            answer = self._heartbeat(address=address, **kwargs)
            if isinstance(answer, dict) and "heartbeat-interval" in answer:  # the volunteer's next one, then
                answer["heartbeat-interval"] = link.volunteer_heartbeat(len(self.scheduler.workers), self.heartbeat)
            return answer
        return self._heartbeat(address=address, **kwargs)

    def refuse_set_resources(self, *args, **kwargs):
        raise PermissionError("goblin lab node: worker resources are set by role at admission")

    def check_credential_handler(self, comm, token: str | None = None) -> dict:
        """``goblin_check_credential``: how this node sees the caller's certificate, and (for a worker's
        credential) whether its admission token would be accepted now, and why not."""
        role, name = peer_identity(comm) or (None, None)
        verdict = None
        if token is not None:
            try:
                identity = self.keys.verify(str(token)[:512])
                verdict = "ok" if (identity.role, identity.name) == (role, name) else \
                    "the token names another holder than the certificate"
            except CredentialError as e:
                verdict = str(e)
        return {"role": role, "name": name, "revoked": name in self.keys.revoked(), "token": verdict}

    def revoke_handler(self, name: str) -> dict:
        return {"closed": self.revoke(name)}

    def ban_handler(self, comm, name: str, reason: str = "") -> dict:
        """``goblin_ban``: the lab's own processes (and the admin) ban a volunteer, with the reason."""
        peer = peer_identity(comm)
        if peer is None or peer[0] not in ("lab", "admin"):
            raise PermissionError("goblin lab node: only the lab and its admin ban volunteers")
        return {"closed": self.ban(str(name), str(reason) or f"banned by {peer[0]} {peer[1]}")}

    def workers_handler(self) -> dict:
        return {a: {"role": self.roles[a], "name": self.names[a]} for a in self.scheduler.workers if a in self.roles}

    def authorize_handlers(self) -> None:
        """Wrap every scheduler handler with a check of the caller's certificate role."""
        for op, handler in list(self.scheduler.handlers.items()):
            self.scheduler.handlers[op] = _authorized(op, handler, self.volunteer_call, self.researcher_call)

    def is_shut_out(self, name: str) -> bool:
        """Is volunteer ``name`` banned or revoked (by this node, or by ``goblin revoke`` writing the state
        directory while it could not reach the node), or its person banned (:meth:`ban_person`)?  Its open
        connections are closed when first seen."""
        if link.is_shut_out(name):
            return True
        if name in self.banned or name in self.keys.revoked() or self.person(name) in self.keys.banned_persons():
            link.shut_out([name])
            return True
        return False

    def researcher_call(self, name: str, op: str) -> None:
        """PermissionError when researcher ``name``'s credential was revoked (``goblin revoke NAME``): every call,
        ``register-client`` first, is refused, saying so (``goblin_dask.connect`` raises it as fatal, exit 6)."""
        if op != rpc.CHECK_CREDENTIAL and name in self.keys.revoked():  # that one answers how the node sees it
            raise PermissionError(f"goblin lab node: the credential of researcher {name} was revoked by the lab's "
                                  f"admin: '{op}' refused")

    def is_researcher(self, name: str) -> bool:
        """Is ``name`` a researcher's (a credential ``goblin researchers issue``/``approve`` wrote, or a client
        connected with one)?"""
        from goblin_dask.access.registry import REGISTRY_DIR

        keys = self.scheduler.plugins.get("goblin-researcher-keys")
        return (self.keys.state_dir / REGISTRY_DIR / f"{name}.credential").is_file() or \
            any(peer == ("researcher", name) for peer in getattr(keys, "clients", {}).values())

    def volunteer_call(self, name: str, op: str, msg: dict) -> None:
        """PermissionError unless volunteer ``name`` may make this call now (not banned or revoked, its
        :class:`CallBudget`, the arguments of ``who_has``); a volunteer refused :data:`VOLUNTEER_FLOOD_BAN`
        times is banned.  A banned or revoked one is answered only why it is refused (``register-worker``,
        ``goblin_check_credential``)."""
        if self.is_shut_out(name) and op not in SHUT_OUT_TOLD:
            raise PermissionError(f"goblin lab node: volunteer {name} is banned or revoked: '{op}' refused")
        keys = msg.get("keys") if op == "who_has" else ()
        named = isinstance(keys, (list, tuple)) and len(keys) <= VOLUNTEER_WHO_HAS_KEYS
        if not self.within_budget(name, op, call_cost(keys) if named else 1.0):
            raise PermissionError(f"goblin lab node: volunteer {name} called '{op}' over its budget of "
                                  f"{VOLUNTEER_CALLS_PER_SECOND:g} calls a second (a call naming keys costs one "
                                  f"more per {VOLUNTEER_KEYS_PER_CALL} of them)")
        if not named:  # without keys, who_has answers with every key of the lab
            raise PermissionError(f"goblin lab node: a volunteer's 'who_has' names a list of at most "
                                  f"{VOLUNTEER_WHO_HAS_KEYS} keys")

    def within_budget(self, name: str, op: Any, cost: float) -> bool:
        """Spend ``cost`` from volunteer ``name``'s :class:`CallBudget` for a call or stream message ``op``;
        False when it is over its budget (a volunteer over it :data:`VOLUNTEER_FLOOD_BAN` times is banned)."""
        if self.calls.spend(name, cost):
            return True
        if self.calls.recent_refusals(name) >= VOLUNTEER_FLOOD_BAN and name not in self.banned:
            self.ban(name, f"flooded the lab node: {self.calls.refused[name]} calls over its budget of "
                           f"{VOLUNTEER_CALLS_PER_SECOND:g} a second (last: {str(op)[:80]!r})")
        return False

    # -- actions -----------------------------------------------------------------
    def revoke(self, name: str, *, ban: bool = False) -> list[str]:
        """Revoke ``name``'s credential and disconnect it; returns the closed workers' addresses and researcher
        clients' ids.

        A volunteer's revocation by the lab's admin is recorded in ``report()["bans"]`` as a ban is (once per
        name).  A researcher's clients are disconnected, and every call of theirs is refused from now on."""
        self.keys.revoke(name)
        if not ban and self.is_researcher(name):
            logger.warning("revoked researcher %s", name)
            return self.close_researcher(name)
        if ban:
            self.banned.add(name)
        elif not any(b["name"] == name for b in self.bans):
            self.bans.append({"name": name, "reason": "revoked by the lab's admin", "time": time.time()})
            logger.warning("revoked volunteer %s", name)
        link.shut_out([name])  # its calls, stream and standby connections to the scheduler: closed now
        self.tell_lab_workers([name])  # ... and to the lab workers
        closed = [a for a, n in self.names.items() if n == name and a in self.scheduler.workers]
        for addr in closed:  # expected: its tasks are not to blame (no KilledWorker for them)
            self.scheduler.loop.add_callback(
                self.scheduler.remove_worker, addr, close=True, expected=True, stimulus_id=f"goblin-revoke-{name}"
            )
        return closed

    def close_researcher(self, name: str) -> list[str]:
        """Close the streams of researcher ``name``'s clients (their calls are refused from now on)."""
        keys = self.scheduler.plugins.get("goblin-researcher-keys")
        closed = [c for c, peer in list(getattr(keys, "clients", {}).items()) if peer == ("researcher", name)]
        for client in closed:
            stream = self.scheduler.client_comms.get(client)
            if stream is not None and stream.comm is not None:
                stream.comm.abort()
        return closed

    def refuse_volunteer(self, name: str, reason: str, ban: bool = True) -> None:
        """The comm layer refused bytes from volunteer ``name`` (:mod:`goblin_dask.link`): record it, ban it."""
        self.refusals.append({"address": name, "reason": reason})
        if ban:
            self.ban(name, reason)

    def ban(self, name: str, reason: str) -> list[str]:
        """Ban volunteer ``name``: revoke its credential, refuse it from now on, disconnect it.

        The ban is recorded once, with its reason (``report()["bans"]``); returns the closed addresses.
        """
        if name not in self.banned:
            self.bans.append({"name": name, "reason": reason, "time": time.time()})
            logger.warning("banned volunteer %s: %s", name, reason)
        return self.revoke(name, ban=True)

    def ban_person(self, name: str, reason: str) -> list[str]:
        """Ban volunteer ``name`` for wrong results, and with it every credential of its person (one per GPU,
        or several enrolments): one person's honesty is at stake, not one machine's.  The others' ban reason
        names ``name``; the person's ban is kept in the state directory (:meth:`LabKeys.ban_person`), so
        that a credential enrolled for them later is refused too.  Returns the closed addresses."""
        person = self.person(name)
        self.keys.ban_person(person, name, reason)  # first: a credential of theirs joining now is refused
        closed = self.ban(name, reason)
        others = self.keys.credentials_of(person) | {n for n, p in self.persons.items() if p == person}
        for other in sorted(others - {name}):
            closed += self.ban(other, f"credential {name} of the same person ({person}) was banned: {reason}")
        return closed

    def tell_lab_workers(self, names, workers=None) -> None:
        """The lab workers read nothing more from volunteers ``names`` either (:data:`link.SHUT_OUT_OP`)."""
        for address in self.lab_workers() if workers is None else workers:
            stream = self.scheduler.stream_comms.get(address)
            if stream is not None:
                try:
                    stream.send({"op": link.SHUT_OUT_OP, "names": sorted(names)})
                except Exception as e:  # a lab worker leaving: it learns the whole list when it rejoins
                    logger.warning("could not tell lab worker %s of banned volunteers: %s", address, e)

    def add_worker(self, scheduler, worker: str) -> None:
        names = self.banned | self.keys.revoked()
        if names and self.roles.get(worker) == "lab":  # a lab worker (re)joining learns every banned or revoked name
            self.tell_lab_workers(names, workers=[worker])

    def remove_worker(self, scheduler, worker: str, **kwargs) -> None:
        self.roles.pop(worker, None)
        self.names.pop(worker, None)


def min_memory_per_thread() -> int:
    """``goblin.admission.min-memory-per-thread`` in bytes: the least memory per task thread a volunteer may claim."""
    import dask.utils

    from goblin_dask import settings

    value = settings.get("goblin.admission.min-memory-per-thread")
    return int(dask.utils.parse_bytes(value) if isinstance(value, str) else value or 0)


def _check_volunteer_claims(nthreads: Any, memory_limit: Any) -> None:
    """CredentialError unless a joining volunteer's threads and memory limit are ones a machine has, and give
    each thread at least ``goblin.admission.min-memory-per-thread`` (the floor of every product's tile budget)."""
    if isinstance(nthreads, bool) or not isinstance(nthreads, int) or not 1 <= nthreads <= VOLUNTEER_MAX_THREADS:
        raise CredentialError(f"it claims {str(nthreads)[:40]!r} task threads (1 to {VOLUNTEER_MAX_THREADS})")
    if memory_limit is None or memory_limit == 0:  # no limit: the lab assumes the default volunteer's
        return
    if isinstance(memory_limit, bool) or not isinstance(memory_limit, (int, float)) \
            or not VOLUNTEER_MIN_MEMORY <= memory_limit < float("inf"):
        raise CredentialError(f"it claims a memory limit of {str(memory_limit)[:40]!r} bytes "
                              f"(at least {VOLUNTEER_MIN_MEMORY}, or none)")
    floor = min_memory_per_thread()
    if memory_limit < floor * nthreads:
        raise CredentialError(
            f"it claims {nthreads} task threads in a memory limit of {int(memory_limit)} bytes, "
            f"{int(memory_limit // nthreads)} per thread: goblin.admission.min-memory-per-thread is {floor} "
            f"(lower --nthreads or raise --memory-limit)")


def max_startup_information() -> int:
    """``goblin.admission.max-startup-information`` in bytes: the most text of a joining volunteer's ``extra``."""
    import dask.utils

    from goblin_dask import settings

    value = settings.get("goblin.admission.max-startup-information")
    value = int(dask.utils.parse_bytes(value) if isinstance(value, str) else value)
    if value <= 0:
        raise ValueError(f"goblin.admission.max-startup-information must be a positive number of bytes, got {value!r}")
    return value


def measure(value: Any, entries: int, text: int) -> tuple[int, int] | None:
    """``(entries, bytes of text)`` of a decoded message's ``value`` (see :data:`VOLUNTEER_HELLO_LIMITS`), or None
    as soon as it has more than ``entries`` or ``text``: the walk stops there, so a huge value costs no more than
    the limits to refuse."""
    count = size = 0
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            count += len(item)
            if count > entries:
                return None
            for k, v in item.items():
                todo.append(k)
                todo.append(v)
        elif isinstance(item, (list, tuple, set, frozenset)):
            count += len(item)
            if count > entries:
                return None
            todo.extend(item)
        elif isinstance(item, (str, bytes, bytearray, memoryview)):
            size += len(item)
        else:
            size += 8
        if size > text:
            return None
    return count, size


def hello_limits(field: str) -> tuple[int, int]:
    """The (entries, bytes of text) a joining volunteer's ``register-worker`` field may carry."""
    if field == "extra":
        text = max_startup_information()
        return text // 8, text
    return VOLUNTEER_HELLO_LIMITS.get(field, VOLUNTEER_HELLO_FIELD)


def _check_volunteer_hello(fields: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """CredentialError naming the first field of a joining volunteer's ``register-worker`` beyond its
    :func:`hello_limits`, or whose ``versions`` distributed could not compare (its comparison sorts the package
    names of every worker together, at every join: one worker's odd entry would break every later one); else
    each field's ``(entries, bytes)``."""
    sizes = {}
    for field, value in fields.items():
        entries, text = hello_limits(field)
        size = measure(value, entries, text)
        if size is None:
            what = "startup information ('extra')" if field == "extra" else repr(str(field)[:40])
            raise CredentialError(
                f"its register-worker's {what} is larger than this lab reads from a volunteer (at most {entries} "
                f"entries and {text} bytes of text; a goblin volunteer sends far less: is this a modified agent?)")
        sizes[str(field)] = size
    if not isinstance(fields.get("extra") or {}, dict):
        raise CredentialError("its register-worker's startup information ('extra') is not a mapping")
    versions = fields.get("versions")
    if versions is not None:
        if not isinstance(versions, dict) or any(not isinstance(versions.get(part, {}), dict)
                                                 for part in ("host", "packages")):
            raise CredentialError("its register-worker's 'versions' is not distributed's {'host': {...}, "
                                  "'packages': {...}}")
        for name, version in versions.get("packages", {}).items():
            if not isinstance(name, str) or not (version is None or isinstance(version, str)):
                raise CredentialError(f"its register-worker's 'versions' names package {str(name)[:40]!r} with "
                                      f"version {str(version)[:40]!r} (names and versions are text)")
    return sizes


def _role_may_call(role: str | None, op: str) -> bool:
    if role in ("admin", "lab"):
        return True
    if role == "researcher":
        return op in RESEARCHER_HANDLERS
    if role == "volunteer":
        return op in VOLUNTEER_HANDLERS
    return False


def _refusal(error: PermissionError) -> dict:
    """The answer to a refused call, as distributed answers a handler's exception (the caller raises it), but
    without distributed's ERROR traceback in the node's log: a refusal is expected, logged in one line."""
    from distributed.core import error_message

    return error_message(error, status="uncaught-error")


def _authorized(op: str, handler, volunteer_call=None, researcher_call=None):
    """``handler`` behind the role check; a volunteer's call also passes ``volunteer_call(name, op, msg)``, a
    researcher's ``researcher_call(name, op)``."""
    call = rpc.handler_caller(handler)
    if op == "register-client":
        allowed = lambda role: role in CLIENT_ROLES  # noqa: E731
    else:
        allowed = lambda role: _role_may_call(role, op)  # noqa: E731

    async def authorized(comm, **msg):
        peer = peer_identity(comm)
        role = peer[0] if peer else None
        if not allowed(role):
            logger.warning("refused '%s' from %s (%s)", op, comm.peer_address, peer)
            return _refusal(PermissionError(f"goblin lab node: '{op}' is not allowed for "
                                            f"{peer[0] + ' ' + peer[1] if peer else 'an unauthenticated peer'}"))
        if role == "researcher" and researcher_call is not None:
            try:
                researcher_call(peer[1], op)
            except PermissionError as e:
                logger.warning("refused '%s' from researcher %s: %s", op, peer[1], e)
                return _refusal(e)
        if role == "volunteer" and volunteer_call is not None:
            try:
                volunteer_call(peer[1], op, msg)
            except PermissionError as e:
                logger.warning("refused '%s' from volunteer %s: %s", op, peer[1], e)
                return _refusal(e)
        return await call(comm, msg)

    authorized.__name__ = getattr(handler, "__name__", op)
    return authorized
