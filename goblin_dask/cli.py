"""The ``goblin`` command: node, enroll, revoke, volunteer, demo, researchers, info, doctor."""

from __future__ import annotations

import json
import logging
import sys

import click

from goblin_dask.cli_researchers import researchers
from goblin_dask.volunteer import volunteer_command


@click.group(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.version_option(package_name="goblin-dask", prog_name="goblin-dask", message="%(prog)s %(version)s")
def main() -> None:
    """goblin-dask: verified scientific computing on volunteers' machines."""


def _state_dir_option(f):
    from goblin_dask.node.scheduler import default_state_dir

    return click.option("--state-dir", default=str(default_state_dir()), envvar="GOBLIN_STATE_DIR",
                        help="the lab node's state directory (secret, revocations, logs)")(f)


@main.command()
@click.option("--host", default="127.0.0.1", help="address to listen on")
@click.option("--port", default=8786, type=int, help="scheduler port (0: any free port)")
@click.option("--dashboard-port", default=8787, type=int, help="dashboard and HTTP port (0: any free port)")
@click.option("--no-dashboard", is_flag=True, help="serve no dashboard and no HTTP port at all")
@click.option("--lab-worker/--no-lab-worker", default=True,
              help="also run the trusted lab worker, which holds the lab's data and checks results (default: on)")
@click.option("--lab-threads", default=2, type=int, help="task threads of the lab worker")
@click.option("--lab-memory-limit", default="auto", help='memory limit of the lab worker ("auto": the machine\'s)')
@click.option("--lab-worker-port", default=0, type=int,
              help="port volunteers reach the lab worker on (0: any free port; open it in the lab's firewall)")
@_state_dir_option
def node(host, port, dashboard_port, no_dashboard, lab_worker, lab_threads, lab_memory_limit, lab_worker_port,
         state_dir):
    """Run a lab node (scheduler with the goblin plugins, and its lab worker) in the foreground."""
    from goblin_dask.errors import PortInUseError
    from goblin_dask.node.process import run_async
    from goblin_dask.node.scheduler import LabWorkerOptions, StateDirInUse, lab_page, serve_node

    logging.basicConfig(level=logging.INFO, format="%(asctime)s goblin node %(levelname)s %(message)s")

    def ready(info):
        click.echo(f"goblin lab node at {info['address']}")
        if info["dashboard_link"]:
            click.echo(f"lab page: {lab_page(info['dashboard_link'])}  (the admin's dashboard: {info['dashboard_link']})")
        click.echo("volunteers join with:")
        click.echo(f"  goblin enroll --state-dir {state_dir}    # writes a credential file, NAME.credential")
        click.echo(f"  goblin volunteer {info['address']} --token NAME.credential")
        click.echo("researchers connect with:")
        click.echo(f"  goblin researchers issue NAME --state-dir {state_dir}    # prints a credential file's path")
        click.echo(f"  goblin_dask.connect({info['address']!r}, credential=PATH)")
        sys.stdout.flush()

    options = LabWorkerOptions(lab_threads, lab_memory_limit, lab_worker_port) if lab_worker else None
    try:
        run_async(serve_node(host, port, None if no_dashboard else dashboard_port, state_dir, ready=ready,
                             lab_worker=options))
    except StateDirInUse as e:
        raise click.ClickException(str(e)) from None
    except PortInUseError as e:
        click.echo(f"goblin node: {e}", err=True)
        sys.exit(e.exit_code)


@main.command("lab-worker", hidden=True)
@click.argument("address")
@click.option("--credential", required=True)
@click.option("--nthreads", default=2, type=int)
@click.option("--memory-limit", default="auto")
@click.option("--host", default=None)
@click.option("--port", default=0, type=int,
              help="port volunteers reach it on (their standby connections; open it in the lab's firewall)")
def lab_worker(address, credential, nthreads, memory_limit, host, port):
    """Run the trusted lab worker (started by the lab node)."""
    from goblin_dask.node.lab_worker import serve_lab_worker
    from goblin_dask.node.process import run_async

    logging.basicConfig(level=logging.INFO, format="%(asctime)s goblin lab-worker %(levelname)s %(message)s")
    run_async(serve_lab_worker(address, credential, nthreads=nthreads, memory_limit=memory_limit, host=host,
                               port=port))


@main.command()
@click.option("--name", default=None, help="name to issue the credential for (default: a new one)")
@click.option("--out", "out", default=None, metavar="FILE",
              help="where to write the credential (mode 0600; default: ./NAME.credential; -: print it on stdout)")
@click.option("--person", default=None, metavar="WHO",
              help="who holds it (default: NAME): one person's credentials share one exposure cap, and a replica "
                   "never runs on the person whose result it checks; give each GPU's credential its owner's name")
@_state_dir_option
def enroll(name, out, person, state_dir):
    """Write a volunteer credential file for the lab node of STATE_DIR.

    The volunteer joins with `goblin volunteer ADDRESS --token FILE`: a credential travels as a private file
    (or in the environment, GOBLIN_TOKEN), never on a command line, where every local user can read it.
    """
    import os
    from pathlib import Path

    from goblin_dask.credentials import CredentialError, issue_credential, require_lab
    from goblin_dask.node.scheduler import read_node_file

    try:
        require_lab(state_dir)
        credential = issue_credential(state_dir, "volunteer", name, person)
    except (CredentialError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    if out == "-":
        click.echo(credential.encode())
        target = "FILE"
    else:
        path = Path(out or f"{credential.name}.credential")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise click.ClickException(f"{path} exists: give another --out (nothing was overwritten)") from None
        with os.fdopen(fd, "w") as f:
            f.write(credential.encode() + "\n")
        click.echo(str(path))
        target = str(path)
    try:
        address = read_node_file(state_dir)["address"]
    except FileNotFoundError:
        address = "ADDRESS"
        click.echo("(no lab node is running from this state directory right now)", err=True)
    click.echo(f"give {target} to volunteer {credential.name} (keep it private: mode 0600); "
               f"they join with: goblin volunteer {address} --token {target}", err=True)


@main.command()
@click.argument("name")
@_state_dir_option
def revoke(name, state_dir):
    """Revoke NAME's credential (a volunteer's or a researcher's) and disconnect it."""
    from goblin_dask.credentials import CredentialError, require_lab
    from goblin_dask.node.admin import NodeUnreachable
    from goblin_dask.node.admin import revoke as revoke_credential

    try:
        require_lab(state_dir)
        closed = revoke_credential(state_dir, name)
    except (CredentialError, NodeUnreachable) as e:
        raise click.ClickException(str(e)) from None
    if closed is None:
        click.echo(f"revoked {name}: no lab node runs from {state_dir}, so none to disconnect it from "
                   f"(a node started from it refuses {name})")
    else:
        click.echo(f"revoked {name}; disconnected {len(closed)} worker(s) or client(s)")


@main.command()
@click.option("--n", "n", default=2048, type=int, help="matrix size (n x n)")
@click.option("--chunk", default=None, type=int, help="block size (default: from the volunteers' memory)")
@click.option("--volunteers", default=2, type=int)
@click.option("--dtype", default="float64", type=click.Choice(["float64", "float32"]))
@click.option("--json-report", is_flag=True, help="print the report as JSON only")
def demo(n, chunk, volunteers, dtype, json_report):
    """Start a local grid and compute a verified chunked matrix product on it."""
    from goblin_dask.demo import run_demo

    result = run_demo(n=n, chunk=chunk, volunteers=volunteers, dtype=dtype, echo=None if json_report else click.echo)
    if json_report:
        click.echo(json.dumps(result, indent=2, default=str))
    if not result["matches_numpy"]:
        sys.exit(1)


def _versions() -> dict[str, str]:
    """goblin-dask's version and its stack's (optional ones only when installed; none is imported)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for dist in ("goblin-dask", "dask", "distributed", "numpy", "numba", "xarray"):
        out[dist] = version(dist)
    for dist in ("torch", "cupy-cuda12x", "cupy-cuda11x", "cupy"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return out


@main.command()
def info():
    """Print the versions of goblin-dask and what it runs on, and the effective goblin.* settings."""
    from goblin_dask.settings import effective_settings

    for name, version in _versions().items():
        click.echo(f"{name:<14} {version}")
    click.echo("settings (goblin.yaml defaults, overridden by dask config files and DASK_GOBLIN__* variables):")
    for key, value in effective_settings().items():
        click.echo(f"  {key}: {json.dumps(value)}")


@main.command()
@click.argument("address")
@click.option("--credential", required=True, envvar="GOBLIN_CREDENTIAL",
              help="the credential file (a researcher's, or a volunteer's from `goblin enroll`)")
@click.option("--timeout", default=10.0, type=float, help="seconds to wait for each answer")
def doctor(address, credential, timeout):
    """Check a setup end to end: the node answers, TLS, the credential's role, the lab worker's port, a task.

    One line per step, what passed or what to fix; the exit code is the failed step's (0: all passed).
    """
    from goblin_dask.doctor import diagnose

    for step in diagnose(address, credential, timeout):
        click.echo(str(step))
        if not step.ok:
            sys.exit(step.exit_code)


main.add_command(volunteer_command)
main.add_command(researchers)

if __name__ == "__main__":
    main()
