"""A researcher's one-task job latency, alone and while 10 volunteer credentials call ``who_has`` with 10,000
keys of 100 characters as fast as their answers come (issue 29 item 9): what the call budget by cost and the
scheduler's read rate per volunteer buy.  Run from the repository root:

    python benchmarks/starve.py
"""
import asyncio, operator, statistics, sys, tempfile, threading, time, pathlib
sys.path.insert(0, ".")
from distributed.comm import connect
from distributed.comm.core import CommClosedError
from goblin_dask.node.local import LabNode
from goblin_dask.tls import Credential

KEYS = [f"{i:0100d}" for i in range(10_000)]

def jobs(client, n=40):
    out = []
    for i in range(n):
        t = time.perf_counter()
        assert client.submit(operator.add, i, 1, pure=False).result() == i + 1
        out.append(time.perf_counter() - t)
    return out

async def attack(address, security, stop, counts):
    comm = await connect(address, **security.get_connection_args("worker"))
    try:
        while not stop.is_set():
            await comm.write({"op": "who_has", "keys": KEYS, "reply": True})
            answer = await comm.read()
            counts["refused" if isinstance(answer, dict) and answer.get("status") in ("error", "uncaught-error") else "ok"] += 1
    except (CommClosedError, OSError):
        counts["dropped"] += 1
    finally:
        comm.abort()

def run_attackers(address, creds, stop, counts):
    async def main():
        await asyncio.gather(*(attack(address, c.security(), stop, counts) for c in creds))
    asyncio.run(main())

with tempfile.TemporaryDirectory() as d, LabNode.local(volunteers=1, state_dir=pathlib.Path(d) / "lab", dashboard=False) as node:
    client = node.client
    jobs(client, 5)
    alone = jobs(client)
    creds = [Credential.decode(node.enroll()) for _ in range(10)]
    stop, counts = threading.Event(), {"ok": 0, "refused": 0, "dropped": 0}
    t = threading.Thread(target=run_attackers, args=(node.address, creds, stop, counts), daemon=True)
    t0 = time.perf_counter(); t.start(); time.sleep(3)
    under = jobs(client)
    stop.set(); t.join(60); took = time.perf_counter() - t0
    f = lambda xs: f"median {1000*statistics.median(xs):.1f} ms, worst {1000*max(xs):.1f} ms"
    print("alone:        ", f(alone))
    print("under attack: ", f(under))
    print(f"attack calls in {took:.1f} s: {counts}  banned: {[b['name'] for b in node.report()['bans']]}")
