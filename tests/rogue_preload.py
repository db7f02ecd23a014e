"""Preload of the compromised lab node in tests (``dask scheduler --preload tests.rogue_preload``).

A compromised node holds the lab's code as well as its keys: it reaches volunteers over their
standby connections (``goblin_dask.link``) like the real one, and has none of the goblin plugins.
"""

from goblin_dask import link
from goblin_dask.node import rpc

link.install_lab_side()  # at import: before the scheduler listens


def dask_setup(scheduler):
    scheduler.handlers[rpc.LINK_ENDPOINTS] = lambda: [scheduler.address]
