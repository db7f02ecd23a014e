"""``goblin researchers``: the lab admin's side of researcher access (issue, list, approve, refuse)."""

from __future__ import annotations

import datetime

import click


def _state_dir_option(f):
    from goblin_dask.node.scheduler import default_state_dir

    return click.option("--state-dir", default=str(default_state_dir()), envvar="GOBLIN_STATE_DIR",
                        show_default=True, help="the lab node's state directory")(f)


def _registry(state_dir):
    from goblin_dask.access.registry import ResearcherRegistry

    return ResearcherRegistry(state_dir)


def _decide(decision):
    """Run a registry decision, turning a refusal into a clean CLI error."""
    from goblin_dask.access.registry import AccessError

    try:
        return decision()
    except (AccessError, ValueError) as e:
        raise click.ClickException(str(e)) from None


@click.group()
def researchers() -> None:
    """Researcher access requests (filed on the node's /goblin/signin page)."""


def connect_hint(state_dir, path) -> str:
    """How the holder of the credential at ``path`` connects (the running node's address when there is one)."""
    from goblin_dask.node.scheduler import read_node_file

    try:
        address = read_node_file(state_dir)["address"]
    except FileNotFoundError:
        address = "tls://HOST:PORT"  # the address `goblin node` prints
    return f"goblin_dask.connect({address!r}, credential={str(path)!r})"


@researchers.command()
@click.argument("name")
@_state_dir_option
def issue(name, state_dir):
    """Issue researcher NAME's credential directly (no e-mail sign-in): prints the file's path.

    The file (mode 0600) is all the researcher needs with the node's address; hand it over privately.
    """
    from goblin_dask.access.registry import REGISTRY_DIR
    from goblin_dask.credentials import valid_name
    from pathlib import Path

    if not valid_name(name):
        raise click.BadParameter(f"{name!r}: use letters, digits, '-' and '_' only", param_hint="NAME")
    directory = Path(state_dir) / REGISTRY_DIR
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = directory / f"{name}.credential"
    from goblin_dask.credentials import revoked_names

    if name in revoked_names(state_dir):
        raise click.ClickException(f"{name!r} was revoked on this lab node (`goblin revoke {name}`): a credential "
                                   f"under that name would be refused; pick another name")
    if path.exists():
        raise click.ClickException(f"{path} exists: researcher {name!r} already has a credential "
                                   f"(hand over that file, or pick another name)")
    from goblin_dask.credentials import issue_credential

    issue_credential(state_dir, "researcher", name).save(path)
    click.echo(str(path))
    click.echo(f"hand this file to {name}; they connect with:\n"
               f"  import goblin_dask\n  client = {connect_hint(state_dir, path)}", err=True)


@researchers.command("list")
@click.option("--status", type=click.Choice(["pending", "approved", "refused"]), default=None,
              help="only requests with this status")
@_state_dir_option
def list_requests(status, state_dir):
    """List access requests, oldest first."""
    requests = _registry(state_dir).list(status)
    if not requests:
        click.echo("no access requests" + (f" with status {status}" if status else ""))
    for r in requests:
        when = datetime.datetime.fromtimestamp(r.requested_at).strftime("%Y-%m-%d %H:%M")
        click.echo(f"{r.status:<9} {r.email}  {r.name} ({r.affiliation})  requested {when}")
        click.echo(f"          purpose: {r.purpose}")
        if r.credential_path:
            click.echo(f"          credential: {r.credential_path}")


@researchers.command()
@click.argument("email")
@_state_dir_option
def approve(email, state_dir):
    """Approve EMAIL's request: issue its credential and print the file's path."""
    path = _decide(lambda: _registry(state_dir).approve(email))
    click.echo(str(path))
    click.echo(f"hand this file to {email}; they connect with {connect_hint(state_dir, path)}", err=True)


@researchers.command()
@click.argument("email")
@_state_dir_option
def refuse(email, state_dir):
    """Refuse EMAIL's pending request (nothing is issued)."""
    request = _decide(lambda: _registry(state_dir).refuse(email))
    click.echo(f"refused {request.email}")
