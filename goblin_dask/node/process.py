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
