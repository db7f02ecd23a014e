"""``goblin researchers``: the lab admin's side of researcher access (list, approve, refuse)."""

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
    click.echo(f"hand this file to {email}; they connect with goblin_dask.connect(ADDRESS, credential=PATH)", err=True)


@researchers.command()
@click.argument("email")
@_state_dir_option
def refuse(email, state_dir):
    """Refuse EMAIL's pending request (nothing is issued)."""
    request = _decide(lambda: _registry(state_dir).refuse(email))
    click.echo(f"refused {request.email}")
