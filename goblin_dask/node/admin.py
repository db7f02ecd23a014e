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


def revoke(state_dir: str | os.PathLike, name: str, client=None) -> list[str] | None:
    """Revoke ``name``'s credential and disconnect it; it is refused from now on.

    The node (through ``client``, else the one running from ``state_dir``) revokes it and disconnects
    its workers: returns their addresses.  When no node runs (or it cannot be reached), the revocation
    is written to ``state_dir``, where a node reads it at each admission: returns None.
    """
    if client is None:
        try:
            client = admin_client(state_dir, timeout=10)
        except OSError:  # no node file (FileNotFoundError), or a node that does not answer
            from goblin_dask.credentials import LabKeys

            LabKeys(state_dir).revoke(name)
            return None
        with client:
            return revoke(state_dir, name, client)
    return client.sync(getattr(client.scheduler, rpc.REVOKE), name=name)["closed"]
