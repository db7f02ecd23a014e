"""The volunteer link, attacked and used: what the lab reads from a volunteer, and volunteers behind NAT.

Every test runs a real lab node (scheduler, lab worker, volunteer processes) on 127.0.0.1
over real TLS.  The hostile peer is this test process holding nothing but a volunteer
credential from ``node.enroll()``, speaking distributed's protocol (or raw bytes) to the
scheduler's and the lab worker's ports.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import struct
import time

import numpy as np
import psutil
import pytest
from distributed.comm import connect
from distributed.comm.core import CommClosedError
from distributed.protocol.serialize import ToPickle

import goblin_dask.array as ga
from goblin_dask.node.local import LabNode
from goblin_dask.tls import Credential
from tests.conftest import read_log, wait_for
from tests.hostile_link import Command


@pytest.fixture(scope="module")
def node():
    with LabNode.local(volunteers=2, dashboard=False) as node:
        yield node


def _volunteer(node) -> tuple[str, object]:
    cred = Credential.decode(node.enroll())
    return cred.name, cred.security()


def _host_port(address: str) -> tuple[str, int]:
    host, port = address.split("://")[1].rsplit(":", 1)
    return host, int(port)


def _refusal_of(node, name: str) -> str | None:
    for record in [*node.report().get("bans", ()), *node.report().get("refusals", ())]:
        if name in (record.get("name"), record.get("address")):
            return record.get("reason", "")
    return None


def _banned(node, name: str) -> bool:
    return name in node.keys.revoked()


def _product_is_right(node, seed: int) -> None:
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((300, 200)), rng.standard_normal((200, 100))
    got = (ga.from_array(a, chunks=100) @ ga.from_array(b, chunks=100)).compute()
    np.testing.assert_allclose(got, a @ b, rtol=1e-9, atol=1e-12)


async def _send(address: str, security, *messages) -> str:
    """Write ``messages`` on one connection; 'dropped' when the lab closes it, else its last answer."""
    try:
        comm = await connect(address, **security.get_connection_args("worker"))
    except (CommClosedError, OSError):
        return "dropped"
    try:
        answer = None
        for msg in messages:
            await comm.write(msg)
            answer = await asyncio.wait_for(comm.read(), 20)
        return repr(answer)
    except (CommClosedError, OSError):
        return "dropped"
    finally:
        comm.abort()


# -- pickles ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", ["scheduler", "lab worker"])
def test_a_pickle_that_runs_a_command_is_refused_and_its_sender_banned(node, tmp_path, target):
    marker = tmp_path / "pwned"
    name, security = _volunteer(node)
    address = node.address if target == "scheduler" else node.lab_worker_address()
    evil = {"op": "identity", "reply": True, "payload": ToPickle(Command(str(marker)))}
    assert node.client.sync(_send, address, security, evil) == "dropped"
    wait_for(lambda: _banned(node, name), timeout=20, what=f"{name} banned")
    assert not marker.exists(), "the lab unpickled a volunteer's object"
    assert "posix.system" in _refusal_of(node, name)
    _product_is_right(node, 1)  # everyone else is served


def test_each_message_is_checked_not_only_the_first(node, tmp_path):
    marker = tmp_path / "pwned"
    name, security = _volunteer(node)
    first = {"op": "identity", "reply": True}
    evil = {"op": "identity", "reply": True, "payload": ToPickle(Command(str(marker)))}
    assert node.client.sync(_send, node.address, security, first, evil) == "dropped"
    wait_for(lambda: _banned(node, name), timeout=20, what=f"{name} banned")
    assert not marker.exists()


def test_an_exception_object_from_a_volunteer_is_refused_too(node):
    """A volunteer's errors travel as text: the lab unpickles no exception class of a volunteer."""
    name, security = _volunteer(node)
    msg = {"op": "identity", "reply": True, "payload": ToPickle(ValueError("from a volunteer"))}
    assert node.client.sync(_send, node.address, security, msg) == "dropped"
    wait_for(lambda: _banned(node, name), timeout=20, what=f"{name} banned")
    assert "refused pickle" in _refusal_of(node, name)


def test_numbers_and_plain_containers_still_pass(node):
    name, security = _volunteer(node)
    plain = {"op": "identity", "reply": True, "payload": ToPickle({"a": np.arange(3.0), "b": (1, 2.5, [3])})}
    assert node.client.sync(_send, node.address, security, plain) != "dropped"
    assert not _banned(node, name)


@pytest.mark.slow
@pytest.mark.parametrize("as_error", [False, True], ids=["as data", "as error bytes"])
def test_a_get_data_answer_holding_a_pickle_is_refused(tmp_path, as_error):
    """The lab worker fetches a volunteer's result: an answer that is a pickle of a command (as the data,
    or as an error's exception bytes, which distributed unpickles after the read) is refused, its sender
    banned, the task computed elsewhere, and the researcher's numbers are numpy's."""
    marker = tmp_path / "pwned"
    extra = ("--marker", str(marker), *(("--as-error",) if as_error else ()))
    with LabNode.local(volunteers=0, dashboard=False, state_dir=tmp_path / "lab") as lab, lab.client.as_current():
        hostile = lab.add_volunteer(module="tests.hostile_link", extra_args=extra)
        lab.add_volunteer()
        rng = np.random.default_rng(2)
        a, b = rng.standard_normal((512, 256)), rng.standard_normal((256, 256))
        got = (ga.from_array(a, chunks=128) @ ga.from_array(b, chunks=128)).compute()
        np.testing.assert_allclose(got, a @ b, rtol=1e-9, atol=1e-12)
        wait_for(lambda: _banned(lab, hostile), timeout=30, what=f"{hostile} banned")
        assert ("with an error" if as_error else "posix.system") in _refusal_of(lab, hostile)
    assert not marker.exists(), "the lab worker unpickled a volunteer's answer"


@pytest.mark.parametrize("answer", ["pickle", "list", "text"])
def test_a_replicas_volunteer_answering_the_labs_fetch_with_no_data_is_refused_and_blames_nobody_else(tmp_path,
                                                                                                    answer):
    """Random blocks are replica-checked: the lab worker fetches each replica from the volunteer that computed it.
    One that answers with a pickle, a list or text in place of its data is refused and banned; the honest
    volunteer whose results it was to check is never rejected, and the researcher's numbers are the seed's."""
    marker = tmp_path / "pwned"
    extra = ("--marker", str(marker), *(("--answer", answer) if answer != "pickle" else ()))
    with LabNode.local(volunteers=0, dashboard=False, state_dir=tmp_path / "lab") as lab, lab.client.as_current():
        hostile = lab.add_volunteer(module="tests.hostile_link", extra_args=extra)
        honest = lab.add_volunteer()
        x = ga.random.standard_normal((6 * 48, 4 * 48), chunks=48, seed=5)
        np.testing.assert_array_equal(x.compute(), x.compute(scheduler="sync"))
        wait_for(lambda: _banned(lab, hostile), timeout=60, what=f"{hostile} banned")
        record = lab.report()["volunteers"].get(honest, {})
        assert record.get("rejected", 0) == 0 and not record.get("banned"), lab.report()["rejections"]
        assert _refusal_of(lab, hostile), lab.report()["bans"]
    assert not marker.exists(), "the lab worker unpickled a volunteer's answer"


# -- malformed input -------------------------------------------------------------------------------

async def _raw(address: str, security, payload: bytes, close_after: bool = False) -> str:
    """Write raw bytes inside a TLS connection; 'dropped' when the lab closes it."""
    host, port = _host_port(address)
    ctx = security.get_connection_args("worker")["ssl_context"]
    reader, writer = await asyncio.open_connection(host, port, ssl=ctx)
    try:
        writer.write(payload)
        await writer.drain()
        if close_after:
            return "closed by us"
        while True:
            data = await asyncio.wait_for(reader.read(65536), 20)
            if not data:
                return "dropped"
    except (ConnectionError, ssl.SSLError, asyncio.IncompleteReadError):
        return "dropped"
    except asyncio.TimeoutError:
        return "still open"
    finally:
        writer.close()


def _rss(node, part: str) -> int:
    return psutil.Process(node.processes[part].pid).memory_info().rss


def test_a_header_announcing_100_gb_allocates_nothing(node):
    name, security = _volunteer(node)
    before = _rss(node, "scheduler")
    answer = node.client.sync(_raw, node.address, security, struct.pack("Q", 100 * 10**9) + b"x" * 64)
    assert answer == "dropped"
    assert _rss(node, "scheduler") - before < 100 * 2**20
    assert "100000000000 bytes" in _refusal_of(node, name)
    _product_is_right(node, 3)


@pytest.mark.parametrize("how", ["random bytes", "random frames", "truncated"])
def test_random_and_truncated_frames_drop_the_connection(node, how):
    name, security = _volunteer(node)
    rng = np.random.default_rng(7)
    noise = rng.integers(0, 256, 4096, dtype=np.uint8).tobytes()
    if how == "random bytes":
        payload, close = noise, False
    elif how == "random frames":  # a valid size, then garbage where frames are expected
        payload, close = struct.pack("Q", len(noise)) + noise, False
    else:  # announces 4096 bytes, sends 100, hangs up
        payload, close = struct.pack("Q", 4096) + noise[:100], True
    for address in (node.address, node.lab_worker_address()):
        answer = node.client.sync(_raw, address, security, payload, close)
        assert answer in ("dropped", "closed by us"), answer
    _product_is_right(node, 4)


@pytest.mark.slow
def test_a_thousand_connections_from_one_volunteer_cost_the_lab_nothing_lasting(node):
    name, security = _volunteer(node)
    host, port = _host_port(node.address)
    ctx = security.get_connection_args("worker")["ssl_context"]
    before = _rss(node, "scheduler")

    async def flood(n: int) -> int:
        async def one():
            try:
                reader, writer = await asyncio.open_connection(host, port, ssl=ctx)
            except (OSError, ssl.SSLError):
                return None
            return reader, writer

        conns = [c for c in await asyncio.gather(*(one() for _ in range(n))) if c is not None]

        async def still_open(reader) -> bool:
            try:
                return bool(await asyncio.wait_for(reader.read(1), 3)) or False
            except asyncio.TimeoutError:
                return True
            except (ConnectionError, ssl.SSLError):
                return False

        alive = sum(await asyncio.gather(*(still_open(r) for r, _ in conns)))
        for _, writer in conns:
            writer.close()
        return alive

    alive = node.client.sync(flood, 1000)
    assert alive <= 32, f"{alive} connections of one volunteer stayed open"
    assert _rss(node, "scheduler") - before < 200 * 2**20
    _product_is_right(node, 5)


# -- floods of calls -------------------------------------------------------------------------------

async def _calls(address: str, security, msg: dict, n: int) -> list[str]:
    """Make call ``msg`` ``n`` times on one connection: per call "ok", "refused: <text>" or "dropped"."""
    comm = await connect(address, **security.get_connection_args("worker"))
    out: list[str] = []
    try:
        for _ in range(n):
            await comm.write(msg)
            answer = await asyncio.wait_for(comm.read(), 20)
            if isinstance(answer, dict) and answer.get("status") in ("error", "uncaught-error"):
                out.append(f"refused: {answer.get('exception_text', '')}")
            else:
                out.append("ok")
    except (CommClosedError, OSError):
        out.append("dropped")
    finally:
        comm.abort()
    return out


@pytest.mark.slow
def test_a_volunteer_flooding_the_scheduler_with_calls_is_refused_then_banned(node):
    from goblin_dask.node import rpc
    from scheduler_plugins.admission import VOLUNTEER_CALL_BURST, VOLUNTEER_FLOOD_BAN

    name, security = _volunteer(node)
    answers = node.client.sync(_calls, node.address, security, {"op": rpc.VOLUNTEER_STATUS, "reply": True},
                               3 * VOLUNTEER_FLOOD_BAN)
    first_refusal = next(i for i, a in enumerate(answers) if a != "ok")
    assert first_refusal >= VOLUNTEER_CALL_BURST  # a burst passes
    assert "over its budget" in answers[first_refusal]
    assert answers.count("ok") < VOLUNTEER_CALL_BURST + len(answers) // 2  # the rest mostly refused, not run
    assert _banned(node, name)
    assert "flooded the lab node" in _refusal_of(node, name)
    # the honest volunteers are not touched by another's flood
    assert not any(_banned(node, v) for v in node.volunteer_names())
    _product_is_right(node, 6)


def test_a_volunteer_asks_who_has_only_about_named_keys(node):
    name, security = _volunteer(node)
    every, named, too_many = node.client.sync(_calls, node.address, security, {"op": "who_has", "reply": True}, 1) + \
        node.client.sync(_calls, node.address, security, {"op": "who_has", "keys": ["x", "y"], "reply": True}, 1) + \
        node.client.sync(_calls, node.address, security,
                         {"op": "who_has", "keys": [f"k{i}" for i in range(20_000)], "reply": True}, 1)
    assert every.startswith("refused") and "who_has" in every  # not the lab's whole key table
    assert named == "ok"
    assert too_many.startswith("refused")
    assert not _banned(node, name)


def test_a_volunteers_calls_are_charged_by_the_keys_they_name(node):
    """Issue 29: the budget counted calls, not their cost: 10 credentials each asking ``who_has`` about 10,000
    keys of 100 characters stayed under 50 calls a second and slowed a researcher's one-task job from 7 ms to
    over a second.  Now such a call costs one call plus one per 100 keys and per 16 KiB of their text (about
    160 calls): after a handful the volunteer is over its budget until it has paid them back; not banned."""
    from scheduler_plugins.admission import VOLUNTEER_CALL_BURST, call_cost

    name, security = _volunteer(node)
    keys = [f"{i:0100d}" for i in range(10_000)]
    assert call_cost(keys) > 150
    answers = node.client.sync(_calls, node.address, security, {"op": "who_has", "keys": keys, "reply": True}, 8)
    passed = answers.count("ok")
    assert 1 <= passed <= VOLUNTEER_CALL_BURST / call_cost(keys) + 2, answers  # 8 on main: 8 calls of 500
    assert all(a.startswith("refused") and "over its budget" in a for a in answers[passed:]), answers
    assert node.report()["over_budget"].get(name) == len(answers) - passed
    assert not _banned(node, name)
    # cheap calls are charged one each: a burst of them passes, as before
    _, other = _volunteer(node)
    assert node.client.sync(_calls, node.address, other, {"op": "who_has", "keys": ["x"], "reply": True},
                            100) == ["ok"] * 100


def test_the_read_rate_waits_for_a_volunteer_in_debt_and_refills():
    from goblin_dask.link import ReadRate

    now = [0.0]
    pace = ReadRate(rate=100.0, burst=800.0, clock=lambda: now[0])
    assert pace.delay("v") == 0.0
    pace.charge("v", 1000)  # a message larger than the burst is read, then paid back
    assert pace.delay("v") == pytest.approx(2.0) and pace.delay("w") == 0.0  # each volunteer its own bucket
    now[0] += 1.5
    assert pace.delay("v") == pytest.approx(0.5)
    now[0] += 100.0  # never more than the burst
    pace.charge("v", 800)
    assert pace.delay("v") == 0.0
    pace.charge("v", 1)
    assert pace.delay("v") == pytest.approx(0.01)


def test_the_scheduler_reads_nothing_more_of_a_volunteer_over_its_read_rate(tmp_path):
    """Issue 29: a refusal after the message was read and decoded is no defence against messages that are
    costly to read (10 credentials sending ``who_has`` with 10,000 keys of 100 characters: a researcher's
    one-task job went from 7 ms to over a second, refused or not).  The scheduler reads each volunteer at
    ``goblin.link.scheduler-read-rate``; one in debt waits, on every connection, while others are answered."""
    import dask

    from goblin_dask.node import rpc

    async def body(address, greedy, other) -> tuple[str, str, bool]:
        keys = [f"{i:0100d}" for i in range(10_000)]  # 1 MB: 1000 s of a 1 KB/s rate
        first = await _calls(address, greedy, {"op": "who_has", "keys": keys, "reply": True}, 1)
        waiting = asyncio.ensure_future(_calls(address, greedy, {"op": rpc.VOLUNTEER_STATUS, "reply": True}, 1))
        answered = await _calls(address, other, {"op": rpc.VOLUNTEER_STATUS, "reply": True}, 1)
        await asyncio.sleep(2.0)  # the other volunteer was answered meanwhile; this one still waits its turn
        pending = not waiting.done()
        waiting.cancel()
        return first[0], answered[0], pending

    with dask.config.set({"goblin.link.scheduler-read-rate": 1024}), \
            LabNode.local(volunteers=0, state_dir=tmp_path / "lab", dashboard=False) as node:
        (_, greedy), (_, other) = _volunteer(node), _volunteer(node)
        first, answered, pending = node.client.sync(body, node.address, greedy, other)
    assert first == "ok"  # within its burst (8 KB) it was read, then charged: about 1000 s of debt
    assert answered == "ok" and pending


def test_an_honest_volunteer_sending_the_scheduler_more_than_its_read_burst_is_slowed_never_dropped(tmp_path):
    """Issue 29: the read rate (``goblin.link.scheduler-read-rate``, bursts of 8 s) must not cost an honest
    volunteer that sends more than a burst at once.  Its ``register-worker`` carries 4 MiB of startup information
    (a large environment) at a read rate of 256 KiB/s: twice the burst, so nothing more of it is read for about 8 s,
    its heartbeats included, with ``goblin.link.dead-after`` at 3 s.  It stays connected, is neither banned nor
    blamed, and computes its share of a product (numpy's numbers).  (The agent's startup information is its
    credential, under 1 KB; a lab whose agents describe more raises ``goblin.admission.max-startup-information``,
    as here.)"""
    import dask

    from goblin_dask.link import scheduler_read_rate

    with dask.config.set({"goblin.link.dead-after": 3.0, "goblin.link.scheduler-read-rate": "256KiB",
                          "goblin.admission.max-startup-information": "8MiB"}), \
            LabNode.local(volunteers=0, state_dir=tmp_path / "lab", dashboard=False) as node:
        hello = 2 * int(scheduler_read_rate().burst)  # 4 MiB: 8 s of the rate beyond its burst
        big = node.add_volunteer(module="tests.hostile", extra_args=("--attack", "large-hello",
                                                                      "--hello-bytes", str(hello)))
        rng = np.random.default_rng(12)
        a, b = rng.standard_normal((1024, 1024)), rng.standard_normal((1024, 1024))
        with node.client.as_current():
            got = (ga.from_array(a, chunks=256) @ ga.from_array(b, chunks=256)).compute()
        np.testing.assert_allclose(got, a @ b, rtol=1e-10, atol=1e-10)
        report = node.report()
        record = report["volunteers"][big]
        assert record["accepted"] > 0 and record["failed"] == 0 and not record["banned"], record
        assert not [r for r in report["refusals"] if r.get("name") == big], report["refusals"]
        assert not [f for f in report["faults"]["faults"] if f["volunteer"] == big], report["faults"]
        assert big in node.volunteer_names() and node.processes[big].poll() is None
        log = (tmp_path / "lab" / "logs" / "scheduler.log").read_text(errors="replace")
        assert not [ln for ln in log.splitlines() if big in ln and "silent for" in ln], log[-3000:]


def test_an_honest_volunteer_running_many_small_tasks_at_full_speed_is_never_throttled_or_banned(tmp_path):
    """The scheduler budgets what each volunteer credential sends it (its calls, and the stream messages that
    report on no task: ``CallBudget``, 50 a second; its bytes: ``goblin.link.scheduler-read-rate``).  An honest
    volunteer alone on a lab, two threads, computes a batched product at full speed: 2,500 pairs of 96x96
    blocks (the smallest product the lab hands a volunteer), each pair a task with two new inputs it fetches,
    caches and tells the scheduler of (``goblin-cached``).  Before, it sent a hint per fetch, 30 to 60 a second
    on 2 cores shared with the lab (more on faster machines), from the budget its heartbeats share (one run of
    such products: 159 dropped over the budget, and 2 failures counted to it); now its hints go at most once a second
    (``HINT_INTERVAL``).  At the defaults nothing of it is refused or dropped over the budget, it is neither
    banned nor counted failed or late, every task ran on it, and the product is numpy's."""
    pairs, n = 2500, 96  # 96: the smallest product block the placement sends a volunteer (min-product-intensity)
    rng = np.random.default_rng(29)
    a, b = rng.standard_normal((2, pairs, n, n))
    with LabNode.local(volunteers=0, state_dir=tmp_path / "lab", dashboard=False) as node, node.client.as_current():
        fast = node.add_volunteer(nthreads=2)
        got = (ga.from_array(a, chunks=(1, n, n)) @ ga.from_array(b, chunks=(1, n, n))).compute()
        report = node.report()
        assert fast in node.volunteer_names() and node.processes[fast].poll() is None
    np.testing.assert_allclose(got, a @ b, rtol=1e-10, atol=1e-10)
    record = report["volunteers"][fast]
    assert record["accepted"] == pairs, record  # every task ran on it, and was checked
    assert record["rejected"] == record["failed"] == record["late"] == 0 and not record["banned"], record
    assert not report["bans"] and not report["refusals"], (report["bans"], report["refusals"])
    assert report["over_budget"].get(fast, 0) == 0, report["over_budget"]


def test_a_volunteer_registering_with_16_mib_of_versions_is_refused_before_they_are_compared(tmp_path):
    """Issue 29: a volunteer credential's ``register-worker`` carrying 16 MiB of ``versions`` (within the read
    rate's burst) stalled the scheduler's loop 4.66 s in distributed's version comparison, and could again at each
    refill.  Now the lab refuses it, naming the field, before distributed reads it: the hostile agent exits with
    the reason, the node logs a WARNING and records the refusal, the scheduler's loop never stalls (distributed
    logs any stall over ``distributed.admin.tick.limit``, 3 s), a researcher's small jobs complete while it is
    read and refused, and the honest volunteer beside it computes a product (numpy's numbers).  The honest
    volunteer's own register-worker, as the node measured it, is far below every limit."""
    import operator

    from goblin_dask.errors import EXIT_REFUSED
    from scheduler_plugins.admission import hello_limits

    with LabNode.local(volunteers=1, state_dir=tmp_path / "lab", dashboard=False) as node:
        (honest,) = node.volunteer_names()
        rng = np.random.default_rng(29)
        a, b = rng.standard_normal((1024, 1024)), rng.standard_normal((1024, 1024))
        with node.client.as_current():
            product = node.client.compute(ga.from_array(a, chunks=256) @ ga.from_array(b, chunks=256))
        hostile = node.add_volunteer(module="tests.hostile", wait=False, extra_args=(
            "--attack", "large-versions", "--hello-bytes", str(16 * 2**20)))
        proc, jobs = node.processes[hostile], 0
        while jobs == 0 or proc.poll() is None and hostile not in node.volunteer_names():  # while it is refused
            assert node.client.submit(operator.add, jobs, 1, pure=False).result(timeout=120) == jobs + 1
            jobs += 1
        np.testing.assert_allclose(product.result(timeout=300), a @ b, rtol=1e-10, atol=1e-10)

        logs = tmp_path / "lab" / "logs"
        told = (logs / f"{hostile}.log").read_text(errors="replace")
        assert proc.returncode == EXIT_REFUSED, told[-3000:]
        assert "large-versions: register-worker carries 16777216 bytes of versions" in told, told[-3000:]
        assert "the lab node refused this volunteer: goblin lab node refused this worker: its register-worker's " \
               "'versions' is larger than this lab reads from a volunteer (at most 256 entries" in told, told[-3000:]
        report = node.report()
        refused = [r for r in report["refusals"] if "'versions' is larger" in r["reason"]]
        assert len(refused) == 1 and len(refused[0]["address"]) <= 200, refused
        assert hostile not in node.volunteer_names() and hostile not in report["volunteers"], report["volunteers"]
        record = report["volunteers"][honest]
        assert record["accepted"] > 0 and record["failed"] == 0 and not record["banned"], record
        assert honest in node.volunteer_names() and node.processes[honest].poll() is None

        log = (logs / "scheduler.log").read_text(errors="replace").splitlines()
        assert [ln for ln in log if "WARNING" in ln and f"volunteer {hostile}" in ln and "'versions' is larger" in ln]
        assert not [ln for ln in log if "unresponsive" in ln], [ln for ln in log if "unresponsive" in ln]
        assert not [ln for ln in log if "Register worker" in ln and hostile in ln]  # distributed never saw it
        (admitted,) = [ln for ln in log if f"admitted volunteer {honest} at" in ln]
        sizes = dict(part.split(" ") for part in admitted.split("bytes of text): ")[1].split(", "))
        for field, size in sizes.items():
            entries, text = map(int, size.split("/"))
            most_entries, most_text = hello_limits(field)
            assert entries * 10 <= most_entries and text * 10 <= most_text, (field, size)
        assert int(sizes["versions"].split("/")[0]) >= 10  # distributed's package list, measured


def test_a_volunteer_fetches_from_the_lab_worker_only_the_inputs_of_its_own_tasks(tmp_path):
    """Issue 29: any volunteer certificate could call any lab worker handler (``get_data`` of any key, the
    whole key list, ``update_data``).  Now a volunteer's connection to a lab worker may call ``get_data`` only,
    of the inputs of tasks the scheduler gave it; the honest volunteers still compute (numpy's numbers)."""
    import operator

    with LabNode.local(volunteers=1, state_dir=tmp_path / "lab", dashboard=False) as node:
        held = node.client.submit(operator.add, 40, 2, pure=False)  # a researcher's result, on the lab worker
        assert held.result() == 42
        _, security = _volunteer(node)
        lab = node.lab_worker_address()
        listed, fetched, stored = [node.client.sync(_calls, lab, security, msg, 1)[0] for msg in (
            {"op": "keys", "reply": True},
            {"op": "get_data", "keys": [held.key], "who": None, "reply": True},
            {"op": "update_data", "data": {"planted": 1.0}, "reply": True})]
        assert listed.startswith("refused") and "'keys' is not allowed for volunteer" in listed, listed
        assert stored.startswith("refused") and "'update_data' is not allowed" in stored, stored
        assert fetched.startswith("refused") and "only the inputs of its own tasks" in fetched, fetched
        assert held.result() == 42
        before = node.report()["accepted"]
        rng = np.random.default_rng(8)
        a, b = rng.standard_normal((600, 400)), rng.standard_normal((400, 500))
        with node.client.as_current():  # the honest volunteer fetches its inputs and computes
            got = (ga.from_array(a, chunks=200) @ ga.from_array(b, chunks=(200, 250))).compute()
        np.testing.assert_allclose(got, a @ b, rtol=1e-12, atol=1e-10)
        assert node.report()["accepted"] > before


# -- volunteers behind NAT -------------------------------------------------------------------------

def _listening(pid: int) -> list:
    """Listening sockets the network can reach (a volunteer's status page listens on 127.0.0.1 only)."""
    return [c for c in psutil.Process(pid).net_connections()
            if c.status == psutil.CONN_LISTEN and c.laddr.ip not in ("127.0.0.1", "::1")]


def test_volunteers_open_no_listening_socket(node):
    addresses = node.volunteer_addresses()
    assert len(addresses) >= 2
    for name, address in addresses.items():
        assert address.startswith(f"nat://{name}:"), address
        assert _listening(node.processes[name].pid) == [], f"{name} listens"
    # ... and yet the lab reaches them: products and random blocks, verified.
    _product_is_right(node, 6)
    r = ga.random.standard_normal((400, 300), chunks=100, seed=11)
    x = r.compute()
    np.testing.assert_array_equal(x, r.compute())  # the same seed gives the same numbers, wherever computed
    assert x.shape == (400, 300) and abs(float(x.mean())) < 0.05
    report = node.report()
    assert sum(report["volunteers"][n]["accepted"] for n in addresses) > 0


def test_a_volunteer_asks_for_the_labs_endpoints_over_one_lasting_connection(monkeypatch, tmp_path):
    """Each ask over a new connection cost the scheduler a TLS handshake per volunteer every
    ``goblin.link.refresh`` seconds; asked every 0.2 s here, none opens a new connection to the scheduler."""
    monkeypatch.setenv("DASK_GOBLIN__LINK__REFRESH", "0.2")
    with LabNode.local(volunteers=1, dashboard=False, state_dir=tmp_path / "lab") as node:
        port = _host_port(node.address)[1]
        volunteer = psutil.Process(node.processes[next(iter(node.volunteer_addresses()))].pid)

        def to_scheduler() -> set:
            return {c.laddr for c in volunteer.net_connections(kind="tcp") if c.raddr and c.raddr[1] == port}

        wait_for(lambda: len(to_scheduler()) >= 2, "the volunteer's connections to the scheduler")
        time.sleep(1.0)  # its first asks, standby connections and registration settle
        start, seen, asks = to_scheduler(), set(), 0
        while asks < 300:  # about 3 s: 15 asks
            seen |= to_scheduler()
            asks += 1
            time.sleep(0.01)
        assert seen - start == set(), (start, seen)
        _product_is_right(node, 7)  # and it still computes


def test_a_standby_connection_under_another_name_is_refused(node):
    victim = next(iter(node.volunteer_addresses().values()))
    name, security = _volunteer(node)
    offer = {"op": "goblin_standby", "address": victim}
    assert node.client.sync(_send, node.lab_worker_address(), security, offer) == "dropped"
    wait_for(lambda: _banned(node, name), timeout=20, what=f"{name} banned")
    assert "not its own name" in _refusal_of(node, name)
    _product_is_right(node, 8)  # the victim still serves its results


@pytest.mark.slow
def test_a_volunteer_killed_mid_product_loses_nothing(tmp_path):
    with LabNode.local(volunteers=3, dashboard=False, state_dir=tmp_path / "lab") as lab, lab.client.as_current():
        for name in lab.volunteer_names():
            assert _listening(lab.processes[name].pid) == []
        rng = np.random.default_rng(9)
        a, b = rng.standard_normal((1024, 512)), rng.standard_normal((512, 512))
        product = ga.from_array(a, chunks=128) @ ga.from_array(b, chunks=128)
        future = lab.client.compute(product)
        victim = lab.volunteer_names()[0]
        wait_for(lambda: lab.report()["volunteers"].get(victim, {}).get("accepted", 0) >= 1, timeout=120,
                 what=f"{victim} computed something")
        lab.kill_volunteer(victim)
        np.testing.assert_allclose(future.result(timeout=300), a @ b, rtol=1e-9, atol=1e-12)
        assert victim not in lab.volunteer_names()


# -- banned and revoked volunteers ------------------------------------------------------------------

async def _open(address: str, security, first: dict | None = None):
    """A connection to ``address``; ``first`` sent on it (a call's answer is read and returned too)."""
    comm = await connect(address, **security.get_connection_args("worker"))
    answer = None
    if first is not None:
        await comm.write(first)
        if first.get("reply"):
            answer = await asyncio.wait_for(comm.read(), 20)
    return comm, answer


async def _closed_by_the_lab(comm) -> bool:
    """Does the lab close ``comm`` (it sends us nothing on a standby or idle call connection)?"""
    try:
        while True:
            await asyncio.wait_for(comm.read(), 30)
    except (CommClosedError, OSError):
        return True
    except asyncio.TimeoutError:
        return False
    finally:
        comm.abort()


def _ends_of(pid: int) -> set[tuple]:
    """Process ``pid``'s established connections, each as (its end, the far end)."""
    return {(tuple(c.laddr), tuple(c.raddr)) for c in psutil.Process(pid).net_connections()
            if c.status == psutil.CONN_ESTABLISHED}


def _connections_from(node, part: str, ends: set[tuple]) -> list[tuple]:
    """Those of ``ends`` (another process's connections) that ``part`` holds the far end of: matched on both
    ends, as a port alone may be reused by another process's connection to another address."""
    return [(near, far) for far, near in _ends_of(node.processes[part].pid) if (near, far) in ends]


def _left_open(node, part: str, ends: set[tuple], victim: str) -> str:
    """What a failed wait for ``part`` to close ``victim``'s connections left: those connections, and what
    ``part``'s log says of ``victim``."""
    left = _connections_from(node, part, ends)
    log = read_log(node._log_path(part)).splitlines()
    return f"still open {left}; its log of {victim}:\n" + "\n".join(line for line in log if victim in line)


@pytest.mark.parametrize("how", ["banned", "revoked"])
def test_a_banned_or_revoked_volunteer_is_served_nothing_and_its_connections_are_closed(node, how):
    """Every handler and stream message of a banned or revoked credential is refused, not only
    ``register-worker``: its open connections (calls, standby, worker stream) to the scheduler and the lab
    worker are closed, a new one is closed after telling it why, and it never learns the lab worker's address."""
    import signal

    from goblin_dask.node import rpc

    lab_worker = node.lab_worker_address()
    endpoints = {"op": rpc.LINK_ENDPOINTS, "reply": True}
    # a hostile agent holding connections of its own ...
    name, security = _volunteer(node)
    calls, seen = node.client.sync(_open, node.address, security, endpoints)
    assert lab_worker in seen  # served while in good standing
    standby = {"op": "goblin_standby", "address": f"nat://{name}:1"}
    parked = [node.client.sync(_open, address, security, standby)[0] for address in (node.address, lab_worker)]
    # ... and a real volunteer process, stopped so that only the lab can close what it holds
    victim = node.add_volunteer()
    wait_for(lambda: _connections_from(node, "lab-worker", _ends_of(node.processes[victim].pid)),
             timeout=60, what=f"{victim}'s standby connections to the lab worker")
    victim_ends = _ends_of(node.processes[victim].pid)
    os.killpg(node.processes[victim].pid, signal.SIGSTOP)
    try:
        for who in (name, victim):
            if how == "banned":
                node.client.sync(node.client.scheduler.goblin_ban, name=who, reason="a test ban")
            else:
                node.revoke(who)
        for comm in (calls, *parked):
            assert node.client.sync(_closed_by_the_lab, comm)
        for part in ("scheduler", "lab-worker"):
            try:
                wait_for(lambda: not _connections_from(node, part, victim_ends), timeout=30,
                         what=f"the {part} to close {victim}'s connections")
            except AssertionError as e:
                raise AssertionError(f"{e}: {_left_open(node, part, victim_ends, victim)}") from None
        wait_for(lambda: victim not in node.volunteer_names(), timeout=30, what=f"{victim} removed")
    finally:
        node.kill_volunteer(victim)
    # a new connection is told why it is refused, and nothing more
    told = node.client.sync(_send, node.address, security, {"op": rpc.CHECK_CREDENTIAL, "reply": True})
    assert "'revoked': True" in told
    assert node.client.sync(_send, node.address, security, {"op": rpc.CHECK_CREDENTIAL, "reply": True},
                            endpoints) == "dropped"
    for msg in (endpoints, {"op": "identity", "reply": True}, {"op": "who_has", "keys": ["x"], "reply": True},
                {"op": rpc.VOLUNTEER_STATUS, "reply": True}, standby):
        for address in (node.address, lab_worker):
            answer = node.client.sync(_send, address, security, msg)
            assert answer == "dropped", (msg, address, answer)
    _product_is_right(node, 12)  # everyone else is served


# -- bytes in flight -------------------------------------------------------------------------------

def test_messages_held_one_byte_short_on_many_connections_hold_one_buffer(tmp_path):
    """Issue 29: 16 connections each holding a message one byte short of complete grew the scheduler by
    641 MiB at a 40 MiB message limit.  ``goblin.link.max-in-flight`` bounds what one volunteer has in flight
    across its connections: past it a connection is dropped (no ban: an oversized burst, not a lie)."""
    import dask

    message, in_flight, connections = 40 * 2**20, 48 * 2**20, 16
    with dask.config.set({"goblin.link.max-message": message, "goblin.link.max-in-flight": in_flight}), \
            LabNode.local(volunteers=1, dashboard=False, state_dir=tmp_path / "lab") as lab:
        name, security = _volunteer(lab)
        host, port = _host_port(lab.address)
        ctx = security.get_connection_args("worker")["ssl_context"]
        before = _rss(lab, "scheduler")

        async def attack() -> int:
            body = struct.pack("Q", message) + b"\x01" * (message - 1)  # one byte short of the whole message
            conns = []
            for _ in range(connections):
                reader, writer = await asyncio.open_connection(host, port, ssl=ctx)
                try:
                    writer.write(body)
                    await writer.drain()
                except (ConnectionError, ssl.SSLError):
                    pass
                conns.append((reader, writer))

            async def still_open(reader) -> bool:  # the lab's handshake comes first, then EOF if it dropped us
                try:
                    while await asyncio.wait_for(reader.read(65536), 5):
                        pass
                    return False
                except asyncio.TimeoutError:
                    return True
                except (ConnectionError, ssl.SSLError):
                    return False

            alive = sum(await asyncio.gather(*(still_open(r) for r, _ in conns)))
            grown = _rss(lab, "scheduler") - before
            for _, writer in conns:
                writer.close()
            return alive, grown

        alive, grown = lab.client.sync(attack)
        assert alive <= in_flight // message, f"{alive} half-sent messages held at once"
        assert grown < message + 100 * 2**20, f"the scheduler grew by {grown / 2**20:.0f} MiB"
        assert "goblin.link.max-in-flight" in (_refusal_of(lab, name) or "")
        assert not _banned(lab, name)
        with lab.client.as_current():
            _product_is_right(lab, 13)  # the lab goes on
