"""Volunteers that abuse their panel cache (:mod:`goblin_dask.volunteer.panel_cache`).

Run as ``python -m tests.cache_volunteers --attack KIND [--trigger PATH] ADDRESS --token ...``
(``LabNode.add_volunteer(module="tests.cache_volunteers", extra_args=...)``), like
:mod:`tests.cheaters`: everything else is the real volunteer agent.

* ``tamper``: once PATH exists (at once without ``--trigger``), every panel it serves itself from
  its cache is a tampered copy (its largest element times 1 + 1e-3); what it fetches is honest;
* ``tamper-held``: the same, but only for the checked results it keeps while the lab holds them (a stage's
  input, read again by the stage's backward), the lab's data blocks served honestly;
* ``bad-hint-key``, ``bad-hint-many``, ``bad-hint-field``, ``bad-hint-type``: once PATH exists,
  sends a malformed ``goblin-cached`` message on its own worker stream (a key that is no block of
  the lab's data, more keys than allowed, an unknown field, a list that is no list);
* ``lure``: announces as cached every block ``(source-<token>, i, j)``, i, j < 32, of each lab array it has
  seen one block of (1024 keys each, nearly all never sent to it), to look cheapest for every task reading
  them, and never finishes a task (its kernels block); it writes the lab data blocks its tasks named to
  ``lure-<pid>.json`` in its working directory (what the lab sent it).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys

import numpy as np

ATTACKS = ("tamper", "tamper-held", "bad-hint-key", "bad-hint-many", "bad-hint-field", "bad-hint-type", "lure")
#: The block indices a lure announces per lab array (32 x 32 = MAX_HINT_KEYS keys).
LURE_SPAN = 32

logger = logging.getLogger("tests.cache_volunteers")


def bad_hint(kind: str) -> dict:
    from goblin_dask.volunteer.panel_cache import HINT_OP, MAX_HINT_KEYS

    block = ("source-" + "ab" * 16, 0, 0)
    if kind == "bad-hint-key":
        return {"op": HINT_OP, "add": [("matmul-" + "ab" * 16, 0, 0)], "remove": []}
    if kind == "bad-hint-many":
        return {"op": HINT_OP, "add": [(block[0], i, 0) for i in range(MAX_HINT_KEYS + 1)], "remove": []}
    if kind == "bad-hint-field":
        return {"op": HINT_OP, "add": [block], "remove": [], "who_has": {str(block): ["tcp://127.0.0.1:1"]}}
    if kind == "bad-hint-type":
        return {"op": HINT_OP, "add": "source-" + "ab" * 16, "remove": []}
    raise ValueError(kind)


def lure() -> None:
    """Patch the agent into a lure (see the module docstring)."""
    import json
    import threading

    from goblin_dask.ops.spec import OpSpec
    from goblin_dask.volunteer import worker
    from goblin_dask.volunteer.panel_cache import HINT_OP, cacheable_key

    def stalled(self, *args, **params):
        threading.Event().wait()  # holds the task (and its thread) until the lab takes it back

    OpSpec.__call__ = stalled
    honest_class = worker.volunteer_worker_class
    record = os.path.join(os.getcwd(), f"lure-{os.getpid()}.json")

    def lure_class():
        class LureWorker(honest_class()):
            async def start_unsafe(self):
                result = await super().start_unsafe()
                self.loop.add_callback(self.announce)
                return result

            async def announce(self):
                named, arrays = set(), set()
                while True:
                    await asyncio.sleep(0.2)
                    seen = {k for k in list(self.state.tasks) if cacheable_key(k)}
                    if seen - named:
                        named |= seen
                        with open(record, "w") as f:
                            json.dump(sorted(map(list, named)), f)
                    for array in sorted({k[0] for k in seen} - arrays):
                        arrays.add(array)
                        keys = [(array, i, j) for i in range(LURE_SPAN) for j in range(LURE_SPAN)]
                        logger.warning("cache_volunteers: announcing %d blocks of %s", len(keys), array)
                        self.batched_stream.send({"op": HINT_OP, "add": keys, "remove": []})

        return LureWorker

    worker.volunteer_worker_class = lure_class


def main(argv: list[str]) -> None:
    from tests.agent_options import take_options

    opts, rest = take_options(argv, {"attack": None, "trigger": None})
    kind, trigger = opts["attack"], opts["trigger"]
    if kind not in ATTACKS:
        raise SystemExit(f"tests.cache_volunteers: --attack must be one of {ATTACKS}")

    def triggered() -> bool:
        return not trigger or os.path.exists(trigger)

    if kind in ("tamper", "tamper-held"):
        from goblin_dask.volunteer.panel_cache import PanelCache, cacheable_key

        honest_get = PanelCache.get

        def tampered_get(self, key, lab_nbytes):
            value = honest_get(self, key, lab_nbytes)
            if value is None or not triggered() or value.dtype.kind not in "fc" or value.size == 0:
                return value
            if kind == "tamper-held" and cacheable_key(key):
                return value
            bad = np.array(value, copy=True)
            i = np.argmax(np.abs(bad))
            bad.flat[i] *= bad.dtype.type(1 + 1e-3)
            logger.warning("cache_volunteers: serving a tampered copy of %s", key)
            return bad

        PanelCache.get = tampered_get
    elif kind == "lure":
        lure()
    else:
        from goblin_dask.volunteer import worker  # where the agent looks its worker class up

        honest_class = worker.volunteer_worker_class

        def hostile_class():
            base = honest_class()

            class BadHintWorker(base):
                async def start_unsafe(self):
                    result = await super().start_unsafe()
                    self.loop.add_callback(self.attack)
                    return result

                async def attack(self):
                    while not triggered():
                        await asyncio.sleep(0.05)
                    logger.warning("cache_volunteers: sending a malformed cache hint (%s)", kind)
                    self.batched_stream.send(bad_hint(kind))

            return BadHintWorker

        worker.volunteer_worker_class = hostile_class
    from goblin_dask.volunteer import main as volunteer_main

    volunteer_main(rest)


if __name__ == "__main__":
    main(sys.argv[1:])
