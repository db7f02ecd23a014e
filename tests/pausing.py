"""A volunteer whose user pauses it while a task is on its way to it (not an attack).

Run as ``python -m tests.pausing [--pause-at N] ADDRESS --token ...``
(``LabNode.add_volunteer(module="tests.pausing", extra_args=...)``), like :mod:`tests.cheaters`:
everything else is the real volunteer agent, which computes honestly.

When the N-th ``compute-task`` (1 by default) reaches its worker, the volunteer is paused just before
the worker reads it (as ``goblin volunteer pause`` would, through the agent), so that task arrives after
the pause: the order of events when the scheduler sends a task while the volunteer's
``worker-status-change`` to paused is still on the wire.  It logs ``pausing: paused as task KEY
arrived`` and stays paused.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("goblin_dask.volunteer")
MARK = "pausing: paused as task"


def main(argv: list[str]) -> None:
    from distributed.worker_state_machine import ComputeTaskEvent

    from goblin_dask.volunteer import agent as agent_module
    from goblin_dask.volunteer import worker
    from tests.agent_options import take_options

    opts, rest = take_options(argv, {"pause-at": 1})
    pause_at = int(opts["pause-at"])
    agents = []
    honest_init = agent_module.Agent.__init__

    def remembered_init(self, *args, **kwargs):  # the agent, to pause it as its control page would
        honest_init(self, *args, **kwargs)
        agents.append(self)

    agent_module.Agent.__init__ = remembered_init
    honest_class = worker.volunteer_worker_class

    def pausing_class():
        class PausingWorker(honest_class()):
            arrived = 0

            def handle_stimulus(self, *stims):
                for ev in stims:
                    if isinstance(ev, ComputeTaskEvent):
                        type(self).arrived += 1
                        if type(self).arrived == pause_at:
                            agents[-1].pause("you")
                            logger.warning("%s %s arrived", MARK, ev.key)
                super().handle_stimulus(*stims)

        return PausingWorker

    worker.volunteer_worker_class = pausing_class
    from goblin_dask.volunteer import main as volunteer_main

    volunteer_main(rest)


if __name__ == "__main__":
    main(sys.argv[1:])
