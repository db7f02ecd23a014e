"""Joining the lab node and staying joined: reconnection with backoff, refusals, signals.

Errors are sorted here: what no retry can fix (a wrong scheme, another lab's credential, a refusal
by the lab's admin) ends the agent at once; a lost link or an old registration not yet replaced is
retried with jittered backoff, so volunteers cut off together do not return together.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import sys
from pathlib import Path

import dask

from goblin_dask.errors import fatal_connect_error
from goblin_dask.volunteer.agent import Agent, pause_when_busy, report_status
from goblin_dask.volunteer.status_page import ControlPage, default_state_dir
from goblin_dask.volunteer.worker import BLOCKED_HANDLERS

logger = logging.getLogger(__name__)

#: First and longest wait between connection attempts (each drawn between half and all of it): a home
#: link back after an outage, or a lab node restarted, has its volunteers computing within seconds.
DEFAULT_BACKOFF = (1.0, 5.0)
#: Refusals that clear by themselves, so the agent retries them: its previous run's registration (a
#: link that dropped without a word) is replaced once the lab has not heard from it for a few seconds.
CLEARABLE_REFUSALS = ("is already connected",)


def refusal_can_clear(message: str) -> bool:
    """Does the lab node's refusal ``message`` clear by waiting (retry) rather than by the lab's admin (exit)?"""
    return any(phrase in message for phrase in CLEARABLE_REFUSALS)


class RefusedByNode(RuntimeError):
    """The lab node refused this volunteer (bad, revoked or banned credential)."""



async def reachable(address: str, connection_args: dict, timeout: float) -> str | None:
    """None when a TLS connection to ``address`` opens (and is closed again), else why not (``goblin doctor`` asks too)."""
    from distributed.comm import connect

    try:
        comm = await connect(address, timeout=timeout, **connection_args)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    await comm.close()
    return None


async def run_volunteer(address: str, credential, *, nthreads: int = 1, memory_limit="auto",
                        local_directory: str | None = None, backoff=DEFAULT_BACKOFF,
                        max_attempts: int | None = None, state_dir: str | os.PathLike | None = None,
                        status_port: int | None = 0, status_interval: float = 1.0, backend: str = "cpu",
                        idle_threshold: float | None = None) -> None:
    """Join the lab node at ``address`` and compute until it closes; reconnect with backoff.

    ``credential`` is a :class:`goblin_dask.tls.Credential` (or its encoded string).
    ``state_dir``: the volunteer's own directory (default :func:`default_state_dir`), where the control
    page's address and token are while it runs; ``status_port``: the control page's port on 127.0.0.1
    (0: any free one; None: no page, so no pause/resume); ``status_interval``: seconds between status lines;
    ``idle_threshold``: pause while other processes use this percent of the CPU or more (None: never).
    """
    from goblin_dask.node.process import no_spilling, quiet_monitors

    from goblin_dask import link

    link.install_volunteer_side()
    link.join_lab(address)  # the host this volunteer dials (and goblin.link.lab-hosts)
    # looked up now, not at import: a test's hostile volunteer replaces worker.volunteer_worker_class
    from goblin_dask.volunteer.worker import volunteer_worker_class

    VolunteerWorker = volunteer_worker_class()
    no_spilling()  # the lab's numbers never reach the volunteer's disk
    quiet_monitors()  # the lender's CPU: no event-loop checks 50 times a second
    # No sampling profiler on a lent machine: every task is a catalog kernel (nothing to learn
    # from its stacks) and sampling busy threads every 10 ms costs the lender's CPU.
    dask.config.set({"distributed.worker.profile.enabled": False})
    # The lab reads no compressed frames from a volunteer (docs/design.md, "What the lab accepts").
    dask.config.set({"distributed.comm.compression": False})

    from goblin_dask.tls import Credential

    if not isinstance(credential, Credential):
        credential = Credential.load(credential)
    name = credential.name
    security = credential.security()
    connection_args = security.get_connection_args("worker")
    agent = Agent(name, address, nthreads=nthreads, memory_limit=memory_limit, backend=backend)
    page = ControlPage(agent, Path(state_dir) if state_dir else default_state_dir(name), status_port or 0)
    if status_port is not None:
        page.start()
    status = asyncio.ensure_future(report_status(agent, status_interval))
    idle = asyncio.ensure_future(pause_when_busy(agent, idle_threshold)) if idle_threshold is not None else None
    stopping: list = []
    _stop_on_signals(agent, stopping)
    try:
        await _join_and_compute(agent, address, credential, security, connection_args, VolunteerWorker,
                                nthreads=nthreads, memory_limit=memory_limit, local_directory=local_directory,
                                backoff=backoff, max_attempts=max_attempts, stopping=stopping)
    except asyncio.CancelledError:
        if not stopping:
            raise
    finally:
        status.cancel()
        if idle is not None:
            idle.cancel()
        page.stop()
        if sys.stdout.isatty():  # end the status line
            print(file=sys.stdout, flush=True)


def _stop_on_signals(agent: Agent, stopping: list) -> None:
    """SIGTERM/SIGINT stop the agent gracefully whatever it is doing: its worker closes when joined, else
    the connection attempts end; either way its clean-ups run (scratch directory, control page files)."""
    import signal

    loop = asyncio.get_running_loop()
    main = asyncio.current_task()

    def stop():
        stopping.append(True)
        if agent.worker is not None:
            asyncio.ensure_future(agent.worker.close())
        else:
            main.cancel()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)


async def _join_and_compute(agent, address, credential, security, connection_args, VolunteerWorker, *, nthreads,
                            memory_limit, local_directory, backoff, max_attempts, stopping: list) -> None:
    from goblin_dask.roles import VOLUNTEER_RESOURCE

    from goblin_dask import link
    from goblin_dask.errors import EXIT_HOSTILE_LAB, FatalConnectError

    name = credential.name
    wait, attempts = backoff[0], 0
    hostile: list[str] = []
    current: list = []  # the worker now starting or joined

    def leave(reason: str) -> None:  # the lab itself sent it: no retry brings another answer
        hostile.append(reason)
        for worker in current:
            asyncio.ensure_future(worker.close())

    link.on_hostile_lab(leave)
    while True:
        why = await reachable(address, connection_args, timeout=max(wait, 3.0))
        fatal = fatal_connect_error(address, why) if why is not None else None
        if fatal is not None:  # retrying cannot help (wrong scheme, another lab's credential)
            raise fatal
        if why is None:
            attempts = 0
            wait = backoff[0]
            worker = VolunteerWorker(
                address, nthreads=nthreads, name=name, memory_limit=memory_limit, nanny=None,
                protocol="nat", host=name, dashboard=False,
                resources={VOLUNTEER_RESOURCE: float(nthreads)}, local_directory=local_directory,
                blocked_handlers=list(BLOCKED_HANDLERS), preload=[], preload_argv=[],
                startup_information={"goblin": lambda w: {"credential": credential.token}},
                security=security,
            )
            current[:] = [worker]
            why = None
            try:
                await worker
            except (ValueError, RuntimeError) as e:
                if hostile:
                    break
                cause = e.__cause__ if isinstance(e, RuntimeError) else e
                await worker.close()
                fatal = fatal_connect_error(address, cause)
                if fatal is not None:
                    raise fatal from None
                if isinstance(cause, ValueError) and "refused" in str(cause):
                    refusal = str(cause).split("'message': ")[-1].rstrip("}").strip("'\"")
                    if not refusal_can_clear(refusal):
                        raise RefusedByNode(refusal) from None
                    why = f"it refused this volunteer for now ({refusal})"  # e.g. its previous run's registration
                else:
                    raise
            if why is None:
                logger.info("joined lab node %s as %s", address, name)
                agent.attach(worker)
                try:
                    await worker.finished()
                finally:
                    agent.detach()
                if hostile:
                    break
                if stopping:
                    return
                why = "lost the connection to the lab node"
        attempts += 1
        if max_attempts is not None and attempts >= max_attempts:
            raise ConnectionError(f"cannot reach lab node at {address}: {why} (gave up after {attempts} attempts)")
        pause = wait * random.uniform(0.5, 1.0)  # jitter: volunteers cut off together do not return together
        print(f"goblin volunteer: cannot reach lab node at {address}: {why}; retrying in {pause:.1f} s",
              file=sys.stderr, flush=True)
        await asyncio.sleep(pause)
        wait = min(wait * 2, backoff[1])
    await worker.close()
    raise FatalConnectError(f"{address}: {hostile[0]}; this volunteer dials only tls:// addresses on the lab's host "
                            f"(and those goblin.link.lab-hosts names): it left this lab", EXIT_HOSTILE_LAB)
