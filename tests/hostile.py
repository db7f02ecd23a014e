"""Hostile volunteers: goblin volunteers that lie on their worker stream, or return results of the wrong form.

Run as ``python -m tests.hostile --attack KIND [--target KEY] [--lab ADDRESS] [--victim ADDRESS]
[--trigger PATH] ADDRESS --token ...`` (``LabNode.add_volunteer(module="tests.hostile",
extra_args=...)``), like :mod:`tests.cheaters`: everything else is the real volunteer agent,
which joins over TLS with its credential and computes honestly until the attack.

Stream attacks (sent through the volunteer's own batched stream, once PATH exists, or at once
without ``--trigger``):

* ``add-keys-steal``: puts a number of its own under KEY, announces it holds KEY
  (``add-keys``), then releases KEY on behalf of the lab worker (``release-worker-data`` naming
  ADDRESS): on a plain scheduler it becomes KEY's only holder and the researcher reads its number;
* ``forge-verdict``: ``task-finished`` messages for the lab task KEY naming the lab worker, with
  ``goblin-verdicts`` metadata rejecting two results of the volunteer at ``--victim`` (the
  run id is unknown, so it sprays them: each wrong guess makes the scheduler rerun KEY with
  the next run id, two guesses on it catches up);
* ``pause-lab-worker``: ``worker-status-change`` to ``paused`` naming the lab worker;
* ``refresh-flood``: ``request-refresh-who-has`` messages naming 2,000 keys of 100 characters each, 40 of
  them at once (nothing but its call budget bounds how many a volunteer sends);
* ``foreign-task-finished``: puts a number of its own under KEY and sprays ``task-finished``
  for KEY (a task it was never given): on a plain scheduler it becomes one of KEY's holders.

Task attack ``bounce``: every ``compute-task`` is answered with ``reschedule`` (distributed's "run it
elsewhere") at once, nothing computed; on a plain scheduler the same idle-looking volunteer gets it again.
Task attack ``hold``: the first ``--keep`` (4) tasks it is given are never started; of the others, the
newest is computed honestly every ``--every`` seconds (so it keeps finishing something while it holds).

Task kind ``late-report`` (not an attack: an honest volunteer on a slow link): it computes every task honestly
and sends each ``task-finished`` ``--every`` seconds late (logging ``late-report: task-finished of KEY sent``), so
with a shorter deadline the lab has taken the task back by the time the report arrives.

Kind ``large-hello`` (not an attack: an honest volunteer whose worker plugins describe a large environment): its
``register-worker`` carries ``--hello-bytes`` bytes of startup information (``extra``), so the scheduler reads that
much of it at once, beyond the burst of ``goblin.link.scheduler-read-rate``; it then computes honestly.

Registration attack ``large-versions``: its ``register-worker`` carries ``--hello-bytes`` bytes of ``versions``
(package names, about 64 bytes each), which distributed compares with every worker's at every join (issue 29:
16 MiB stalled the scheduler's loop 4.66 s); the lab refuses it before, and the agent exits with the reason.

Claim attack ``claim``: registers with a memory limit of ``--claim-memory`` bytes, whatever its machine has
(distributed clips a real limit to the machine's memory), beside its ``--nthreads``; it computes honestly,
and logs ``hostile: held N tasks at once`` each time it holds more tasks (given, not yet finished) than ever.

Result attacks (every task it computes): ``result-list`` (a list), ``result-scalar`` (a Python
float), ``result-shape`` (the result transposed or flattened), ``result-dtype`` (float32 instead
of float64, or float64 instead of anything else).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys

import numpy as np

STREAM_ATTACKS = ("add-keys-steal", "forge-verdict", "pause-lab-worker", "foreign-task-finished", "refresh-flood")
#: ``refresh-flood``: this many ``request-refresh-who-has`` messages, each of FLOOD_KEYS keys of 100 characters.
FLOOD_MESSAGES, FLOOD_KEYS = 40, 2_000
RESULT_ATTACKS = ("result-list", "result-scalar", "result-shape", "result-dtype")
TASK_ATTACKS = ("bounce", "hold", "late-report")
CLAIM_ATTACKS = ("claim",)
HELLO_ATTACKS = ("large-versions",)
HONEST_KINDS = ("large-hello",)
#: A worker's states of a task it was given to compute and has not finished.
HELD_STATES = frozenset({"waiting", "ready", "constrained", "executing", "long-running"})
#: The number a stealing volunteer puts under the key.
FAKE = -12345.0
SPRAY = 4000

logger = logging.getLogger("tests.hostile")


def parse(argv: list[str]) -> tuple[dict, list[str]]:
    from tests.agent_options import take_options

    opts, rest = take_options(argv, {"attack": None, "target": None, "lab": None, "victim": None, "trigger": None,
                                     "keep": "4", "every": "1.0", "claim-memory": None, "hello-bytes": "0"})
    kinds = STREAM_ATTACKS + RESULT_ATTACKS + TASK_ATTACKS + CLAIM_ATTACKS + HELLO_ATTACKS + HONEST_KINDS
    if opts["attack"] not in kinds:
        raise SystemExit(f"tests.hostile: --attack must be one of {kinds}")
    return opts, rest


def wrong_result(kind: str, out):
    if kind == "result-list":
        return np.asarray(out).tolist()
    if kind == "result-scalar":
        return float(np.asarray(out).ravel()[0]) if np.size(out) else 0.0
    if kind == "result-shape":
        out = np.asarray(out)
        return np.ascontiguousarray(out.T) if out.ndim == 2 and out.shape[0] != out.shape[1] else out.reshape(-1)[:-1]
    if kind == "result-dtype":
        out = np.asarray(out)
        return out.astype(np.float32 if out.dtype == np.float64 else np.float64)
    raise ValueError(kind)


def stream_messages(worker, opts: dict) -> list[dict]:
    """The forged messages of a stream attack."""
    kind, key, lab = opts["attack"], opts["target"], opts["lab"]
    if kind == "add-keys-steal":
        worker.data[key] = np.float64(FAKE)
        return [{"op": "add-keys", "keys": [key], "stimulus_id": "hostile-add"},
                {"op": "release-worker-data", "key": key, "worker": lab, "stimulus_id": "hostile-release"}]
    if kind == "pause-lab-worker":
        return [{"op": "worker-status-change", "status": "paused", "worker": lab, "stimulus_id": "hostile-pause"}]
    if kind == "forge-verdict":
        verdicts = [[f"unverified-matmul-forged-{i}", "freivalds", False, opts["victim"]] for i in range(2)]
        metadata = {"goblin-verdicts": {"seconds": 0.0, "cpu_seconds": 0.0, "verdicts": verdicts}}
        return [{"op": "task-finished", "key": key, "run_id": 2 * i, "worker": lab, "nbytes": 8, "type": None,
                 "typename": "float", "metadata": metadata, "thread": None, "startstops": [],
                 "stimulus_id": f"hostile-forge-{i}"} for i in range(SPRAY)]
    if kind == "refresh-flood":
        keys = [f"{i:0100d}" for i in range(FLOOD_KEYS)]
        return [{"op": "request-refresh-who-has", "keys": keys, "stimulus_id": f"hostile-refresh-{i}"}
                for i in range(FLOOD_MESSAGES)]
    if kind == "foreign-task-finished":
        worker.data[key] = np.float64(FAKE)
        return [{"op": "task-finished", "key": key, "run_id": i, "nbytes": 8, "type": None, "typename": "float64",
                 "metadata": {}, "thread": None, "startstops": [], "stimulus_id": f"hostile-finished-{i}"}
                for i in range(SPRAY)]
    raise ValueError(kind)


def main(argv: list[str]) -> None:
    opts, rest = parse(argv)
    kind = opts["attack"]
    if kind in RESULT_ATTACKS:
        from goblin_dask.ops.spec import OpSpec

        honest_call = OpSpec.__call__

        def hostile_call(self, *args, **params):
            return wrong_result(kind, honest_call(self, *args, **params))

        OpSpec.__call__ = hostile_call
    elif kind == "large-hello":
        from distributed.worker import Worker

        size, startup_information = int(opts["hello-bytes"]), Worker.get_startup_information

        async def large_startup_information(self):
            info = await startup_information(self)
            # about 64 bytes of msgpack each: what a worker plugin describing a large environment might send
            info["environment"] = [f"goblin-test-package-{i:012d}=={i:024d}" for i in range(size // 64 + 1)]
            logger.warning("large-hello: register-worker carries %d bytes of startup information", size)
            return info

        Worker.get_startup_information = large_startup_information
    elif kind == "large-versions":
        import distributed.worker

        size, honest_versions = int(opts["hello-bytes"]), distributed.worker.get_versions

        def large_versions():
            versions = honest_versions()
            versions["packages"].update({f"goblin-test-package-{i:012d}": f"{i:024d}" for i in range(size // 64 + 1)})
            logger.warning("large-versions: register-worker carries %d bytes of versions", size)
            return versions

        distributed.worker.get_versions = large_versions  # what Worker._register_with_scheduler sends
    elif kind in CLAIM_ATTACKS:
        from goblin_dask.volunteer import worker  # where the agent looks its worker class up

        honest_class, claim = worker.volunteer_worker_class, int(opts["claim-memory"])

        def claiming_class():
            class ClaimingWorker(honest_class()):
                def __init__(self, *args, **kwargs):
                    super().__init__(*args, **kwargs)
                    self.memory_manager.memory_limit = claim  # what register-worker tells the lab
                    self.hostile_most_held = 0

                def handle_stimulus(self, *stims):
                    super().handle_stimulus(*stims)
                    held = sum(1 for ts in self.state.tasks.values() if ts.state in HELD_STATES)
                    if held > self.hostile_most_held:
                        self.hostile_most_held = held
                        logger.warning("hostile: held %d tasks at once", held)

            return ClaimingWorker

        worker.volunteer_worker_class = claiming_class
    elif kind in TASK_ATTACKS:
        from distributed.worker_state_machine import ComputeTaskEvent

        from goblin_dask.volunteer import worker  # where the agent looks its worker class up

        honest_class = worker.volunteer_worker_class

        def bouncing_class():
            class BouncingWorker(honest_class()):
                bounced = 0

                def handle_stimulus(self, *stims):
                    kept = []
                    for ev in stims:
                        if isinstance(ev, ComputeTaskEvent):
                            BouncingWorker.bounced += 1
                            self.batched_stream.send({"op": "reschedule", "key": ev.key,
                                                      "stimulus_id": f"hostile-bounce-{BouncingWorker.bounced}"})
                        else:
                            kept.append(ev)
                    if kept:
                        super().handle_stimulus(*kept)

            return BouncingWorker

        def holding_class():
            keep, every = int(opts["keep"]), float(opts["every"])

            class HoldingWorker(honest_class()):
                def handle_stimulus(self, *stims):
                    if not hasattr(self, "hostile_stash"):
                        self.hostile_held, self.hostile_stash = [], []
                        self.loop.add_callback(self.hostile_release)
                    kept = []
                    for ev in stims:
                        if not isinstance(ev, ComputeTaskEvent):
                            kept.append(ev)
                        elif len(self.hostile_held) < keep:
                            self.hostile_held.append(ev)  # never started
                        else:
                            self.hostile_stash.append(ev)
                    if kept:
                        super().handle_stimulus(*kept)

                async def hostile_release(self):
                    while True:
                        await asyncio.sleep(every)
                        if self.hostile_stash:  # one finished now and then: it looks busy
                            super().handle_stimulus(self.hostile_stash.pop())

            return HoldingWorker

        def late_class():
            delay = float(opts["every"])

            class LateWorker(honest_class()):
                def batched_send(self, msg):
                    if msg.get("op") != "task-finished":
                        return super().batched_send(msg)
                    self.loop.call_later(delay, self.late_send, msg)

                def late_send(self, msg):
                    super().batched_send(msg)
                    logger.warning("late-report: task-finished of %s sent", msg.get("key"))

            return LateWorker

        classes = {"bounce": bouncing_class, "hold": holding_class, "late-report": late_class}
        worker.volunteer_worker_class = classes[kind]
    else:
        from goblin_dask.volunteer import worker  # where the agent looks its worker class up

        honest_class = worker.volunteer_worker_class

        def hostile_class():
            base = honest_class()

            class HostileWorker(base):
                async def start_unsafe(self):
                    result = await super().start_unsafe()
                    self.loop.add_callback(self.attack)
                    return result

                async def attack(self):
                    while opts["trigger"] and not os.path.exists(opts["trigger"]):
                        await asyncio.sleep(0.05)
                    msgs = stream_messages(self, opts)
                    logger.warning("hostile: sending %d forged '%s' message(s)", len(msgs), msgs[0]["op"])
                    self.batched_stream.send(*msgs)  # its own stream, bypassing VolunteerWorker.batched_send

            return HostileWorker

        worker.volunteer_worker_class = hostile_class
    from goblin_dask.volunteer import main as volunteer_main

    volunteer_main(rest)


if __name__ == "__main__":
    main(sys.argv[1:])
