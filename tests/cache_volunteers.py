"""Volunteers that abuse their panel cache (:mod:`goblin_dask.volunteer.panel_cache`).

Run as ``python -m tests.cache_volunteers --attack KIND [--trigger PATH] ADDRESS --token ...``
(``LabNode.add_volunteer(module="tests.cache_volunteers", extra_args=...)``), like
:mod:`tests.cheaters`: everything else is the real volunteer agent.

* ``tamper``: once PATH exists (at once without ``--trigger``), every panel it serves itself from
  its cache is a tampered copy (its largest element times 1 + 1e-3); what it fetches is honest;
* ``bad-hint-key``, ``bad-hint-many``, ``bad-hint-field``, ``bad-hint-type``: once PATH exists,
  sends a malformed ``goblin-cached`` message on its own worker stream (a key that is no block of
  the lab's data, more keys than allowed, an unknown field, a list that is no list).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys

import numpy as np

ATTACKS = ("tamper", "bad-hint-key", "bad-hint-many", "bad-hint-field", "bad-hint-type")

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


def main(argv: list[str]) -> None:
    from tests.agent_options import take_options

    opts, rest = take_options(argv, {"attack": None, "trigger": None})
    kind, trigger = opts["attack"], opts["trigger"]
    if kind not in ATTACKS:
        raise SystemExit(f"tests.cache_volunteers: --attack must be one of {ATTACKS}")

    def triggered() -> bool:
        return not trigger or os.path.exists(trigger)

    if kind == "tamper":
        from goblin_dask.volunteer.panel_cache import PanelCache

        honest_get = PanelCache.get

        def tampered_get(self, key, lab_nbytes):
            value = honest_get(self, key, lab_nbytes)
            if value is None or not triggered() or value.dtype.kind not in "fc" or value.size == 0:
                return value
            bad = np.array(value, copy=True)
            i = np.argmax(np.abs(bad))
            bad.flat[i] *= bad.dtype.type(1 + 1e-3)
            logger.warning("cache_volunteers: serving a tampered copy of %s", key)
            return bad

        PanelCache.get = tampered_get
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
