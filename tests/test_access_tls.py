"""Mutual TLS under the lab's own CA, and authorization by certificate role."""

from __future__ import annotations

import gc
import os
import socket
import ssl
import struct
import subprocess
import sys

import numpy as np
import pytest
from distributed import Client, Security

from goblin_dask import connect
from goblin_dask.credentials import issue_credential
from goblin_dask.tls import Credential, LabCA


def _refused_client(address, **kwargs):
    with pytest.raises((OSError, TimeoutError, PermissionError)):
        Client(address, timeout=5, **kwargs)
    _collect_failed_clients()


def _collect_failed_clients():
    """A Client whose constructor raised is closed by its ``__del__``: run it now.  Left to the garbage
    collector, it can run inside the next Client's start, which holds the loop runner's lock that its
    close waits for (distributed then hangs for good)."""
    gc.collect()


def test_every_connection_is_tls(lab):
    assert lab.address.startswith("tls://")
    workers = lab.client.scheduler_info()["workers"]
    # volunteers are reached over TLS connections they open themselves (nat://, goblin_dask.link)
    assert workers and all(a.startswith("tls://") or info["id"].startswith("volunteer") and a.startswith("nat://")
                           for a, info in workers.items())


def test_client_without_credentials_is_refused(lab):
    with pytest.raises(TypeError, match="TLS"):
        Client(lab.address, timeout=5)  # distributed will not even try without TLS settings
    _collect_failed_clients()
    _refused_client(lab.address.replace("tls://", "tcp://"))


def _host_port(address):
    host, port = address.split("://")[1].rsplit(":", 1)
    return host, int(port)


def test_tls_without_a_client_certificate_is_dropped_in_the_handshake(lab):
    ctx = ssl.create_default_context(cadata=Credential.decode(lab.enroll()).ca)
    ctx.check_hostname = False
    with socket.create_connection(_host_port(lab.address), timeout=10) as raw:
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            with ctx.wrap_socket(raw) as tls:
                tls.sendall(b"\x00" * 64)
                if not tls.recv(1):
                    raise ConnectionError("closed by the lab node")


def test_the_node_unpickles_nothing_from_an_unauthenticated_peer(lab, tmp_path):
    """A pickle bomb sent in plain dask framing to the TLS port is never loaded."""
    from distributed.protocol import dumps
    from distributed.protocol.serialize import ToPickle

    marker = tmp_path / "pwned"

    class Bomb:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    frames = dumps({"op": "identity", "payload": ToPickle(Bomb())})
    header = struct.pack("Q", len(frames)) + b"".join(struct.pack("Q", len(f)) for f in frames)
    with socket.create_connection(_host_port(lab.address), timeout=10) as raw:
        try:
            raw.sendall(header + b"".join(bytes(f) for f in frames))
            raw.recv(1)
        except OSError:
            pass
    assert lab.client.submit(np.add, 1, 1).result() == 2  # the node still works, and nothing ran
    assert not marker.exists()


def test_client_with_a_certificate_of_another_ca_is_refused(lab, tmp_path):
    stranger = LabCA(tmp_path / "other-lab").issue("admin", "lab-admin")
    _refused_client(lab.address, security=stranger.security())
    _refused_client(lab.address, security=Security.temporary())


def test_a_volunteer_certificate_cannot_open_a_client_session(lab):
    volunteer = Credential.decode(lab.enroll())
    _refused_client(lab.address, security=volunteer.security())


def test_researcher_credential_connects_but_cannot_administer(lab, tmp_path):
    path = issue_credential(lab.state_dir, "researcher", "ada").save(tmp_path / "ada.credential")
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    with connect(lab.address, credential=path, timeout=30) as client:
        assert client.submit(np.add, 2, 3).result() == 5
        assert set(client.sync(client.scheduler.goblin_report)) >= {"accepted", "rejected"}
        with pytest.raises(PermissionError, match="goblin_revoke"):
            client.sync(client.scheduler.goblin_revoke, name=lab.volunteer_names()[0])
    assert len(lab.volunteer_names()) >= 2


def test_connect_needs_a_credential(lab):
    with pytest.raises(ValueError, match="credential"):
        connect(lab.address)


def test_certificate_and_token_must_name_the_same_volunteer(lab):
    alice = Credential.decode(lab.enroll("alice2"))
    bob = Credential.decode(lab.enroll("bob2"))
    mixed = Credential(role="volunteer", name="alice2", ca=alice.ca, cert=bob.cert, key=bob.key, token=alice.token)
    proc = subprocess.run([sys.executable, "-m", "goblin_dask.volunteer", lab.address, "--host", "127.0.0.1"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "GOBLIN_TOKEN": mixed.encode()})
    assert proc.returncode == 2 and "does not match its token" in proc.stderr
