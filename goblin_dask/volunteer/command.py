"""``goblin volunteer``: the command line of the agent (``python -m goblin_dask.volunteer`` too).

It checks what it is given before anything starts (the scheme, the credential file and its mode,
the GPUs) and turns the agent's fatal errors into one line and a distinct exit code.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sys
import tempfile

import click

from goblin_dask import link
from goblin_dask.errors import EXIT_GAVE_UP, EXIT_REFUSED, FatalConnectError, fatal_connect_error
from goblin_dask.volunteer.agent import format_flops
from goblin_dask.volunteer.connection import RefusedByNode, run_volunteer
from goblin_dask.volunteer.gpus import (check_gpu_count, check_gpu_memory_fraction, gpu_worker_plan, parse_gpus,
                                        require_cupy, run_gpu_workers)
from goblin_dask.volunteer.process import prepare_process
from goblin_dask.volunteer.status_page import control, find_state_dir

CONTROL_ACTIONS = ("pause", "resume", "status")


def _lab_hosts(ctx, param, values) -> tuple[str, ...]:
    """``--lab-host``: each one a host as ``goblin.link.lab-hosts`` takes it, checked before anything starts."""
    try:
        return tuple(link.lab_host(v) for v in values)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


@click.command("volunteer", context_settings={"show_default": True})
@click.argument("address", metavar="ADDRESS|pause|resume|status")
@click.option("--token", "token", multiple=True, envvar="GOBLIN_TOKEN", metavar="FILE",
              help="the credential file from `goblin enroll` (mode 0600; or the credential itself in GOBLIN_TOKEN, "
                   "never on the command line); with --gpus, one per GPU")
@click.option("--name", default=None,
              help="the name the credential was issued for (checked); with pause|resume|status: which volunteer")
@click.option("--nthreads", default=1, type=int, help="threads that compute catalog operations")
@click.option("--memory-limit", default="auto", help="memory this volunteer lends, e.g. 4GB")
@click.option("--gpu/--no-gpu", default=None, help="use cupy kernels on a GPU (default: when one is usable)")
@click.option("--gpus", default=None, metavar="I,J,...",
              help="which GPUs: one worker process per GPU, each seeing only its own (CUDA_VISIBLE_DEVICES) and "
                   "joining with its own --token; needs cupy")
@click.option("--gpu-memory-fraction", default=None, type=float,
              help="share of each GPU's memory the volunteer's kernels may hold (cupy's memory pool), e.g. 0.5")
@click.option("--local-directory", default=None, help="scratch directory (default: a private temporary one)")
@click.option("--state-dir", default=None, envvar="GOBLIN_VOLUNTEER_STATE_DIR",
              help="this volunteer's directory: its control page's address and token while it runs "
                   "[default: ~/.local/state/goblin-dask/volunteers/NAME]")
@click.option("--status-port", default=0, type=int,
              help="port of the status and control page on 127.0.0.1 (0: any free one; -1: no page, no pause)")
@click.option("--only-when-idle", is_flag=True,
              help="pause while the machine's other processes keep its CPU busy (see --idle-threshold)")
@click.option("--idle-threshold", default=25.0, type=float,
              help="with --only-when-idle: percent of the CPU used by other processes that pauses it")
@click.option("--host", default=None, hidden=True,
              help="ignored: a volunteer opens no listening socket (its link to the lab is outbound only)")
@click.option("--max-attempts", default=None, type=int, help="give up after this many failed connection attempts")
@click.option("--lab-host", "lab_hosts", multiple=True, metavar="HOST", callback=_lab_hosts,
              help="a host of the lab beyond ADDRESS's that this volunteer may dial (a lab worker elsewhere): a name, "
                   "an IP address or a network such as 10.0.0.0/24, '*' for any; repeat it for several; adds to the "
                   "goblin.link.lab-hosts setting. Any other host the lab names makes the volunteer leave it")
def volunteer_command(address, token, name, nthreads, memory_limit, gpu, gpus, gpu_memory_fraction, local_directory,
                      state_dir, status_port, only_when_idle, idle_threshold, host, max_attempts, lab_hosts):
    """Lend this machine to a lab node: compute its catalog operations, nothing else.

    \b
    What runs here: only the numeric operations of goblin-dask's catalog (matmul, sums, activations...),
    on numbers the lab sends, in this process's memory, with at most --nthreads threads and --memory-limit
    (on GPUs: only those of --gpus, at most --gpu-memory-fraction of each).
    What does not: no code of the lab's (no pickled functions, plugins or files; anything else is refused),
    no writes of the lab's data to disk (no spilling; the scratch directory is removed on exit), and no
    port the network can reach (the link to the lab is outbound; the status page listens on 127.0.0.1 only).

    \b
    goblin volunteer ADDRESS --token FILE         join the lab node at ADDRESS and compute (FILE: from
                                                  `goblin enroll`, readable by you only)
    goblin volunteer ADDRESS --gpus 0,1 --token F0 --token F1   a worker per GPU, each with its credential
    goblin volunteer ADDRESS --token FILE --lab-host 10.0.0.7    it may also dial the lab's worker at 10.0.0.7
    goblin volunteer pause|resume [--name NAME]   the running volunteer takes no new tasks / takes them again
    goblin volunteer status [--name NAME]         its status: tasks done, verified work, credit, trust
    """
    if address in CONTROL_ACTIONS:
        st = control(address, find_state_dir(state_dir, name))
        click.echo(f"{st['name']}: {st['state']} | {st['tasks_done']} tasks done | verified {st['accepted']} "
                   f"({st['rejected']} rejected) | credit {format_flops(st['credit_flops'])} | trust {st['trust']}")
        return
    if not token:
        raise click.BadParameter("a credential is needed to join a lab node (ask the lab for `goblin enroll`)",
                                 param_hint="--token")
    wrong_scheme = fatal_connect_error(address, "")  # before anything starts: no attempt can succeed
    if wrong_scheme is not None:
        click.echo(f"goblin volunteer: {wrong_scheme}", err=True)
        sys.exit(wrong_scheme.exit_code)
    gpu_list = parse_gpus(gpus)
    check_gpu_memory_fraction(gpu_memory_fraction)
    if gpu_list is not None:
        if gpu is False:
            raise click.BadParameter("--gpus with --no-gpu: leave out one of them", param_hint="--gpus")
        gpu = True
        require_cupy()
        if len(gpu_list) > 1 and name is not None:
            raise click.BadParameter("with several GPUs each worker has its credential's name: leave out --name",
                                     param_hint="--name")
        plan = gpu_worker_plan(gpu_list, list(token), environ=dict(os.environ), address=address,
                               nthreads=nthreads, memory_limit=memory_limit, gpu_memory_fraction=gpu_memory_fraction,
                               state_dir=state_dir, local_directory=local_directory, status_port=status_port,
                               only_when_idle=only_when_idle, idle_threshold=idle_threshold, max_attempts=max_attempts,
                               lab_hosts=lab_hosts)
        if len(plan) > 1:  # a worker process per GPU, each with its own credential
            names = [_load_credential(t).name for t in token]
            if len(set(names)) != len(names):
                raise click.BadParameter("the same credential twice: each GPU's worker needs its own",
                                         param_hint="--token")
            check_gpu_count(gpu_list)
            sys.exit(run_gpu_workers(plan))
        os.environ["CUDA_VISIBLE_DEVICES"] = plan[0]["env"]["CUDA_VISIBLE_DEVICES"]  # before cupy starts CUDA
        check_gpu_count([0])  # the one it now sees
    if len(token) > 1:
        raise click.BadParameter(f"{len(token)} credentials for one worker (several: one per GPU of --gpus)",
                                 param_hint="--token")
    token = token[0]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s goblin volunteer %(levelname)s %(message)s")
    credential = _load_credential(token)
    if name is not None and name != credential.name:
        raise click.BadParameter(f"this credential was issued for {credential.name!r}, not {name!r}", param_hint="--name")
    link.allow_lab_hosts(lab_hosts)
    scratch = None if local_directory else tempfile.mkdtemp(prefix="goblin-volunteer-")
    local_directory = local_directory or scratch
    backend = prepare_process(gpu, gpu_memory_fraction)
    try:
        asyncio.run(run_volunteer(address, credential, nthreads=nthreads, memory_limit=memory_limit,
                                  local_directory=local_directory, max_attempts=max_attempts, state_dir=state_dir,
                                  status_port=None if status_port < 0 else status_port, backend=backend,
                                  idle_threshold=idle_threshold if only_when_idle else None))
    except RefusedByNode as e:
        click.echo(f"goblin volunteer: the lab node refused this volunteer: {e}", err=True)
        sys.exit(EXIT_REFUSED)
    except FatalConnectError as e:
        click.echo(f"goblin volunteer: {e}", err=True)
        sys.exit(e.exit_code)
    except ConnectionError as e:
        click.echo(f"goblin volunteer: {e}", err=True)
        sys.exit(EXIT_GAVE_UP)
    except KeyboardInterrupt:
        pass
    finally:
        if scratch is not None:  # what the lab sent leaves nothing behind on this disk
            shutil.rmtree(scratch, ignore_errors=True)


def _load_credential(token: str):
    """The credential of ``--token``: a file only its owner can read, or (in ``GOBLIN_TOKEN`` only) the
    credential itself; never the credential on the command line, where every local user reads it."""
    from goblin_dask.credentials import CREDENTIAL_ENV, CredentialError, read_credential_file
    from goblin_dask.tls import CREDENTIAL_PREFIX, Credential

    ctx = click.get_current_context(silent=True)
    from_env = ctx is not None and ctx.get_parameter_source("token") == click.core.ParameterSource.ENVIRONMENT
    try:
        if token.strip().startswith(CREDENTIAL_PREFIX):
            if not from_env:
                raise click.BadParameter(
                    "the credential itself on the command line can be read by every user of this machine "
                    "(/proc/PID/cmdline): save it in a file only you can read (chmod 600 FILE) and pass "
                    f"--token FILE, or put it in the environment variable {CREDENTIAL_ENV}", param_hint="--token")
            return Credential.decode(token)
        return Credential.decode(read_credential_file(token))
    except (ValueError, CredentialError) as e:
        raise click.BadParameter(f"{e} (ask the lab for `goblin enroll`)", param_hint="--token") from None


def main(argv: list[str]) -> None:
    """Do exactly what ``goblin volunteer ARGV...`` does (blocking)."""
    volunteer_command.main(args=list(argv), prog_name="goblin volunteer", standalone_mode=True)
