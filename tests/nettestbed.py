"""A lab and two volunteers at home, on this machine: network namespaces, NAT, home-broadband links.

Everything on 127.0.0.1 shares one network with no NAT, no latency and gigabytes per second; volunteers
live behind a router that masquerades them, with tens of megabits up and tens of milliseconds away.
:class:`Testbed` builds that from Linux network namespaces (root; ``ip`` and ``nft``)::

    research --lan-- lab --wan-- inet --+-- home1 (nft masquerade, no inbound) --lan-- vol1
    10.213.0.2        10.213.1.2  relay  +-- home2 (nft masquerade, no inbound) --lan-- vol2
                                                         10.213.100.1             10.213.100.2

* ``lab`` runs the real ``goblin node`` on its public address, with its two ports (the scheduler's and
  the lab worker's); ``research`` is a machine on the lab's network, where the researcher's client runs
  (:meth:`Testbed.client`: a ``distributed.Client`` whose sockets are made inside that namespace).
* ``inet`` routes between the lab and the homes' public addresses; it knows no route into a home.
* each ``home`` router masquerades its LAN (``nft``: ``masquerade`` on the way out; nothing new comes in)
  and shapes its link with ``tc tbf``: ``up`` Mbit/s leaving the home, ``down`` Mbit/s entering it.
* the kernel here has no ``netem``, so the delay is a relay in ``inet`` (:func:`serve_relay`): ``nft``
  redirects the homes' connections to the lab's two ports to it, and it forwards each chunk it reads
  ``delay`` seconds later, each way (the lab then sees the relay's address, as behind a carrier's NAT).

Both homes use the same LAN (10.213.100.0/24), as homes do.  Every address is inside the testbed's own
namespaces; names carry this process's pid and a random part (parallel and aborted runs never collide,
and :func:`sweep_abandoned` removes those of dead runs).  :meth:`Testbed.close` kills every process in
the namespaces and deletes them (their veths go with them).

Needs root, ``ip`` and ``tc`` (iproute2), ``nft`` (nftables) and ``conntrack``.  Run by hand::

    python tests/nettestbed.py             # build it, run a verified product, print the numbers, tear down
    python tests/nettestbed.py --shell     # build it and wait: `ip netns exec NAME ...` to look around
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PREFIX = "gnb"  # goblin network testbed: every namespace's name starts with it
LAB_PUBLIC = "10.213.1.2"
INET_LAB_SIDE = "10.213.1.1"
LAB_LAN, RESEARCH = "10.213.0.1", "10.213.0.2"
HOME_LAN_ROUTER, HOME_LAN_HOST = "10.213.100.1", "10.213.100.2"
SCHEDULER_PORT, LAB_WORKER_PORT, RELAY_PORT = 8786, 8788, 7400
CLONE_NEWNET = 0x40000000
SO_ORIGINAL_DST = 80


class TestbedUnavailable(RuntimeError):
    """This machine cannot build the testbed (not root, no ``ip``/``nft``, or namespaces refused)."""


def home_public(i: int) -> str:
    return f"10.213.{10 + i}.2"


def unavailable_reason() -> str | None:
    """Why the testbed cannot be built here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nft", "tc", "conntrack"):
        if shutil.which(tool) is None:
            return f"`{tool}` is missing (apt-get install iproute2 nftables conntrack)"
    probe = f"{PREFIX}-probe-{os.getpid()}-{secrets.token_hex(2)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    try:
        nft = subprocess.run(["ip", "netns", "exec", probe, "nft", "list", "ruleset"], capture_output=True, text=True)
        if nft.returncode != 0:
            return f"nft does not work in a namespace: {nft.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _run(*args: str, ns: str | None = None, stdin: str | None = None) -> str:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    done = subprocess.run(cmd, input=stdin, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete_namespace(ns: str) -> None:
    """Kill every process inside ``ns`` (they are the testbed's), then delete it (its veths go too)."""
    for _ in range(50):
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        time.sleep(0.1)
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def sweep_abandoned() -> list[str]:
    """Delete the namespaces of testbeds whose process is gone (a run killed before it tore down)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    gone = []
    for line in out.splitlines():
        ns = line.split()[0] if line.split() else ""
        parts = ns.split("-")
        if len(parts) >= 4 and parts[0] == PREFIX and parts[1].isdigit() and not _pid_alive(int(parts[1])):
            _delete_namespace(ns)
            gone.append(ns)
    return gone


# -- the delay: a relay in the "internet" -------------------------------------------------------

async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float, counted: list) -> None:
    """Copy reader -> writer, each chunk ``delay`` seconds after it arrived (a delay line, not stop-and-wait)."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=64)  # at most 64 chunks of 64 KiB in flight per direction
    loop = asyncio.get_running_loop()

    async def read():
        while True:
            chunk = await reader.read(65536)
            await queue.put((loop.time() + delay, chunk))
            if not chunk:
                return

    async def write():
        while True:
            due, chunk = await queue.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not chunk:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(chunk)
            counted[0] += len(chunk)
            await writer.drain()

    reading = asyncio.ensure_future(read())
    try:
        await write()
    finally:
        reading.cancel()


async def _relay_connection(reader, writer, delay: float, stats: dict) -> None:
    sock = writer.get_extra_info("socket")
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, packed = struct.unpack("!2xH4s8x", raw)
    target = socket.inet_ntoa(packed)
    client = writer.get_extra_info("peername")[0]
    try:
        up_reader, up_writer = await asyncio.open_connection(target, port)
    except OSError:
        writer.close()
        return
    counts = stats.setdefault(client, {"up": [0], "down": [0]})
    try:
        await asyncio.gather(_pump(reader, up_writer, delay, counts["up"]), _pump(up_reader, writer, delay, counts["down"]))
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        for w in (writer, up_writer):
            w.close()


def serve_relay(port: int, delay: float, stats_file: str | None = None) -> None:
    """Run the delay relay on ``port`` (inside ``inet``; ``nft`` redirects the homes' lab connections here).

    ``stats_file``: bytes relayed per home (by its public address), up and down, rewritten every second.
    """
    stats: dict = {}

    async def main():
        server = await asyncio.start_server(lambda r, w: _relay_connection(r, w, delay, stats), "0.0.0.0", port)
        async with server:
            while True:
                await asyncio.sleep(1.0)
                if stats_file:
                    tmp = stats_file + ".tmp"
                    Path(tmp).write_text(json.dumps({h: {d: c[0] for d, c in v.items()} for h, v in stats.items()}))
                    os.replace(tmp, stats_file)

    asyncio.run(main())


# -- the testbed --------------------------------------------------------------------------------

@dataclass
class Home:
    index: int
    router: str  # namespace names
    host: str
    public: str
    volunteer: str  # the volunteer's name (its credential's)
    process: subprocess.Popen | None = None
    log: Path | None = None


@dataclass
class Testbed:
    """The lab, the internet, two homes (see the module's docstring); ``close()`` removes all of it."""

    __test__ = False  # not a test class (pytest collects names starting with "Test")

    workdir: Path
    up_mbit: float | None = 50.0  # None: unshaped
    down_mbit: float | None = 200.0
    delay: float | None = 0.020  # seconds each way; None: no relay
    homes_count: int = 2
    env: dict = field(default_factory=dict)  # extra environment of the lab node (DASK_GOBLIN__... settings)
    volunteer_args: tuple = ("--nthreads", "1", "--memory-limit", "2GB")

    def __post_init__(self):
        self.workdir = Path(self.workdir)
        self.tag = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"
        self.lab, self.inet, self.research = f"{self.tag}-lab", f"{self.tag}-inet", f"{self.tag}-res"
        self.homes = [Home(i, f"{self.tag}-h{i}", f"{self.tag}-v{i}", home_public(i), f"vol{i}")
                      for i in range(1, self.homes_count + 1)]
        self.namespaces: list[str] = []
        self.processes: dict[str, subprocess.Popen] = {}
        self.state_dir = self.workdir / "lab-state"
        self.address = f"tls://{LAB_PUBLIC}:{SCHEDULER_PORT}"
        self.relay_stats = self.workdir / "relay-stats.json"
        self._clients: list = []

    # -- building ------------------------------------------------------------------------
    def start(self) -> "Testbed":
        why = unavailable_reason()
        if why is not None:
            raise TestbedUnavailable(why)
        sweep_abandoned()
        try:
            self._build_network()
            self.start_node()
            self.wait_for_node()
            for home in self.homes:
                self.start_volunteer(home)
            self.wait_for(lambda: set(self.volunteer_names()) >= {h.volunteer for h in self.homes},
                          "both volunteers to join", 180)
        except BaseException:
            self.close()
            raise
        return self

    def _netns(self, ns: str) -> None:
        _run("ip", "netns", "add", ns)
        self.namespaces.append(ns)
        _run("ip", "link", "set", "lo", "up", ns=ns)

    def _veth(self, ns_a: str, name_a: str, addr_a: str, ns_b: str, name_b: str, addr_b: str) -> None:
        _run("ip", "link", "add", name_a, "netns", ns_a, "type", "veth", "peer", "name", name_b, "netns", ns_b)
        for ns, name, addr in ((ns_a, name_a, addr_a), (ns_b, name_b, addr_b)):
            _run("ip", "addr", "add", addr, "dev", name, ns=ns)
            _run("ip", "link", "set", name, "up", ns=ns)

    def _build_network(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        for ns in (self.lab, self.inet, self.research, *(h.router for h in self.homes), *(h.host for h in self.homes)):
            self._netns(ns)
        self._veth(self.research, "lan", f"{RESEARCH}/24", self.lab, "lan", f"{LAB_LAN}/24")
        _run("ip", "route", "add", "default", "via", LAB_LAN, ns=self.research)
        self._veth(self.lab, "wan", f"{LAB_PUBLIC}/24", self.inet, "lab", f"{INET_LAB_SIDE}/24")
        _run("ip", "route", "add", "default", "via", INET_LAB_SIDE, ns=self.lab)
        for ns in (self.lab, self.inet, *(h.router for h in self.homes)):
            _run("sysctl", "-qw", "net.ipv4.ip_forward=1", ns=ns)
        for home in self.homes:
            i = home.index
            self._veth(self.inet, f"h{i}", f"10.213.{10 + i}.1/24", home.router, "wan", f"{home.public}/24")
            _run("ip", "route", "add", "default", "via", f"10.213.{10 + i}.1", ns=home.router)
            self._veth(home.router, "lan", f"{HOME_LAN_ROUTER}/24", home.host, "eth0", f"{HOME_LAN_HOST}/24")
            _run("ip", "route", "add", "default", "via", HOME_LAN_ROUTER, ns=home.host)
            _run("nft", "-f", "-", ns=home.router, stdin=f"""
table ip home {{
  chain postrouting {{ type nat hook postrouting priority srcnat; oifname "wan" masquerade; }}
  chain forward {{ type filter hook forward priority filter; policy drop;
    ct state established,related accept; iifname "lan" oifname "wan" accept; }}
  chain input {{ type filter hook input priority filter; policy accept;
    iifname "wan" ct state established,related accept; iifname "wan" drop; }}
  chain outage {{ type filter hook prerouting priority raw; }}
}}
""")
            self._shape(home)
        if self.delay is not None:
            _run("nft", "-f", "-", ns=self.inet, stdin=f"""
table ip relay {{
  chain prerouting {{ type nat hook prerouting priority dstnat;
    iifname "h*" ip daddr {LAB_PUBLIC} tcp dport {{ {SCHEDULER_PORT}, {LAB_WORKER_PORT} }} redirect to :{RELAY_PORT}; }}
}}
""")
            self.spawn("relay", self.inet, [sys.executable, str(Path(__file__).resolve()), "relay", "--port",
                                            str(RELAY_PORT), "--delay", str(self.delay), "--stats",
                                            str(self.relay_stats)])
            self.wait_for(lambda: self._listening(self.inet, RELAY_PORT), "the delay relay", 30)

    def _shape(self, home: Home) -> None:
        for dev, mbit in (("wan", self.up_mbit), ("lan", self.down_mbit)):
            if mbit is None:
                continue
            # burst: a few ms at the rate (and at least a few packets); latency: the queue a home router keeps
            burst = max(32 * 1024, int(mbit * 1e6 / 8 * 0.004))
            _run("tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit", "burst", str(burst),
                 "latency", "50ms", ns=home.router)
            # no segmentation offload: tbf then sees the packets the wire would carry
            subprocess.run(["ip", "netns", "exec", home.router, "ethtool", "-K", dev, "tso", "off", "gso", "off"],
                           capture_output=True)

    def _listening(self, ns: str, port: int) -> bool:
        out = subprocess.run(["ip", "netns", "exec", ns, "ss", "-Hltn", f"sport = :{port}"], capture_output=True,
                             text=True).stdout
        return bool(out.strip())

    # -- processes -----------------------------------------------------------------------
    def spawn(self, part: str, ns: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        log = self.workdir / f"{part}.log"
        environ = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        with open(log, "ab") as f:
            proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv], stdout=f, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, env=environ, cwd=str(self.workdir))
        self.processes[part] = proc
        return proc

    def stop(self, part: str, sig: int = signal.SIGTERM, timeout: float = 20) -> None:
        proc = self.processes.pop(part, None)
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass

    def start_node(self) -> None:
        """``goblin node`` in the lab namespace, on the lab's public address and its two ports."""
        self.spawn("node", self.lab, [sys.executable, "-m", "goblin_dask.cli", "node", "--host", LAB_PUBLIC,
                                      "--port", str(SCHEDULER_PORT), "--lab-worker-port", str(LAB_WORKER_PORT),
                                      "--no-dashboard", "--state-dir", str(self.state_dir)], env=self.env)

    def wait_for_node(self, timeout: float = 120) -> None:
        node = self.processes["node"]
        self.wait_for(lambda: (self.state_dir / "node.json").exists() and self._listening(self.lab, LAB_WORKER_PORT)
                      or node.poll() is not None, "the lab node and its lab worker", timeout)
        if node.poll() is not None:
            raise RuntimeError(f"goblin node exited with code {node.returncode}:\n{self.log_tail('node')}")

    def enroll(self, name: str, out: Path) -> Path:
        """``goblin enroll --name NAME --out FILE``: the credential file (mode 0600) a volunteer joins with."""
        subprocess.run([sys.executable, "-m", "goblin_dask.cli", "enroll", "--name", name, "--state-dir",
                        str(self.state_dir), "--out", str(out)], capture_output=True, text=True, check=True)
        return out

    def start_volunteer(self, home: Home, token: str | None = None) -> subprocess.Popen:
        """``goblin volunteer`` on the host behind ``home``'s router (its credential enrolled once; ``token``: join
        with that credential instead)."""
        token_file = self.workdir / f"{home.volunteer}.credential"
        if token is not None:
            token_file.unlink(missing_ok=True)
            token_file.touch(mode=0o600)
            token_file.write_text(token)
        elif not token_file.exists():
            self.enroll(home.volunteer, token_file)
        home.log = self.workdir / f"{home.volunteer}.log"
        home.process = self.spawn(home.volunteer, home.host, [
            sys.executable, "-m", "goblin_dask.cli", "volunteer", self.address, "--token", str(token_file),
            "--status-port", "-1", "--state-dir", str(self.workdir / "volunteers" / home.volunteer),
            *self.volunteer_args])
        return home.process

    def log_tail(self, part: str, lines: int = 30) -> str:
        path = self.workdir / f"{part}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    # -- links ---------------------------------------------------------------------------
    def link_down(self, home: Home) -> None:
        """The home's link goes silent both ways (no FIN, no RST reaches anyone: a router that reboots)."""
        _run("nft", "add", "rule", "ip", "home", "outage", "drop", ns=home.router)

    def link_up(self, home: Home, router_rebooted: bool = False) -> None:
        """The link carries packets again; ``router_rebooted``: the router forgot its NAT mappings (the
        lab's packets for the connections of before are dropped there, as new connections from outside)."""
        if router_rebooted:
            subprocess.run(["ip", "netns", "exec", home.router, "conntrack", "-F"], capture_output=True, check=True)
        _run("nft", "flush", "chain", "ip", "home", "outage", ns=home.router)

    def relayed_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes the relay carried per home (``{volunteer: {"up": ..., "down": ...}}``); about a second behind."""
        try:
            raw = json.loads(self.relay_stats.read_text())
        except (OSError, ValueError):
            return {}
        return {h.volunteer: raw.get(h.public, {"up": 0, "down": 0}) for h in self.homes}

    def try_connect(self, ns: str, host: str, port: int, timeout: float = 3.0) -> str | None:
        """None when a TCP connection from namespace ``ns`` to ``host:port`` opens, else why not."""
        code = (f"import socket,sys\ntry:\n socket.create_connection(({host!r},{port}),timeout={timeout}).close()\n"
                f"except OSError as e:\n print(type(e).__name__, e); sys.exit(1)")
        done = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code], capture_output=True, text=True)
        return None if done.returncode == 0 else (done.stdout.strip() or done.stderr.strip())

    # -- the researcher's side -------------------------------------------------------------
    def client(self, role: str = "researcher", **kwargs):
        """A ``distributed.Client`` from the lab's network (``research``): its loop thread, and so every
        socket it opens, lives in that namespace.  ``role``: "researcher" (a credential the lab issued)
        or "admin" (to read the lab's view: its workers, the report)."""
        from distributed import Client

        from goblin_dask.credentials import admin_credential, issue_credential

        credential = admin_credential(self.state_dir) if role == "admin" else \
            issue_credential(self.state_dir, "researcher", "researcher-1")
        made: dict = {}

        def make():
            try:
                enter_namespace(self.research)
                made["client"] = Client(self.address, security=credential.security(), timeout=60, **kwargs)
            except BaseException as e:  # handed to the caller's thread
                made["error"] = e

        thread = threading.Thread(target=make, name=f"client-in-{self.research}")
        thread.start()
        thread.join()
        if "error" in made:
            raise made["error"]
        self._clients.append(made["client"])
        return made["client"]

    def admin(self):
        if not hasattr(self, "_admin"):
            self._admin = self.client("admin", set_as_default=False)
        return self._admin

    def workers(self) -> dict[str, dict]:
        """The lab's view: worker address -> {"role", "name"}."""
        from goblin_dask.node import rpc

        admin = self.admin()
        return admin.sync(getattr(admin.scheduler, rpc.WORKERS))

    def volunteer_names(self) -> list[str]:
        try:
            return sorted(v["name"] for v in self.workers().values() if v["role"] == "volunteer")
        except OSError:
            return []

    def volunteer_address(self, name: str) -> str | None:
        try:
            return next((a for a, v in self.workers().items() if v["name"] == name), None)
        except OSError:  # the lab node restarting
            return None

    def report(self) -> dict:
        from goblin_dask.node import rpc

        admin = self.admin()
        return admin.sync(getattr(admin.scheduler, rpc.REPORT))

    def tasks_done(self, name: str) -> int:
        """Results of ``name`` the lab accepted (the ledger's count)."""
        return int(self.report()["volunteers"].get(name, {}).get("accepted", 0))

    def wait_for(self, predicate, what: str, timeout: float = 120, interval: float = 0.2) -> None:
        """Poll until ``predicate()``; a process of the testbed that exits meanwhile shows in the error."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {p} ---\n{self.log_tail(p, 12)}" for p in self.processes)
                raise AssertionError(f"timed out waiting for {what}\n{logs}")
            time.sleep(interval)

    # -- teardown ------------------------------------------------------------------------
    def close_clients(self) -> None:
        """Close the researcher's and the admin's clients (e.g. before the lab node restarts)."""
        for client in self._clients:
            try:
                client.close(timeout=5)
            except Exception:
                pass
        self._clients.clear()
        self.__dict__.pop("_admin", None)

    def close(self) -> None:
        """Stop every process and delete every namespace (their veths, rules and queues go with them)."""
        self.close_clients()
        for part in list(self.processes):
            self.stop(part, signal.SIGKILL, timeout=10)
        for ns in reversed(self.namespaces):
            _delete_namespace(ns)
        self.namespaces.clear()

    def __enter__(self) -> "Testbed":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def enter_namespace(ns: str) -> None:
    """Move the calling thread into network namespace ``ns`` (threads it starts later are born there)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns} failed")
    finally:
        os.close(fd)


# -- by hand ------------------------------------------------------------------------------------

def _product(client, n: int) -> dict:
    import numpy as np

    import goblin_dask.array as ga

    rng = np.random.default_rng(30)
    a, b = rng.standard_normal((n, n)), rng.standard_normal((n, n))
    t = time.perf_counter()
    c = (ga.from_array(a) @ ga.from_array(b)).compute()
    seconds = time.perf_counter() - t
    ref = a @ b
    return {"seconds": seconds, "max_relative_error": float(np.abs(c - ref).max() / np.abs(ref).max())}


def main(argv: list[str]) -> None:
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    relay = sub.add_parser("relay", help="(inside the testbed) the delay relay")
    relay.add_argument("--port", type=int, required=True)
    relay.add_argument("--delay", type=float, required=True)
    relay.add_argument("--stats", default=None)
    parser.add_argument("--shell", action="store_true", help="build it and wait for Ctrl-C")
    parser.add_argument("--n", type=int, default=1024, help="size of the verified product to run")
    parser.add_argument("--unshaped", action="store_true", help="no tbf, no delay")
    args = parser.parse_args(argv)
    if args.command == "relay":
        serve_relay(args.port, args.delay, args.stats)
        return
    with tempfile.TemporaryDirectory(prefix="goblin-testbed-") as work:
        shaped = not args.unshaped
        with Testbed(Path(work), up_mbit=50.0 if shaped else None, down_mbit=200.0 if shaped else None,
                     delay=0.020 if shaped else None) as bed:
            print(f"testbed {bed.tag}: lab node at {bed.address}; volunteers {bed.volunteer_names()}", flush=True)
            if args.shell:
                print("namespaces: " + " ".join(bed.namespaces) + "\nCtrl-C tears it down", flush=True)
                try:
                    while True:
                        time.sleep(3600)
                except KeyboardInterrupt:
                    return
            client = bed.client()
            result = _product(client, args.n)
            print(json.dumps({"n": args.n, **result, "relayed_bytes": bed.relayed_bytes(),
                              "report": {k: bed.report()[k] for k in ("tasks", "accepted", "rejected")}}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
