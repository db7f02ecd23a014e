"""Faulty volunteers: goblin volunteers whose catalog kernels fail (they do not lie).

Run as ``python -m tests.faulty --fault KIND [--honest-first N] ADDRESS --token ...``
(``LabNode.add_volunteer(module="tests.faulty", extra_args=...)``), like
:mod:`tests.cheaters`: everything else is the real volunteer agent.

KIND:

* ``raise``: the kernel raises ``RuntimeError`` on every task;
* ``memory``: the kernel raises ``MemoryError`` on every task (a volunteer out of memory);
* ``crash``: the process dies (``os._exit``) in the middle of its first task.

``--honest-first N``: compute honestly for the first N tasks, then fail.
"""

from __future__ import annotations

import os
import sys
import threading

KINDS = ("raise", "memory", "crash")
#: In every error the faulty kernel raises: tests look for it in the lab node's log.
MARK = "goblin-faulty-kernel"


def parse(argv: list[str]) -> tuple[str, int, list[str]]:
    from tests.agent_options import take_options

    opts, rest = take_options(argv, {"fault": "raise", "honest-first": 0})
    kind, honest_first = opts["fault"], int(opts["honest-first"])
    if kind not in KINDS:
        raise SystemExit(f"tests.faulty: --fault must be one of {KINDS}, got {kind!r}")
    return kind, honest_first, rest


def main(argv: list[str]) -> None:
    kind, honest_first, rest = parse(argv)
    from goblin_dask.ops.spec import OpSpec

    honest_call = OpSpec.__call__
    lock = threading.Lock()
    state = {"tasks": 0}

    def faulty_call(self, *args, **params):
        with lock:
            state["tasks"] += 1
            n = state["tasks"]
        if n <= honest_first:
            return honest_call(self, *args, **params)
        if kind == "crash":
            sys.stderr.write(f"{MARK}: crashing in task {n}\n")
            sys.stderr.flush()
            os._exit(13)
        if kind == "memory":
            raise MemoryError(f"{MARK}: out of memory in {self.name} (task {n})")
        raise RuntimeError(f"{MARK}: {self.name} failed (task {n})")

    OpSpec.__call__ = faulty_call
    from goblin_dask.volunteer import main as volunteer_main

    volunteer_main(rest)


if __name__ == "__main__":
    main(sys.argv[1:])
