"""The volunteer agent: a ``dask worker`` that runs catalog operations and nothing else.

It holds that line by itself, whatever the lab node sends (see README, "What a
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
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import click
import dask

logger = logging.getLogger("goblin_dask.volunteer")

#: Worker RPC handlers a volunteer refuses, and why (listed in README.md).
BLOCKED_HANDLERS = {
    "run": "runs a pickled function (client.run)",
    "run_coroutine": "runs a pickled coroutine",
    "plugin-add": "installs a pickled worker plugin",
    "plugin-remove": "removes worker plugins",
    "upload_file": "writes a file onto sys.path and imports it",
    "actor_execute": "calls a method of an actor object",
    "actor_attribute": "reads an attribute of an actor object",
    "update_data": "pushes arbitrary objects into the worker's memory",
    "gather": "makes the worker fetch arbitrary keys from arbitrary peers",
    "connection_stream": "opens a stream that accepts compute-task from any peer",
    "dump_state": "leaks the worker's state",
    "get_story": "leaks the worker's task history",
    "keys": "leaks the worker's keys",
    "get_logs": "leaks the machine's logs",
    "call_stack": "leaks the running call stacks",
    "profile": "leaks profiling data",
    "profile_metadata": "leaks profiling data",
    "get_monitor_info": "leaks the machine's monitor data",
    "benchmark_disk": "burns the volunteer's disk",
    "benchmark_memory": "burns the volunteer's memory",
    "benchmark_network": "burns the volunteer's network",
}

DEFAULT_BACKOFF = (1.0, 30.0)  # first and longest wait between connection attempts


class RefusedByNode(RuntimeError):
    """The lab node refused this volunteer (bad, revoked or banned credential)."""


def _volunteer_worker_class():
    from distributed import Worker
    from distributed.worker_state_machine import ExecuteFailureEvent

    from goblin_dask.ops import task_violation

    class VolunteerWorker(Worker):
        """A distributed Worker that refuses everything but catalog operations.

        It also speaks to the lab only as the lab accepts (README, "What the lab accepts
        from a volunteer"): it never announces the inputs it fetched (``add-keys``: a
        volunteer is no source of lab data; it frees them itself once its tasks used
        them), and its errors travel as text, never as pickled exceptions.
        """

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.goblin_fetched: set = set()

        async def listen(self, port_or_addr=None, allow_offload=True, **kwargs):
            # the nat listener opens no socket: it dials the lab node with the worker's own credential
            await super().listen(port_or_addr, allow_offload=allow_offload, goblin_lab=self.scheduler.address,
                                 goblin_dial=self.connection_args, **kwargs)

        def start_http_server(self, *args, **kwargs):
            """No HTTP port on a volunteer (its /metrics, /health and /sitemap.json stay private)."""

        def batched_send(self, msg):
            op = msg.get("op")
            if op == "add-keys":
                self.goblin_fetched.update(msg.get("keys") or ())
                return
            if op == "release-worker-data" and msg.get("key") in self.goblin_fetched:
                self.goblin_fetched.discard(msg["key"])  # the scheduler never knew this volunteer held it
                return
            if op == "task-erred":
                msg = {**msg, "exception": None, "traceback": None}
            super().batched_send(msg)
            if op in ("task-finished", "task-erred", "reschedule") and self.goblin_fetched:
                self.loop.add_callback(self.free_used_inputs)

        def free_used_inputs(self):
            """Free fetched inputs that no task of this volunteer still needs."""
            from distributed.worker_state_machine import FreeKeysEvent

            busy = ("waiting", "ready", "constrained", "executing", "long-running", "resumed", "cancelled")
            done = []
            for key in list(self.goblin_fetched):
                ts = self.state.tasks.get(key)
                if ts is None:
                    self.goblin_fetched.discard(key)
                elif ts.state == "memory" and not any(d.state in busy for d in ts.dependents):
                    done.append(key)
            if done:  # their release-worker-data messages are dropped above
                self.handle_stimulus(FreeKeysEvent(keys=done, stimulus_id=f"goblin-used-inputs-{time.time()}"))

        async def plugin_add(self, plugin=None, name=None, catch_errors=True):
            logger.warning("refused worker plugin %r: volunteers install no plugins", name)
            return {"status": "error", "exception": None, "traceback": None,
                    "exception_text": "volunteers refuse worker plugins", "traceback_text": ""}

        async def execute(self, key, *, stimulus_id):
            ts = self.state.tasks.get(key)
            why = task_violation(ts.run_spec, where=f"task {key!r}") if ts is not None else None
            if why is not None:
                logger.warning("refused %s", why)
                return ExecuteFailureEvent.from_exception(
                    PermissionError(f"volunteer refused {why}"),
                    key=key,
                    run_id=ts.run_id,
                    stimulus_id=f"goblin-refused-{time.time()}",
                )
            return await super().execute(key, stimulus_id=stimulus_id)

    return VolunteerWorker


def prepare_process(gpu: bool | None) -> str:
    """Harden and warm up this process; returns the kernel backend chosen.

    BLAS and numba run one thread per task thread, as in a ``dask worker`` under its
    nanny (``OMP/OPENBLAS/MKL_NUM_THREADS=1``): ``--nthreads`` is what the volunteer
    lends, and a multi-threaded BLAS under every task thread would oversubscribe it.
    """
    import numpy  # noqa: F401  (loads its BLAS, so that the limit reaches it)
    import threadpoolctl

    from goblin_dask import safe_pickle

    # numba's cache holds only kernels compiled from this package; private and kept across runs
    # (set before numba is imported: it reads NUMBA_CACHE_DIR then)
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "goblin-dask" / "numba"
    cache.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.environ.setdefault("NUMBA_CACHE_DIR", str(cache))
    import numba

    numba.set_num_threads(1)
    threadpoolctl.threadpool_limits(limits=1)  # BLAS and OpenMP; stays for the process (not a context)
    safe_pickle.install()
    text_errors()
    from goblin_dask import ops

    backend = "cpu"
    if gpu is not False:
        try:
            import cupy

            cupy.cuda.runtime.getDeviceCount()
            backend = "gpu"
        except Exception as e:  # no cupy or no device
            if gpu:
                raise click.UsageError(f"--gpu asked, but no usable GPU: {e}") from e
    ops.set_backend(backend)
    compiled = ops.warm_up()
    logger.info("catalog ready: %d ops, %d numba kernels compiled, backend %s", len(ops.catalog()), compiled, backend)
    return backend


def text_errors() -> None:
    """Errors this volunteer reports travel as text (the lab reads no exception object of a volunteer)."""
    import distributed.core as core
    import distributed.worker as worker
    import distributed.worker_state_machine as wsm

    pickled = core.error_message

    def error_message(e, status="error"):
        msg = pickled(e, status=status)
        return {**msg, "exception": str(msg.get("exception_text") or type(e).__name__), "traceback": None}

    core.error_message = worker.error_message = wsm.error_message = error_message


async def _reachable(address: str, connection_args: dict, timeout: float) -> str | None:
    """None when the node answers, else why not."""
    from distributed.comm import connect

    try:
        comm = await connect(address, timeout=timeout, **connection_args)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    await comm.close()
    return None


async def run_volunteer(address: str, credential, *, nthreads: int = 1, memory_limit="auto",
                        local_directory: str | None = None, backoff=DEFAULT_BACKOFF,
                        max_attempts: int | None = None) -> None:
    """Join the lab node at ``address`` and compute until it closes; reconnect with backoff.

    ``credential`` is a :class:`goblin_dask.tls.Credential` (or its encoded string).
    """
    from goblin_dask.node.process import close_on_signals, no_spilling
    from goblin_dask.roles import VOLUNTEER_RESOURCE

    from goblin_dask import link

    link.install_volunteer_side()
    VolunteerWorker = _volunteer_worker_class()
    no_spilling()  # the lab's numbers never reach the volunteer's disk
    # No sampling profiler on a lent machine: every task is a catalog kernel (nothing to learn
    # from its stacks) and sampling busy threads every 10 ms costs the lender's CPU.
    dask.config.set({"distributed.worker.profile.enabled": False})
    # The lab reads no compressed frames from a volunteer (README, "What the lab accepts").
    dask.config.set({"distributed.comm.compression": False})

    from goblin_dask.tls import Credential

    if not isinstance(credential, Credential):
        credential = Credential.load(credential)
    name = credential.name
    security = credential.security()
    connection_args = security.get_connection_args("worker")
    wait, attempts = backoff[0], 0
    while True:
        why = await _reachable(address, connection_args, timeout=max(wait, 3.0))
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
            try:
                await worker
            except (ValueError, RuntimeError) as e:
                cause = e.__cause__ if isinstance(e, RuntimeError) else e
                await worker.close()
                if isinstance(cause, ValueError) and "refused" in str(cause):
                    raise RefusedByNode(str(cause).split("'message': ")[-1].rstrip("}").strip("'\"")) from None
                raise
            logger.info("joined lab node %s as %s", address, name)
            stopping = []
            close_on_signals(worker, on_close=lambda: stopping.append(True))
            await worker.finished()
            if stopping:
                return
            why = "lost the connection to the lab node"
        attempts += 1
        if max_attempts is not None and attempts >= max_attempts:
            raise ConnectionError(f"cannot reach lab node at {address}: {why} (gave up after {attempts} attempts)")
        print(f"goblin volunteer: cannot reach lab node at {address}: {why}; retrying in {wait:.0f} s", file=sys.stderr, flush=True)
        await asyncio.sleep(wait)
        wait = min(wait * 2, backoff[1])


@click.command("volunteer", context_settings={"show_default": True})
@click.argument("address")
@click.option("--token", "token", required=True, envvar="GOBLIN_TOKEN",
              help="credential from `goblin enroll` (the string, or a file holding it)")
@click.option("--name", default=None, help="the name the credential was issued for (checked)")
@click.option("--nthreads", default=1, type=int, help="threads that compute catalog operations")
@click.option("--memory-limit", default="auto", help="memory this volunteer lends, e.g. 4GB")
@click.option("--gpu/--no-gpu", default=None, help="use cupy kernels on a GPU (default: when one is usable)")
@click.option("--local-directory", default=None, help="scratch directory (default: a private temporary one)")
@click.option("--host", default=None, hidden=True,
              help="ignored: a volunteer opens no listening socket (its link to the lab is outbound only)")
@click.option("--max-attempts", default=None, type=int, help="give up after this many failed connection attempts")
def volunteer_command(address, token, name, nthreads, memory_limit, gpu, local_directory, host, max_attempts):
    """Lend this machine to a lab node: compute its catalog operations, nothing else."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s goblin volunteer %(levelname)s %(message)s")
    from goblin_dask.tls import Credential

    try:
        credential = Credential.load(token)
    except (ValueError, OSError) as e:
        raise click.BadParameter(f"{e} (ask the lab for `goblin enroll`)", param_hint="--token") from None
    if name is not None and name != credential.name:
        raise click.BadParameter(f"this credential was issued for {credential.name!r}, not {name!r}", param_hint="--name")
    scratch = None if local_directory else tempfile.mkdtemp(prefix="goblin-volunteer-")
    local_directory = local_directory or scratch
    prepare_process(gpu)
    try:
        asyncio.run(run_volunteer(address, credential, nthreads=nthreads, memory_limit=memory_limit,
                                  local_directory=local_directory, max_attempts=max_attempts))
    except RefusedByNode as e:
        click.echo(f"goblin volunteer: the lab node refused this volunteer: {e}", err=True)
        sys.exit(2)
    except ConnectionError as e:
        click.echo(f"goblin volunteer: {e}", err=True)
        sys.exit(3)
    except KeyboardInterrupt:
        pass
    finally:
        if scratch is not None:  # what the lab sent leaves nothing behind on this disk
            shutil.rmtree(scratch, ignore_errors=True)


def main(argv: list[str]) -> None:
    """Do exactly what ``goblin volunteer ARGV...`` does (blocking)."""
    volunteer_command.main(args=list(argv), prog_name="goblin volunteer", standalone_mode=True)


if __name__ == "__main__":
    main(sys.argv[1:])
