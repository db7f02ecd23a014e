"""The volunteer link's speed: 256 MB lab -> volunteer and back, and tiny lab-side tasks.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/link.py --write

Three ways of moving the same array between two processes, measured in one run:

* **goblin link**: this process is a lab process (:func:`goblin_dask.link.install_lab_side`);
  the other is a volunteer whose server opens no socket (``nat://``): the lab reaches it
  over a standby connection it opened, and reads its answers as a :class:`VolunteerComm`
  (size caps, plain-data decoding);
* **distributed TLS**: distributed's own ``tls://`` comm between two plain ``Server``s;
* **ceiling**: a blocking Python ``ssl`` socket, ``sendall`` of a memoryview into ``recv_into``.

Each direction is the best of ``--repeats``; MB/s = 2**20 bytes per second.  Then
``--tasks`` (2000) tiny lab-side tasks on a whole local grid (``LabNode.local``), tasks
per second (``--tiny-only`` runs only that, e.g. against another checkout on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


# -- the volunteer's end (a subprocess) ----------------------------------------------------------

async def _volunteer(kind: str, lab: str, credential: str, nbytes: int) -> None:
    from distributed.core import Server
    from distributed.protocol import to_serialize

    from goblin_dask import link
    from goblin_dask.tls import Credential

    cred = Credential.load(credential)
    data = np.ones(nbytes // 8)

    def put(x=None):
        return int(x.nbytes)

    def get():
        return {"x": to_serialize(data)}

    server = Server({"put": put, "get": get})
    security = cred.security()
    if kind == "nat":
        link.install_volunteer_side()
        await server.listen(f"nat://{cred.name}", goblin_lab=lab, goblin_dial=security.get_connection_args("worker"),
                            **security.get_listen_args("worker"))
    else:
        await server.listen("tls://127.0.0.1:0", **security.get_listen_args("worker"))
    print(server.address, flush=True)
    await asyncio.Event().wait()


def _ssl_sink(port_file: str, certfile: str, keyfile: str, cafile: str, nbytes: int) -> None:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=cafile)
    ctx.load_cert_chain(certfile, keyfile)
    ctx.verify_mode = ssl.CERT_REQUIRED
    srv = socket.create_server(("127.0.0.1", 0))
    Path(port_file).write_text(str(srv.getsockname()[1]))
    buf = memoryview(bytearray(nbytes))
    while True:
        conn, _ = srv.accept()
        with ctx.wrap_socket(conn, server_side=True) as s:
            while True:
                got = 0
                while got < nbytes:
                    n = s.recv_into(buf[got:])
                    if n == 0:
                        break
                    got += n
                if got < nbytes:
                    break
                s.sendall(buf)  # and back


# -- measurements ----------------------------------------------------------------------------------

def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True)


async def _comm_rates(address: str, security, nbytes: int, repeats: int) -> tuple[float, float]:
    from distributed.comm import connect
    from distributed.protocol import to_serialize

    data = np.ones(nbytes // 8)
    comm = await connect(address, **security.get_connection_args("worker"))
    to_v, from_v = [], []
    try:
        for _ in range(repeats):
            t = time.perf_counter()
            await comm.write({"op": "put", "x": to_serialize(data)})
            assert await comm.read() == nbytes
            to_v.append(time.perf_counter() - t)
            t = time.perf_counter()
            await comm.write({"op": "get"})
            got = await comm.read()
            assert got["x"].nbytes == nbytes
            from_v.append(time.perf_counter() - t)
            del got
    finally:
        comm.abort()
    mb = nbytes / 2**20
    return mb / min(to_v), mb / min(from_v)


def _ceiling(creds: dict, tmp: Path, nbytes: int, repeats: int) -> tuple[float, float]:
    files = {}
    for role in ("lab", "volunteer"):
        for part in ("cert", "key"):
            files[role, part] = tmp / f"{role}.{part}.pem"
            files[role, part].write_text(getattr(creds[role], part))
    ca = tmp / "ca.pem"
    ca.write_text(creds["lab"].ca)
    port_file = tmp / "port"
    sink = _spawn("--ssl-sink", str(port_file), str(files["volunteer", "cert"]), str(files["volunteer", "key"]),
                  str(ca), str(nbytes))
    try:
        while not port_file.exists() or not port_file.read_text():
            time.sleep(0.05)
        ctx = ssl.create_default_context(cafile=str(ca))
        ctx.check_hostname = False
        ctx.load_cert_chain(str(files["lab", "cert"]), str(files["lab", "key"]))
        data = memoryview(np.ones(nbytes // 8).view(np.uint8))
        back = memoryview(bytearray(nbytes))
        to_v, from_v = [], []
        with ctx.wrap_socket(socket.create_connection(("127.0.0.1", int(port_file.read_text())))) as s:
            for _ in range(repeats):
                t = time.perf_counter()
                s.sendall(data)
                got = s.recv_into(back[:1])  # the sink starts answering only once it has it all
                to_v.append(time.perf_counter() - t)
                t = time.perf_counter()
                while got < nbytes:
                    got += s.recv_into(back[got:])
                from_v.append(time.perf_counter() - t)
    finally:
        sink.kill()
    mb = nbytes / 2**20
    return mb / min(to_v), mb / min(from_v)


def transfers(nbytes: int, repeats: int) -> dict[str, tuple[float, float]]:
    from distributed.core import Server

    from goblin_dask import link
    from goblin_dask.tls import LabCA

    tmp = Path(tempfile.mkdtemp(prefix="goblin-link-bench-"))
    ca = LabCA(tmp)
    creds = {"lab": ca.issue("lab", "lab-worker"), "volunteer": ca.issue("volunteer", "volunteer-bench")}
    lab_security = creds["lab"].security()
    out = {}

    async def run() -> None:
        # distributed's own TLS comm, before this process becomes a lab process
        plain = _spawn("--volunteer", "tls", "-", creds["volunteer"].encode(), str(nbytes))
        try:
            out["distributed TLS"] = await _comm_rates(plain.stdout.readline().strip(), lab_security, nbytes, repeats)
        finally:
            plain.kill()
        # the goblin link: a lab server the volunteer parks standby connections at
        link.install_lab_side()
        from goblin_dask.node import rpc

        lab = Server({rpc.LINK_ENDPOINTS: lambda: [lab.address]})
        await lab.listen("tls://127.0.0.1:0", **lab_security.get_listen_args("scheduler"))
        volunteer = _spawn("--volunteer", "nat", lab.address, creds["volunteer"].encode(), str(nbytes))
        try:
            address = await asyncio.get_running_loop().run_in_executor(None, volunteer.stdout.readline)
            out["goblin link"] = await _comm_rates(address.strip(), lab_security, nbytes, repeats)
        finally:
            volunteer.kill()
            lab.stop()

    asyncio.run(run())
    out["ceiling (blocking ssl socket)"] = _ceiling(creds, tmp, nbytes, repeats)
    return out


def tiny_tasks(n: int, repeats: int) -> float:
    """Tasks per second: ``n`` tiny tasks on the lab worker of a whole local grid."""
    import operator

    from goblin_dask.node.local import LabNode

    with LabNode.local(volunteers=1, dashboard=False) as node:
        client = node.client
        client.gather(client.map(operator.add, range(100), range(100), pure=False))  # warm up

        def once():
            futures = client.map(operator.add, range(n), range(n), pure=False)
            assert client.gather(futures)[-1] == 2 * (n - 1)
            del futures

        from benchmarks._results import best

        return n / best(once, repeats)


def blas() -> str:
    import threadpoolctl

    info = [d for d in threadpoolctl.threadpool_info() if d.get("user_api") == "blas"]
    return ", ".join(f"{d['internal_api']} {d['version']}, kernel {d.get('architecture')}" for d in info) or "none"


def main() -> None:
    if sys.argv[1:2] == ["--volunteer"]:
        kind, lab, credential, nbytes = sys.argv[2:6]
        asyncio.run(_volunteer(kind, lab, credential, int(nbytes)))
        return
    if sys.argv[1:2] == ["--ssl-sink"]:
        _ssl_sink(*sys.argv[2:6], int(sys.argv[6]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--tiny-only", action="store_true")
    parser.add_argument("--write", action="store_true", help="write the section of benchmarks/RESULTS.md")
    args = parser.parse_args()
    tasks = tiny_tasks(args.tasks, args.repeats)
    print(f"{args.tasks} tiny lab-side tasks: {tasks:.0f} tasks/s")
    if args.tiny_only:
        return
    rates = transfers(args.mb * 2**20, args.repeats)
    lines = [f"| {name} | {a:.0f} | {b:.0f} |" for name, (a, b) in rates.items()]
    print("\n".join(lines))
    if args.write:
        from benchmarks._results import write_section

        ratio = [rates["goblin link"][i] / rates["distributed TLS"][i] for i in (0, 1)]
        write_section("## The volunteer link (issue 15)", "\n".join([
            "## The volunteer link (issue 15)",
            "",
            "Command: `env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/link.py --write`",
            "",
            f"Machine: {os.cpu_count()} cores; BLAS (threadpoolctl): {blas()}.  {args.mb} MB of float64, "
            f"best of {args.repeats}, MB/s (2**20 bytes/s), one run:",
            "",
            "| path | lab -> volunteer MB/s | volunteer -> lab MB/s |",
            "|---|---|---|",
            *lines,
            "",
            f"goblin link / distributed TLS: {ratio[0]:.2f}x lab -> volunteer, {ratio[1]:.2f}x volunteer -> lab.",
            "",
            f"{args.tasks} tiny lab-side tasks on `LabNode.local(volunteers=1)`: {tasks:.0f} tasks/s (best of "
            f"{args.repeats}).",
        ]))


if __name__ == "__main__":
    main()
