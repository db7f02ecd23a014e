"""The volunteer agent: a ``dask worker`` that runs catalog operations and nothing else.

It holds that line by itself, whatever the lab node sends (see docs/design.md, "What a
volunteer accepts"):

1. every unpickling in the process goes through :mod:`goblin_dask.safe_pickle`
   (catalog ops by name, catalog tasks, numeric arrays, numbers, tuples, slices);
2. handlers that run code, ingest objects or leak the machine's state are blocked
   (:data:`BLOCKED_HANDLERS`), and worker plugins are refused even when the node sends
   them at registration;
3. before running a task, the agent re-checks it with the catalog's allow-list
   (:func:`goblin_dask.ops.task_violation`) and fails it otherwise;
4. there is no nanny and no preload; numba's cache is private to the agent's user, and
   the scratch directory is removed on exit.

One module a concern:

- :mod:`~goblin_dask.volunteer.worker`: the Dask worker, the only part the lab node reaches;
- :mod:`~goblin_dask.volunteer.panel_cache`: the lab's input blocks it keeps in memory for later tasks;
- :mod:`~goblin_dask.volunteer.process`: the process hardened and warmed before it joins;
- :mod:`~goblin_dask.volunteer.agent`: one volunteer across reconnections, its pause and status line;
- :mod:`~goblin_dask.volunteer.status_page`: its page on 127.0.0.1 and ``goblin volunteer pause|resume|status``;
- :mod:`~goblin_dask.volunteer.connection`: joining the lab node, retrying what can clear, ending on what cannot;
- :mod:`~goblin_dask.volunteer.gpus`: a worker process per GPU;
- :mod:`~goblin_dask.volunteer.command`: ``goblin volunteer`` (and ``python -m goblin_dask.volunteer``).

Importing it loads neither numpy, distributed nor torch (they load when the agent starts).
"""

from goblin_dask.volunteer.agent import LAB_REFRESH, Agent, pause_when_busy, report_status
from goblin_dask.volunteer.command import CONTROL_ACTIONS, main, volunteer_command
from goblin_dask.volunteer.connection import (CLEARABLE_REFUSALS, DEFAULT_BACKOFF, RefusedByNode, refusal_can_clear,
                                              run_volunteer)
from goblin_dask.volunteer.gpus import (check_gpu_count, check_gpu_memory_fraction, gpu_worker_plan, parse_gpus,
                                        require_cupy, run_gpu_workers)
from goblin_dask.volunteer.process import prepare_process, text_errors
from goblin_dask.volunteer.status_page import CONTROL_FILE, TOKEN_FILE, ControlPage, control, default_state_dir
from goblin_dask.volunteer.worker import BLOCKED_HANDLERS, EXPECTED_WORKER_PLUGINS, volunteer_worker_class

#: The name this factory had when the agent was one module (branches and scripts written before the split).
_volunteer_worker_class = volunteer_worker_class

__all__ = [
    "Agent", "BLOCKED_HANDLERS", "CLEARABLE_REFUSALS", "CONTROL_ACTIONS", "CONTROL_FILE", "ControlPage",
    "DEFAULT_BACKOFF", "EXPECTED_WORKER_PLUGINS", "LAB_REFRESH", "RefusedByNode", "TOKEN_FILE",
    "check_gpu_count", "check_gpu_memory_fraction", "control", "default_state_dir", "gpu_worker_plan", "main",
    "parse_gpus", "pause_when_busy", "prepare_process", "refusal_can_clear", "report_status", "require_cupy",
    "run_gpu_workers", "run_volunteer", "text_errors", "volunteer_command", "volunteer_worker_class",
]
