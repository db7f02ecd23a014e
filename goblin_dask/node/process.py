"""What every process of a grid shares: no spilling, closing on signals, running, stopping."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess

import dask


def no_spilling() -> None:
    """Workers of a grid keep research data in memory: nothing spills to disk unasked."""
    dask.config.set({"distributed.worker.memory.target": False, "distributed.worker.memory.spill": False})


#: distributed's own defaults of the two monitors every process runs, and the grid's (:func:`quiet_monitors`)
QUIET_MONITORS = {"distributed.admin.tick.interval": ("20ms", "500ms"),
                  "distributed.admin.system-monitor.interval": ("500ms", "2s")}


def quiet_monitors() -> None:
    """Every process of a grid checks its event loop every 500 ms and samples CPU, memory and network
    every 2 s, where distributed does it every 20 ms and 500 ms.

    Measured on an idle local grid (``benchmarks/lab_share.py``'s idle figures, CPU ms per second):
    scheduler 24 -> 11, lab worker 18 -> 3, two volunteers 40 -> 18, nearly all of it the 50 wake-ups a
    second of the event-loop monitor.  The lab's processes pay this for every second of every round,
    and a volunteer's lender for every second it is connected.  A loop blocked for longer than
    ``distributed.admin.tick.limit`` (3 s) is still reported; a value the admin set (config file or
    ``DASK_DISTRIBUTED__ADMIN__...``) is kept.
    """
    for key, (default, quiet) in QUIET_MONITORS.items():
        if dask.config.get(key, None) == default:
            dask.config.set({key: quiet})


def close_on_signals(server, on_close=None) -> None:
    """SIGTERM/SIGINT close ``server`` gracefully (so its ``finally`` clean-ups run)."""
    loop = asyncio.get_running_loop()

    def close():
        if on_close is not None:
            on_close()
        asyncio.ensure_future(server.close())

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, close)


def run_async(coro) -> None:
    """Run a process's main coroutine; Ctrl-C ends it quietly."""
    try:
        asyncio.run(coro)
    except KeyboardInterrupt:
        pass


def stop_process(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM ``proc``'s process group (it closes as on Ctrl-C), then SIGKILL whatever it still holds."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(grace)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever the group still holds
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        pass
