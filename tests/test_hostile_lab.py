"""A hostile lab node against the volunteer: what it names for the volunteer to dial, and its activations.

A volunteer is a person's machine; the lab node (or whoever holds the lab's CA) must not use
``goblin volunteer`` against the volunteer's own network.  Each test runs a real ``goblin volunteer``
process against a compromised scheduler (a plain dask scheduler holding the lab CA's certificate,
``tests.hostile_lab_preload``: its answer to ``goblin_link_endpoints`` is the test's) and, for the
activation path, a hostile lab process of the test's own (raw TLS under the same CA), all on 127.0.0.1.
Other loopback addresses (127.0.0.2) stand in for the volunteer's home network: the lab's host is 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import struct
import sys
import threading
import time

import numpy as np
import pytest

from goblin_dask.errors import EXIT_HOSTILE_LAB
from goblin_dask.ops import CatalogTask, get
from tests.conftest import kill_group, read_log, rogue_scheduler, start_goblin_volunteer, wait_for

ELSEWHERE = "127.0.0.2"  # not the lab's host: a machine of the volunteer's network, for these tests


class Peers:
    """Servers of the test's, on an event loop in a thread: each counts the connections it got, those open now,
    and those the volunteer closed."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.servers: list = []

    def serve(self, host: str, handle, ssl_context=None) -> tuple[int, dict]:
        stats = {"accepted": 0, "open": 0, "most_open": 0, "closed_by_volunteer": 0}

        async def on_connection(reader, writer):
            stats["accepted"] += 1
            stats["open"] += 1
            stats["most_open"] = max(stats["most_open"], stats["open"])
            try:
                if handle is not None:
                    await handle(reader, writer)
                while await reader.read(65536):
                    pass
                stats["closed_by_volunteer"] += 1
            except (OSError, asyncio.IncompleteReadError, ssl.SSLError):
                stats["closed_by_volunteer"] += 1
            finally:
                stats["open"] -= 1
                writer.close()

        async def start():
            return await asyncio.start_server(on_connection, host, 0, ssl=ssl_context)

        server = asyncio.run_coroutine_threadsafe(start(), self.loop).result()
        self.servers.append(server)
        return server.sockets[0].getsockname()[1], stats

    def close(self):
        for server in self.servers:
            self.loop.call_soon_threadsafe(server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """(client of the compromised scheduler, node credential, stolen state, answer file, servers, workdir)."""
    tmp = tmp_path_factory.mktemp("hostile-lab")
    answer = tmp / "endpoints.json"
    answer.write_text(json.dumps(["SCHEDULER"]))
    peers = Peers()
    try:
        with rogue_scheduler(tmp, "tests.hostile_lab_preload", {"GOBLIN_TEST_ENDPOINTS": str(answer)}) as (client, cred,
                                                                                                             state):
            yield client, cred, state, answer, peers, tmp
    finally:
        peers.close()


_runs = iter(range(10**6))


def _volunteer(hostile, answer, env=None, args=()):
    client, cred, state, answer_file, peers, tmp = hostile
    answer_file.write_text(json.dumps(answer))
    name = f"lender-{next(_runs)}"
    log = tmp / f"{name}.log"
    env = {"DASK_GOBLIN__LINK__REFRESH": "0.2", **(env or {})}
    return start_goblin_volunteer(client.scheduler.address, state, name, log, env, args), log, name


def _joined(client, name: str) -> str | None:
    return next((a for a, w in client.scheduler_info(n_workers=-1)["workers"].items() if w.get("name") == name), None)


def _computes(client, address: str) -> None:
    a, b = np.arange(6.0).reshape(2, 3), np.arange(12.0).reshape(3, 4)
    key = f"k-{next(_runs)}"
    result = client.get({key: CatalogTask(key, get("matmul"), a, b)}, key, workers=[address])
    np.testing.assert_allclose(result, a @ b)


# -- (a) the scheduler names the endpoints: it is the lab itself ------------------------------------------

ANSWERS = {
    "another host of the volunteer's network": lambda port: ["SCHEDULER", f"tls://{ELSEWHERE}:{port}"],
    "private and link-local addresses": lambda port: ["SCHEDULER", "tls://10.255.0.1:443", "tls://192.168.1.1:443",
                                                      "tls://169.254.169.254:80", "tls://[fe80::1]:443"],
    "hundreds of the lab's ports": lambda port: ["SCHEDULER", *(f"tls://127.0.0.1:{p}" for p in range(20000, 20500))],
    "a plain tcp address": lambda port: ["SCHEDULER", f"tcp://{ELSEWHERE}:{port}"],
    "a websocket address": lambda port: ["SCHEDULER", f"ws://{ELSEWHERE}:{port}"],
    "a huge string": lambda port: ["SCHEDULER", "tls://" + "a" * 10_000 + ":443"],
    "wrong types": lambda port: ["SCHEDULER", 8786, None, {"tls": ELSEWHERE}, [f"tls://{ELSEWHERE}:{port}"]],
    "no list": lambda port: {"endpoints": [f"tls://{ELSEWHERE}:{port}"]},
    "thousands of endpoints in 1 MiB": lambda port: ["SCHEDULER", *(f"tls://{ELSEWHERE}:{port}" for _ in range(50_000))],
}
#: What the volunteer's exit message names of each answer.
NAMED = {"another host of the volunteer's network": ELSEWHERE, "private and link-local addresses": "10.255.0.1",
         "hundreds of the lab's ports": "501 endpoints", "a plain tcp address": "tcp://",
         "a websocket address": "ws://", "a huge string": "10010 characters", "wrong types": "is a int",
         "no list": "a dict where a list", "thousands of endpoints in 1 MiB": "bytes announced"}


@pytest.mark.parametrize("answer", list(ANSWERS))
def test_a_volunteer_leaves_a_lab_naming_endpoints_it_does_not_dial_and_dials_none(hostile, answer):
    """The old volunteer dialled up to 16 tls:// addresses the scheduler named, on any host (127.0.0.2's
    listener was reached), and ignored the rest; now the answer must be tls:// addresses on the lab's host,
    at most goblin.link.max-endpoints, in a message of at most 64 KiB: anything else is the lab itself
    being hostile, and the volunteer exits (code 9) naming what it sent, having dialled none of it."""
    client, _, _, _, peers, _ = hostile
    port, reached = peers.serve(ELSEWHERE, None)
    proc, log, name = _volunteer(hostile, ANSWERS[answer](port))
    try:
        wait_for(lambda: proc.poll() is not None, f"the volunteer to leave the lab ({answer})")
        assert proc.returncode == EXIT_HOSTILE_LAB, read_log(log)[-3000:]
        text = read_log(log)
        assert "it left this lab" in text and NAMED[answer] in text, text[-3000:]
        assert reached["accepted"] == 0, "the volunteer dialled a host the lab named off the lab's host"
        assert len(text) < 50_000, "the lab's huge answer went to the log"
    finally:
        kill_group(proc)


#: How the volunteer allows the lab's other host: (environment, command-line arguments).  The command line's
#: ``--lab-host`` (repeatable; an IP, a name or a network) is new: before, only the config or environment could
#: name a lab worker on another host, and a volunteer told of one left the lab (the answer above).
ALLOWED_BY = {
    "setting": ({"DASK_GOBLIN__LINK__LAB_HOSTS": json.dumps([ELSEWHERE])}, ()),
    "--lab-host": ({}, ("--lab-host", ELSEWHERE)),
    "--lab-host repeated, a network": ({}, ("--lab-host", "192.0.2.7", "--lab-host", f"{ELSEWHERE}/32")),
}


@pytest.mark.parametrize("how", list(ALLOWED_BY))
def test_a_lab_process_on_a_host_the_volunteer_allows_is_dialled_and_it_computes(hostile, how):
    """goblin.link.lab-hosts, or goblin volunteer --lab-host: a lab worker on another host of the lab is reached
    where the volunteer allows it."""
    client, _, _, _, peers, _ = hostile
    port, reached = peers.serve(ELSEWHERE, None)
    env, args = ALLOWED_BY[how]
    proc, log, name = _volunteer(hostile, ["SCHEDULER", f"tls://{ELSEWHERE}:{port}"], env, args)
    try:
        wait_for(lambda: reached["accepted"] >= 1 or proc.poll() is not None, "a standby connection there")
        assert proc.poll() is None, read_log(log)[-3000:]
        wait_for(lambda: _joined(client, name), "the volunteer to join")
        _computes(client, _joined(client, name))
    finally:
        kill_group(proc)


@pytest.mark.parametrize("value", ["tls://127.0.0.2:8786", "127.0.0.2:8786", "10.0.0.0/99", "lab host", ""])
def test_lab_host_that_is_not_a_host_is_refused_before_anything_starts(tmp_path, value):
    """An address, a port or a bad network would match no host the lab names: refused with what it takes."""
    import subprocess

    done = subprocess.run([sys.executable, "-m", "goblin_dask.volunteer", "tls://127.0.0.1:1", "--lab-host", value],
                          capture_output=True, text=True, env={**os.environ, "GOBLIN_TOKEN": "unused"}, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "Invalid value for '--lab-host'" in done.stderr and "is not a host: give a name, an IP address or a " \
        "network such as 10.0.0.0/24 ('*': any host), without a scheme or port" in done.stderr, done.stderr


def test_a_volunteer_fetches_inputs_from_no_address_off_the_labs_host(hostile):
    """The scheduler's compute-task names where a task's inputs are (who_has): the old volunteer dialled a
    tcp:// and a tls:// address on another host of its network for them; now it dials neither (tls:// on the
    lab's host only), says so on its log, and computes on."""
    client, _, _, _, peers, _ = hostile
    port, reached = peers.serve(ELSEWHERE, None)
    proc, log, name = _volunteer(hostile, ["SCHEDULER"], {"DASK_GOBLIN__LINK__HANDSHAKE_LOG_INTERVAL": "0"})
    try:
        wait_for(lambda: _joined(client, name), "the volunteer to join")
        address = _joined(client, name)
        targets = [f"tcp://{ELSEWHERE}:{port}", f"tls://{ELSEWHERE}:{port}"]
        client.run_on_scheduler(_send_task_reading_from, worker=address, sources=targets)
        wait_for(lambda: reached["accepted"] > 0 or all(t in read_log(log) for t in targets),
                 "the volunteer to try the inputs' sources")
        assert reached["accepted"] == 0, "the volunteer dialled a source of inputs off the lab's host"
        assert proc.poll() is None
        _computes(client, address)
    finally:
        kill_group(proc)


def _send_task_reading_from(dask_scheduler, worker, sources):
    """Run on the compromised scheduler: a task whose input is held, it says, at ``sources``."""
    from dask._task_spec import TaskRef
    from distributed.protocol.serialize import ToPickle

    from goblin_dask.ops import CatalogTask, get

    task = CatalogTask("rogue-fetch", get("matmul"), TaskRef("rogue-input"), np.ones((2, 2)))
    dask_scheduler.stream_comms[worker].send({
        "op": "compute-task", "key": "rogue-fetch", "run_id": 1, "priority": (0,), "stimulus_id": "rogue",
        "who_has": {"rogue-input": list(sources)}, "nbytes": {"rogue-input": 32}, "run_spec": ToPickle(task),
        "resource_restrictions": {}, "actor": False, "annotations": {}, "span_id": None,
    })


# -- (b) a hostile lab process on the activation path; the scheduler is the volunteer's honest lab -----

def _frames(msg) -> bytes:
    from distributed.comm.tcp import _add_frames_header
    from distributed.protocol import dumps

    frames, _, _ = _add_frames_header(dumps(msg))
    return b"".join(bytes(f) for f in frames)


async def _read_msg(reader):
    from distributed.protocol import loads
    from distributed.protocol.utils import unpack_frames

    (size,) = struct.unpack("Q", await reader.readexactly(8))
    frames, rest = unpack_frames(await reader.readexactly(size), partial=True)
    frames += [await reader.readexactly(n) for n in rest]
    return loads(frames)


HANDSHAKE = {"compression": None, "python": tuple(sys.version_info[:3]), "pickle-protocol": 5}


async def _standby(reader, writer) -> None:
    """The lab's half of distributed's handshake, then the volunteer's standby offer."""
    await _read_msg(reader)
    writer.write(_frames(HANDSHAKE))
    assert (await _read_msg(reader))["op"] == "goblin_standby"


async def _unknown_op(reader, writer):
    await _standby(reader, writer)
    writer.write(_frames({"op": "run", "function": b"\x80\x04N."}))


async def _giant_frame(reader, writer):
    await _standby(reader, writer)
    writer.write(struct.pack("Q", 16 * 2**20))  # ... and never the 16 MiB


async def _activation_never_completes(reader, writer):
    await _standby(reader, writer)
    writer.write(_frames({"op": "goblin_activate"}))  # ... and never its half of the handshake


async def _activate(reader, writer):
    await _standby(reader, writer)
    writer.write(_frames({"op": "goblin_activate"}))
    await _read_msg(reader)
    writer.write(_frames(HANDSHAKE))


async def _garbage_after_activation(reader, writer):
    await _activate(reader, writer)
    writer.write(struct.pack("Q", 64) + bytes(range(64)))


async def _giant_after_activation(reader, writer):
    await _activate(reader, writer)
    writer.write(struct.pack("Q", 64 * 2**20))  # over the volunteer's goblin.link.max-message (1 MiB here)


BEHAVIOURS = {"an unknown op": _unknown_op, "a giant frame": _giant_frame,
              "an activation that never completes": _activation_never_completes,
              "garbage after activation": _garbage_after_activation,
              "a giant frame after activation": _giant_after_activation}
VOLUNTEER_ENV = {"DASK_GOBLIN__LINK__HANDSHAKE_TIMEOUT": "2", "DASK_GOBLIN__LINK__MAX_MESSAGE": "1MiB",
                 "DASK_GOBLIN__LINK__VOLUNTEER_CONNECTIONS": "4", "DASK_GOBLIN__LINK__HANDSHAKE_LOG_INTERVAL": "600"}


def _lab_process(hostile, handle) -> tuple[int, dict]:
    """A hostile lab process on the lab's host (127.0.0.1), its certificate from the lab's CA."""
    client, cred, state, answer, peers, tmp = hostile
    for part in ("cert", "key"):
        (tmp / f"lab-{part}.pem").write_text(getattr(cred, part))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tmp / "lab-cert.pem", tmp / "lab-key.pem")
    return peers.serve("127.0.0.1", handle, ctx)


@pytest.mark.parametrize("behaviour", list(BEHAVIOURS))
def test_a_hostile_lab_process_on_the_activation_path_loses_its_connections_and_the_volunteer_computes(hostile,
                                                                                                     behaviour):
    """Whatever a lab process sends on a standby connection, the volunteer reads at most what the step allows
    (a few KiB before the activation, goblin.link.max-message after it), waits at most
    goblin.link.handshake-timeout for the activation's handshake, and drops the connection; it keeps
    computing for the scheduler, and says so on its log at most once per goblin.link.handshake-log-interval.
    The old volunteer held a standby connection announcing 16 MiB, or a 64 MiB message after activation,
    waiting for the bytes, and an activation without a handshake, for good."""
    client = hostile[0]
    port, seen = _lab_process(hostile, BEHAVIOURS[behaviour])
    proc, log, name = _volunteer(hostile, ["SCHEDULER", f"tls://127.0.0.1:{port}"], VOLUNTEER_ENV)
    try:
        wait_for(lambda: seen["closed_by_volunteer"] >= 3 or proc.poll() is not None,
                 f"the volunteer to drop the lab process's connections ({behaviour})")
        assert proc.poll() is None, read_log(log)[-3000:]
        wait_for(lambda: _joined(client, name), "the volunteer to join")
        _computes(client, _joined(client, name))
        assert read_log(log).count("refused what lab process") <= 1, read_log(log)[-3000:]
    finally:
        kill_group(proc)


def test_a_lab_process_activating_every_standby_connection_gets_a_bounded_number(hostile):
    """A lab process that activates each standby connection at once (and keeps it) had the old volunteer open
    another, about one a second, for as long as it ran; now at most goblin.link.volunteer-connections (4
    here) are open there, and the volunteer computes on."""
    client = hostile[0]
    port, seen = _lab_process(hostile, _activate)
    proc, log, name = _volunteer(hostile, ["SCHEDULER", f"tls://127.0.0.1:{port}"], VOLUNTEER_ENV)
    try:
        wait_for(lambda: seen["open"] >= 4 or proc.poll() is not None, "four activated connections")
        wait_for(lambda: _joined(client, name), "the volunteer to join")
        time.sleep(6)  # the old volunteer opened about six more meanwhile
        assert seen["most_open"] <= 4 and seen["accepted"] <= 4, seen
        assert proc.poll() is None
        _computes(client, _joined(client, name))
    finally:
        kill_group(proc)
