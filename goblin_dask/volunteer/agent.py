"""The agent: one ``goblin volunteer`` across its reconnections, its pause and its status line.

The worker of the moment comes and goes with the link to the lab; what the volunteer sees (tasks
done, credit, pause by the user or by a busy machine) belongs to the agent and outlives it.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time

from goblin_dask.volunteer.gpus import gpu_limits

logger = logging.getLogger(__name__)


def format_flops(x: float) -> str:
    """``2.5e9`` -> ``"2.5 GFLOP"``: credit as the status line, the page and ``goblin volunteer status`` show it."""
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.0f} FLOP"


class Agent:
    """One ``goblin volunteer``: its limits, its worker of the moment, pause, and its record at the lab."""

    def __init__(self, name: str, address: str, *, nthreads: int, memory_limit, backend: str = "cpu"):
        self.name, self.address = name, address
        self.nthreads, self.memory_limit, self.backend = nthreads, memory_limit, backend
        self.worker = None  # the VolunteerWorker while joined
        #: why it takes no new tasks: "you" (goblin volunteer pause), "busy" (--only-when-idle)
        self.paused_by: set[str] = set()
        self.done_before = 0  # tasks finished by earlier workers of this agent (before a reconnection)
        #: its own record at the lab (goblin_volunteer_status): credit, accepted, rejected, trust
        self.lab: dict = {}
        self.started = time.time()

    @property
    def paused(self) -> bool:
        return bool(self.paused_by)

    def attach(self, worker) -> None:
        self.worker = worker
        if self.paused:
            worker.goblin_pause()

    def detach(self) -> None:
        if self.worker is not None:
            self.done_before += self.worker.goblin_done
        self.worker = None

    def pause(self, why: str = "you") -> int:
        was = self.paused
        self.paused_by.add(why)
        back = self.worker.goblin_pause() if self.worker is not None and not was else 0
        if not was:
            logger.info("paused (%s): no new tasks (%d not started went back to the lab)", _WHY[why], back)
        return back

    def resume(self, why: str = "you") -> None:
        self.paused_by.discard(why)
        if self.paused:
            logger.info("still paused: %s", ", ".join(_WHY[w] for w in sorted(self.paused_by)))
            return
        if self.worker is not None:
            self.worker.goblin_resume()
        logger.info("resumed")

    def status(self) -> dict:
        w = self.worker
        memory = getattr(getattr(w, "memory_manager", None), "memory_limit", None) if w is not None else None
        state = ("paused" + ("" if self.paused_by == {"you"} else f" ({', '.join(_WHY[r] for r in sorted(self.paused_by))})")
                 if self.paused else ("computing" if w is not None else "connecting"))
        return {
            "name": self.name, "lab": self.address, "state": state,
            "tasks_done": self.done_before + (w.goblin_done if w is not None else 0),
            "computing": w.goblin_computing() if w is not None else [],
            "credit_flops": float(self.lab.get("credit", 0.0)),
            "accepted": int(self.lab.get("accepted", 0)), "rejected": int(self.lab.get("rejected", 0)),
            "trust": int(self.lab.get("trust", 0)),
            "limits": {"threads": self.nthreads, "memory": memory or self.memory_limit, "backend": self.backend,
                       "gpu": gpu_limits() if self.backend == "gpu" else None},
            "uptime": time.time() - self.started,
            # the panels it keeps for later tasks (goblin_dask.volunteer.panel_cache): hits, bytes, limit, fetched_bytes
            "cache": w.goblin_cache.stats() if w is not None and hasattr(w, "goblin_cache") else {},
        }

    def line(self) -> str:
        st = self.status()
        now = ", ".join(st["computing"]) or "-"
        return (f"goblin volunteer {self.name}: {st['state']} | {st['tasks_done']} tasks done | verified "
                f"{st['accepted']} ({st['rejected']} rejected) | credit {format_flops(st['credit_flops'])} | "
                f"trust {st['trust']} | now: {now}")

    async def refresh(self) -> None:
        """Ask the lab for this volunteer's record (the lab computes credit; the volunteer only shows it)."""
        from goblin_dask.node import rpc

        from distributed.core import Status

        w = self.worker
        if w is None or w.status not in (Status.running, Status.paused):
            return
        try:
            record = await getattr(w.scheduler, rpc.VOLUNTEER_STATUS)()
        except Exception as e:  # the lab is away or busy: keep the last record
            logger.debug("no status from the lab: %s", e)
            return
        if isinstance(record, dict):
            self.lab = record


_WHY = {"you": "by you", "busy": "the machine is busy"}


async def pause_when_busy(agent: Agent, threshold: float, interval: float = 5.0) -> None:
    """``--only-when-idle``: pause while the machine's other processes use ``threshold`` percent of its CPU
    or more (this agent's own use not counted), resume when they use less."""
    import psutil

    me, ncpu = psutil.Process(), psutil.cpu_count() or 1
    psutil.cpu_percent(interval=None)
    me.cpu_percent(interval=None)
    while True:
        await asyncio.sleep(interval)
        others = max(0.0, psutil.cpu_percent(interval=None) - me.cpu_percent(interval=None) / ncpu)
        if others >= threshold and "busy" not in agent.paused_by:
            logger.info("the machine is busy (%.0f%% CPU used by others): pausing", others)
            agent.pause("busy")
        elif others < threshold and "busy" in agent.paused_by:
            logger.info("the machine is idle again (%.0f%% CPU used by others)", others)
            agent.resume("busy")


#: seconds between a volunteer's asks for its record at the lab (one small RPC; the lab serves many)
LAB_REFRESH = 5.0


async def report_status(agent: Agent, interval: float, out=None) -> None:
    """Keep one status line up to date: rewritten in place every ``interval`` seconds on a terminal,
    printed when it changes (at most every ``5 * interval`` seconds) otherwise."""
    out = out or sys.stdout
    tty = out.isatty()
    last, last_at, asked_at = "", 0.0, -LAB_REFRESH
    while True:
        now = time.monotonic()
        if now - asked_at >= LAB_REFRESH:
            asked_at = now
            await agent.refresh()
        line = agent.line()
        if tty:
            out.write("\r" + line[:200] + "\x1b[K")
            out.flush()
        elif line != last and now - last_at >= 5 * interval:
            print(line, file=out, flush=True)
            last, last_at = line, now
        await asyncio.sleep(interval)
