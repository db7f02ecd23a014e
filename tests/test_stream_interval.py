"""The control streams between the scheduler and its workers batch for ``goblin.link.stream-interval``.

Real ``distributed`` servers in this process (no TLS: the interval is the comm layer's business,
not the credentials'): a scheduler tuned by :class:`goblin_dask.link.StreamInterval`, the lab
worker's class and the volunteer agent's worker class.
"""

from __future__ import annotations

import asyncio

import dask
import pytest
from distributed import Scheduler

from goblin_dask import link
from goblin_dask.node.lab_worker import LabWorker
from goblin_dask.volunteer import volunteer_worker_class


@pytest.mark.parametrize("interval", [0.001, 0.0])
def test_both_ends_of_each_workers_stream_batch_for_the_setting(interval):
    async def body():
        async with Scheduler(host="127.0.0.1", port=0, dashboard_address=":0", validate=False) as s:
            s.add_plugin(link.StreamInterval())
            async with LabWorker(s.address, nthreads=1) as lab, \
                    volunteer_worker_class()(s.address, nthreads=1) as vol:
                for w in (lab, vol):
                    assert w.batched_stream.interval == interval  # worker -> scheduler
                    assert s.stream_comms[w.address].interval == interval  # scheduler -> worker
                    assert w.address in s.workers

    with dask.config.set({"goblin.link.stream-interval": interval}):
        asyncio.run(body())


@pytest.mark.parametrize("bad", [-0.001, 2.0])
def test_an_interval_out_of_range_is_refused(bad):
    with dask.config.set({"goblin.link.stream-interval": bad}), pytest.raises(ValueError, match="stream-interval"):
        link.stream_interval()
