"""A volunteer keeps what it already holds: a bounded, in-memory cache of the lab's input blocks.

A panel (an input block of a task) a volunteer received from the lab worker stays in its
memory after the task that needed it, up to ``goblin.volunteer.cache-fraction`` of its memory
limit (and ``goblin.volunteer.cache-limit`` bytes, when set), least recently used first out.
A later task, in the same computation or a later one, that needs the same key is served
from there, without a transfer.  The cache is memory only (never disk) and goes with the worker.

Only keys whose name says their value are kept (:func:`cacheable_key`): the blocks of the
lab's data, ``(source-<token>, i, j, ...)``, whose token hashes the data's content (xxh3 of
the numbers, dtype, shape; a file's path, size and mtime) and the block sizes.  A checked
result is not kept: its value is whichever accepted result the lab kept (honest results of the
same key differ in rounding from one computation to the next), so a copy from an earlier
computation could make an honest volunteer's product disagree with the lab's copy by rounding.
The scheduler's byte size of the key must match too (a cheap guard against a reused name).

Within a computation, the inputs it fetched that are no lab data (a stage's input, the accepted result of the
stage before it, which its backward stage reads again) are kept the same way while the lab keeps them
(:meth:`PanelCache.put` with ``held``): their value cannot change while the lab holds the key, and the lab
node says when it lets one go (``free-keys`` on the worker stream, :meth:`PanelCache.release`), before it
could compute the key again.  They are named in no hint: the lab node knows what it sent
(:mod:`scheduler_plugins.volunteer_cache`).

The cache needs no trust: the lab checks every volunteer result against its own copy of the
inputs, so a volunteer serving itself a tampered panel returns a result that is rejected.

The volunteer tells the lab node which keys it holds (``goblin-cached`` on its worker stream,
:data:`HINT_OP`, at most once per :data:`HINT_INTERVAL`) so that placement prefers it for tasks reading them
(:mod:`scheduler_plugins.volunteer_cache`); the hint is untrusted: it only lowers the
volunteer's estimated transfer cost.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any

import numpy as np

#: The worker-stream op a volunteer uses to say which keys it holds (``add``/``remove`` lists of keys).
HINT_OP = "goblin-cached"
#: Most keys one hint message may name (in ``add`` and ``remove`` each), and most a volunteer is believed to
#: hold (about 100 bytes each on the scheduler: 100 KB per volunteer at most).
MAX_HINT_KEYS = 1024
#: Least seconds between two hints of one volunteer.  The scheduler charges each hint to the volunteer's call
#: budget (:class:`scheduler_plugins.admission.CallBudget`: 50 a second, its heartbeats' too), and a hint per
#: fetch grew with the volunteer's speed: two threads of small products, on 2 cores shared with the lab, sent
#: 30 to 60 a second, and faster machines send more.  Gathered and sent at this pace, an honest volunteer's
#: hints cost the same whatever its speed (the keys of the ones held back go in the next).
HINT_INTERVAL = 1.0
#: Longest key a hint may name (``source-<token>`` and block indices).
MAX_KEY_INDICES = 8

_SOURCE = re.compile(r"^source-[0-9a-f]{16,64}$")


def cacheable_key(key: Any) -> bool:
    """Is ``key`` a block of the lab's data, ``("source-<token>", i, j, ...)`` (its name is its content)?"""
    return (type(key) is tuple and 2 <= len(key) <= 1 + MAX_KEY_INDICES and type(key[0]) is str
            and _SOURCE.match(key[0]) is not None
            and all(type(i) is int and 0 <= i < 2**63 for i in key[1:]))


def cache_limit(memory_limit: int | None) -> int:
    """The cache's size in bytes for a worker of ``memory_limit`` bytes (None or 0: the machine's memory)."""
    from dask.utils import parse_bytes

    from goblin_dask import settings

    if not memory_limit:
        from distributed.system import MEMORY_LIMIT

        memory_limit = MEMORY_LIMIT
    fraction = float(settings.get("goblin.volunteer.cache-fraction") or 0.0)
    limit = int(max(0.0, min(fraction, 1.0)) * memory_limit)
    cap = settings.get("goblin.volunteer.cache-limit")
    if cap is not None:
        limit = min(limit, int(parse_bytes(cap) if isinstance(cap, str) else cap))
    return max(0, limit)


def _buffer_nbytes(x: Any) -> int:
    """Bytes of the buffer under array ``x`` (its own size when it owns its memory)."""
    root = x
    while isinstance(root, np.ndarray) and root.base is not None:
        root = root.base
    if isinstance(root, np.ndarray):
        return int(root.nbytes)
    try:
        view = memoryview(root)
    except TypeError:
        return int(getattr(x, "nbytes", 0))
    obj = view.obj
    return len(obj) if isinstance(obj, (bytes, bytearray)) else int(view.nbytes)


class PanelCache:
    """Least-recently-used panels, at most ``limit`` bytes; counts hits, misses and bytes fetched."""

    def __init__(self, limit: int):
        self.limit = int(limit)
        #: key -> (value, its bytes, the scheduler's nbytes of the key when it was received, held: no lab data block)
        self.entries: OrderedDict[Any, tuple[Any, int, int | None, bool]] = OrderedDict()
        self.bytes = 0
        self.peak = 0
        self.hits = 0
        self.hit_bytes = 0
        self.misses = 0
        self.evicted = 0
        self.fetched_bytes = 0  # bytes received from other workers (transfers), cached or not
        self.held_hits = 0  # of the hits, held results (a stage's input read again by its backward)
        self.released = 0  # held results dropped because the lab let them go
        #: hint deltas not yet told to the lab node
        self.added: set = set()
        self.removed: set = set()

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: Any) -> bool:
        return key in self.entries

    def put(self, key: Any, value: Any, lab_nbytes: int | None, held: bool = False) -> bool:
        """Keep ``value`` under ``key`` (most recent); evicts the oldest past the limit.  False: not kept.

        ``held``: ``key`` is no lab data block but a result the lab holds now (kept until :meth:`release`).
        A value that is a view into a larger buffer (a received message holding other keys too) is
        kept as a copy, so that the cache holds exactly the bytes it counts.
        """
        nbytes = int(getattr(value, "nbytes", 0))
        source = cacheable_key(key)
        if self.limit <= 0 or nbytes > self.limit or not (source or held):
            return False
        if _buffer_nbytes(value) > nbytes:
            value = value.copy()
        old = self.entries.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        elif source:
            self.added.add(key)
            self.removed.discard(key)
        self.entries[key] = (value, nbytes, lab_nbytes, not source)
        self.bytes += nbytes
        while self.bytes > self.limit:
            k, (_, n, _, was_held) = self.entries.popitem(last=False)
            self.bytes -= n
            self.evicted += 1
            if k in self.added:
                self.added.discard(k)
            elif not was_held:
                self.removed.add(k)
        self.peak = max(self.peak, self.bytes)
        return key in self.entries

    def release(self, keys) -> int:
        """Drop the held results among ``keys`` (the lab let them go: the next value of such a key may differ
        in rounding); lab data blocks stay (their name is their content).  Returns how many were dropped."""
        dropped = 0
        for key in keys:
            entry = self.entries.get(key)
            if entry is not None and entry[3]:
                del self.entries[key]
                self.bytes -= entry[1]
                dropped += 1
        self.released += dropped
        return dropped

    def get(self, key: Any, lab_nbytes: int | None) -> Any | None:
        """The kept value of ``key`` (now the most recent), or None; the scheduler's ``lab_nbytes`` must match."""
        entry = self.entries.get(key)
        if entry is None or (lab_nbytes is not None and entry[2] is not None and entry[2] != lab_nbytes):
            self.misses += 1
            return None
        self.entries.move_to_end(key)
        self.hits += 1
        self.hit_bytes += entry[1]
        if entry[3]:
            self.held_hits += 1
        return entry[0]

    def take_hint(self) -> dict | None:
        """The ``goblin-cached`` message telling what changed since the last one (None: nothing)."""
        if not self.added and not self.removed:
            return None
        msg = {"op": HINT_OP, "add": sorted(self.added, key=repr)[:MAX_HINT_KEYS],
               "remove": sorted(self.removed, key=repr)[:MAX_HINT_KEYS]}
        self.added.difference_update(msg["add"])
        self.removed.difference_update(msg["remove"])
        return msg

    def clear(self) -> None:
        self.entries.clear()
        self.bytes = 0
        self.added.clear()
        self.removed.clear()

    def stats(self) -> dict:
        return {"keys": len(self.entries), "bytes": self.bytes, "peak_bytes": self.peak, "limit": self.limit,
                "hits": self.hits, "hit_bytes": self.hit_bytes, "misses": self.misses, "evicted": self.evicted,
                "fetched_bytes": self.fetched_bytes, "held": sum(e[3] for e in self.entries.values()),
                "held_hits": self.held_hits, "released": self.released}
