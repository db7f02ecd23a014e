"""``goblin doctor ADDRESS --credential F``: check a setup end to end, one line per step.

Each step says what passed, or what is wrong and what to do; a failed step ends the run, since the
steps after it need it (no TLS session: no role to check).  The exit code is the failed step's
(:mod:`goblin_dask.errors`), 0 when every step passed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass


@dataclass
class Step:
    name: str
    ok: bool
    line: str
    exit_code: int = 0

    def __str__(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'} {self.name}: {self.line}"


def diagnose(address: str, credential, timeout: float = 10.0):
    """Yield the :class:`Step` s of checking ``credential`` against the lab node at ``address``."""
    from goblin_dask.errors import EXIT_GAVE_UP, EXIT_REFUSED, EXIT_REVOKED, fatal_connect_error
    from goblin_dask.tls import CLIENT_ROLES, Credential

    try:
        cred = Credential.load(credential)
    except (OSError, ValueError) as e:
        yield Step("credential", False, f"{e}: pass the file the lab's admin gave you", EXIT_REFUSED)
        return
    role = cred.certificate_role()
    yield Step("credential", True, f"{role} credential of {cred.name!r}")

    wrong_scheme = fatal_connect_error(address, "")
    if wrong_scheme is not None:
        yield Step("address", False, str(wrong_scheme), wrong_scheme.exit_code)
        return
    seen, why = asyncio.run(_ask_node(address, cred, timeout))
    if why is not None:
        fatal = fatal_connect_error(address, why)
        if fatal is not None:
            yield Step("TLS", False, str(fatal), fatal.exit_code)
        else:
            yield Step("TLS", False, f"cannot reach {address} ({why}): is `goblin node` running there, and its "
                                     f"port open in the lab's firewall?", EXIT_GAVE_UP)
        return
    yield Step("TLS", True, f"{address} answers, and its certificate is under this credential's lab")

    info, endpoints = seen
    if info["revoked"] or (info["token"] not in (None, "ok")):
        reason = info["token"] if info["token"] not in (None, "ok") else f"credential of {info['name']!r} was revoked"
        fatal = fatal_connect_error(address, reason)
        code = fatal.exit_code if fatal is not None else EXIT_REFUSED
        yield Step("role", False, str(fatal) if fatal is not None else
                   f"the node refuses this credential ({reason}): ask the lab's admin for a new one", code)
        return
    what = "a researcher's session" if info["role"] in CLIENT_ROLES else "joining as a volunteer"
    yield Step("role", True, f"the node sees {info['role']} {info['name']!r}: good for {what}")

    lab_workers = list(endpoints[1:])  # the first is the scheduler's own
    if not lab_workers:
        yield Step("lab worker", False, "the node has no lab worker: run `goblin node` with --lab-worker (the default) "
                                        "and see STATE_DIR/logs/lab-worker.log", EXIT_GAVE_UP)
        return
    closed = [a for a, why in zip(lab_workers, asyncio.run(_reach_all(lab_workers, cred, timeout))) if why is not None]
    if closed:
        yield Step("lab worker", False, f"the lab worker's port {', '.join(closed)} cannot be reached: open it in the "
                                        f"lab's firewall (goblin node --lab-worker-port PORT fixes it)", EXIT_GAVE_UP)
        return
    yield Step("lab worker", True, f"{', '.join(lab_workers)} reachable (volunteers' standby connections go there)")

    if info["role"] not in CLIENT_ROLES:
        yield Step("task", True, "skipped: a volunteer credential submits no work (start `goblin volunteer`)")
        return
    yield _verified_task(address, cred, timeout)


async def _ask_node(address: str, cred, timeout: float):
    """((how the node sees ``cred``, the lab's endpoints), None), or (None, why the node cannot be asked)."""
    from distributed.comm import connect

    from goblin_dask.node import rpc

    args = cred.security().get_connection_args("client")
    try:
        comm = await connect(address, timeout=timeout, **args)
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"
    try:
        answers = []
        for msg in ({"op": rpc.CHECK_CREDENTIAL, "token": cred.token or None, "reply": True},
                    {"op": rpc.LINK_ENDPOINTS, "reply": True}):
            await comm.write(msg)
            answer = await asyncio.wait_for(comm.read(), timeout)
            if isinstance(answer, dict) and answer.get("status") == "uncaught-error":
                return None, str(answer.get("exception_text") or answer.get("text") or answer)
            answers.append(answer)
            if isinstance(answer, dict) and (answer.get("revoked") or answer.get("token") not in (None, "ok")):
                return (answer, []), None  # refused: the node tells it why, and nothing more
        return tuple(answers), None
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"
    finally:
        await comm.close()


async def _reach_all(addresses: list[str], cred, timeout: float) -> list[str | None]:
    from goblin_dask.volunteer.connection import reachable

    args = cred.security().get_connection_args("worker")
    return list(await asyncio.gather(*(reachable(a, args, timeout) for a in addresses)))


def _verified_task(address: str, cred, timeout: float) -> Step:
    """A 512 x 512 product through the researcher's API, against numpy: blocks of 128, so that each task
    holds 1/16 of each operand (under ``max-share``) and is worth sending to a volunteer."""
    import numpy as np

    import goblin_dask.array as ga
    from goblin_dask.node import rpc
    from goblin_dask.node.local import connect

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((512, 512)), rng.standard_normal((512, 512))
    with connect(address, credential=cred.encode(), timeout=timeout, set_as_default=False) as client:
        before = client.sync(getattr(client.scheduler, rpc.REPORT))
        got = (ga.from_array(a, chunks=128) @ ga.from_array(b, chunks=128)).compute(scheduler=client.get)
        after = client.sync(getattr(client.scheduler, rpc.REPORT))
    if not np.allclose(got, a @ b, rtol=1e-10, atol=1e-10):
        return Step("task", False, "a 512 x 512 product differs from numpy's: see the node's log", 1)
    accepted = after.get("accepted", 0) - before.get("accepted", 0)
    rejected = after.get("rejected", 0) - before.get("rejected", 0)
    where = (f"{accepted} volunteer result(s) verified, {rejected} rejected" if accepted or rejected else
             "it ran at the lab (no volunteer joined, or placement kept it there)")
    return Step("task", True, f"a 512 x 512 product matches numpy; {where}")
