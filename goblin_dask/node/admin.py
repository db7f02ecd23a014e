"""The lab admin's actions on a lab node: one path, whoever asks (``goblin revoke``, ``LabNode.revoke``)."""

from __future__ import annotations

import os
from typing import Any

from goblin_dask.node import rpc


def admin_client(state_dir: str | os.PathLike, address: str | None = None, **kwargs: Any):
    """A ``distributed.Client`` to the node of ``state_dir`` (its running node's, unless ``address``), as its admin."""
    from distributed import Client

    from goblin_dask.credentials import admin_credential
    from goblin_dask.node.scheduler import read_node_file

    address = address or read_node_file(state_dir)["address"]
    return Client(address, security=admin_credential(state_dir).security(), **kwargs)


class NodeUnreachable(RuntimeError):
    """A lab node runs from the state directory, but this process could not reach it."""


def revoke(state_dir: str | os.PathLike, name: str, client=None) -> list[str] | None:
    """Revoke ``name``'s credential and disconnect it; it is refused from now on.

    The node (through ``client``, else the one running from ``state_dir``) revokes it and disconnects
    its workers: returns their addresses.  When no node runs from ``state_dir`` (none holds its lock), the
    revocation is written there, where a node reads it at each admission: returns None.  When a node
    runs but cannot be reached, the revocation is written too, and NodeUnreachable says that the
    volunteer may still be connected: never a success that did not reach the node serving the credential.
    """
    if client is None:
        from goblin_dask.credentials import LabKeys
        from goblin_dask.node.scheduler import running_node

        node = running_node(state_dir)
        if node is None:
            LabKeys(state_dir).revoke(name)
            return None
        why = "its node file is missing"
        if node["address"] is not None:
            try:
                client = admin_client(state_dir, node["address"], timeout=10)
            except (OSError, TimeoutError) as e:
                why = f"it does not answer at {node['address']} ({e})"
        if client is None:
            LabKeys(state_dir).revoke(name)  # refused at its next admission, at least
            raise NodeUnreachable(
                f"{name} is revoked in {state_dir} (refused at its next admission), but the lab node that runs "
                f"from it (pid {node['pid']}) could not be reached: {why}; {name} may still be connected and "
                f"receiving the lab's data. Check that node, then run `goblin revoke {name}` again")
        with client:
            return revoke(state_dir, name, client)
    return client.sync(getattr(client.scheduler, rpc.REVOKE), name=name)["closed"]
