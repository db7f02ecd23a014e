"""Preload of a hostile lab node's scheduler in tests (``dask scheduler --preload tests.hostile_lab_preload``).

It answers a volunteer's ``goblin_link_endpoints`` with whatever the JSON file named by
``GOBLIN_TEST_ENDPOINTS`` holds when asked (the test rewrites it between volunteers): "SCHEDULER" in
it stands for the scheduler's own address.
"""

import json
import os

from goblin_dask import link
from goblin_dask.node import rpc

link.install_lab_side()  # at import: before the scheduler listens


def _expand(value, scheduler):
    if value == "SCHEDULER":
        return scheduler.address
    if isinstance(value, list):
        return [_expand(v, scheduler) for v in value]
    return value


def dask_setup(scheduler):
    def endpoints():
        with open(os.environ["GOBLIN_TEST_ENDPOINTS"]) as f:
            return _expand(json.load(f), scheduler)

    scheduler.handlers[rpc.LINK_ENDPOINTS] = endpoints
