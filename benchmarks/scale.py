"""How many volunteers one lab node keeps busy: scheduler CPU per task, goblin plugins on and off (issue 19).

One run, on this machine:

* **plugins on**: ``LabNode.local(volunteers=V)`` (scheduler with the goblin plugins, TLS, the lab
  worker, V volunteer processes of 1 thread), and a graph of T small verified products: T catalog
  ``matmul`` tasks (64x64 @ 64x128 float32, 1.05e6 flops, so placed on volunteers) on 200 lab
  blocks, each followed by its Freivalds check on the lab worker (``insert_checks``);
* **plugins off**: a plain ``dask scheduler`` with V plain ``dask worker`` processes (1 thread, no
  nanny, no TLS), the same T ``matmul`` tasks without checks (there is no lab to check them).

For each: the scheduler process's CPU seconds while idle with all workers connected (heartbeats:
cost per volunteer per second) and while the T tasks run (submission to all in memory), from
``/proc/PID/stat``; net of the idle rate over that time, divided by T.  From those two numbers, the
volunteers one scheduler keeps busy with tasks of D seconds: ``N = 1 / (c / D + h)`` (c: scheduler
CPU seconds per task, h: idle CPU seconds per volunteer per second), i.e. where the scheduler's one
thread is saturated.  The lab worker's CPU per task (fetching results, checks) is reported too; for
real tasks of 1 s or 10 s it grows as their operands do (Freivalds: O(n^2) against O(n^3)).

Run: ``python benchmarks/scale.py [--volunteers 32 --tasks 10000 --write]``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import write_section  # noqa: E402

CLK = os.sysconf("SC_CLK_TCK")
SECTION = "## Scale: scheduler CPU per task, plugins on and off (issue 19)"
WAIT_S = 1800
BLOCKS = 100  # distinct lab blocks of A and of B: T = BLOCKS * (T / BLOCKS) products


def proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (float(fields[11]) + float(fields[12])) / CLK


def product_graph(tasks: int, *, checks: bool):
    """T products ``A_i @ B_j`` (64x64 @ 64x128 float32) on 2*BLOCKS source blocks, opaque keys; with the lab's checks."""
    from dask._task_spec import DataNode, TaskRef
    from dask.base import tokenize

    from goblin_dask.ops import CatalogTask, get
    from goblin_dask.validation.checks import insert_checks

    rng = np.random.default_rng(19)
    tok = tokenize("scale", tasks, checks, time.time())
    src_a, src_b, prod = f"source-{tok[:16]}", f"source-{tok[16:]}", f"matmul-{tok}"
    dsk: dict = {}
    for i in range(BLOCKS):
        dsk[(src_a, i)] = DataNode((src_a, i), rng.standard_normal((64, 64)).astype(np.float32))
        dsk[(src_b, i)] = DataNode((src_b, i), rng.standard_normal((64, 128)).astype(np.float32))
    keys = []
    for t in range(tasks):
        i, j = t % BLOCKS, (t // BLOCKS) % BLOCKS
        key = (prod, t)
        dsk[key] = CatalogTask(key, get("matmul"), TaskRef((src_a, i)), TaskRef((src_b, j)))
        keys.append(key)
    return (insert_checks(dsk, keys) if checks else dsk), keys


def measure(client, scheduler_pid: int, other_pids: dict, tasks: int, checks: bool, idle_s: float,
            volunteers: int) -> dict:
    from distributed import wait

    time.sleep(5.0)  # settle after the joins
    c0, t0 = proc_cpu(scheduler_pid), time.perf_counter()
    time.sleep(idle_s)
    idle_rate = (proc_cpu(scheduler_pid) - c0) / (time.perf_counter() - t0)  # scheduler cores busy while idle
    dsk, keys = product_graph(tasks, checks=checks)
    load0 = os.getloadavg()
    others0 = {k: proc_cpu(p) for k, p in other_pids.items()}
    c0, t0 = proc_cpu(scheduler_pid), time.perf_counter()
    futures = client.get(dsk, keys, sync=False)
    wait(futures, timeout=WAIT_S)  # a lost lab worker fails the run instead of hanging it
    wall = time.perf_counter() - t0
    cpu = proc_cpu(scheduler_pid) - c0
    others = {k: round(proc_cpu(p) - others0[k], 2) for k, p in other_pids.items()}
    workers_cpu = round(sum(v for k, v in others.items() if k.startswith("worker:")), 1)
    others = {k: v for k, v in others.items() if not k.startswith("worker:")}
    load1 = os.getloadavg()
    sample = client.gather(futures[:3])
    del futures
    assert all(s.shape == (64, 128) for s in sample)
    net = cpu - idle_rate * wall
    return {"tasks": tasks, "checks": checks, "volunteers": volunteers, "wall_s": round(wall, 2),
            "scheduler_cpu_s": round(cpu, 2), "scheduler_idle_cores": round(idle_rate, 4),
            "idle_per_volunteer": idle_rate / max(volunteers, 1),
            "scheduler_cpu_per_task_ms": 1000 * net / tasks, "others_cpu_s": others, "volunteers_cpu_s": workers_cpu,
            "load_before": [round(x, 2) for x in load0], "load_after": [round(x, 2) for x in load1]}


def run_on(volunteers: int, tasks: int, idle_s: float) -> dict:
    from goblin_dask.node.local import LabNode

    t = time.perf_counter()
    with LabNode.local(volunteers=volunteers, threads_per_volunteer=1, dashboard=False, timeout=600) as node:
        started = time.perf_counter() - t
        print(f"  plugins on: {volunteers} volunteers joined in {started:.0f} s", flush=True)
        before = node.report()
        vol_pids = {n: p.pid for n, p in node.processes.items() if n not in ("scheduler", "lab-worker")}
        pids = {"lab-worker": node.processes["lab-worker"].pid, **{f"worker:{n}": p for n, p in vol_pids.items()}}
        out = measure(node.client, node.processes["scheduler"].pid, pids, tasks, True, idle_s, volunteers)
        after = node.report()
        out["accepted"] = after["accepted"] - before["accepted"]
        out["rejected"] = after["rejected"] - before["rejected"]
        out["by_volunteer_min_max"] = [min(v["accepted"] for v in after["volunteers"].values()),
                                       max(v["accepted"] for v in after["volunteers"].values())]
        out["join_s"] = round(started, 1)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_off(volunteers: int, tasks: int, idle_s: float) -> dict:
    from distributed import Client

    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    tmp = Path(tempfile.mkdtemp(prefix="goblin-scale-"))
    procs: list[subprocess.Popen] = []
    log = open(tmp / "plain.log", "ab")
    try:
        procs.append(subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                                       "--port", str(port), "--no-dashboard"], stdout=log, stderr=log, env=env,
                                      cwd=tmp, start_new_session=True))
        for _ in range(volunteers):
            procs.append(subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", address, "--nthreads",
                                           "1", "--no-nanny", "--no-dashboard", "--host", "127.0.0.1",
                                           "--memory-limit", "2GB"], stdout=log, stderr=log, env=env, cwd=tmp,
                                          start_new_session=True))
        t = time.perf_counter()
        with Client(address, timeout=120) as client:
            client.wait_for_workers(volunteers, timeout=600)
            started = time.perf_counter() - t
            print(f"  plugins off: {volunteers} plain workers joined in {started:.0f} s", flush=True)
            out = measure(client, procs[0].pid, {f"worker:{i}": p.pid for i, p in enumerate(procs[1:])}, tasks,
                          False, idle_s, volunteers)
            out["join_s"] = round(started, 1)
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        log.close()
    return out


def busy(c_ms: float, h: float, seconds: float) -> float:
    """Volunteers (1 thread) one scheduler thread keeps busy with tasks of ``seconds``: N (c/D + h) = 1."""
    return 1.0 / (c_ms / 1000.0 / seconds + h)


def busy_heartbeats(c_ms: float, r: dict, seconds: float) -> float:
    """The same with distributed's heartbeat interval growing with N (``heartbeat_interval``): the idle
    cost measured at V workers is taken per heartbeat, and N volunteers send N / interval(N) a second."""
    from distributed.scheduler import heartbeat_interval

    v = r["volunteers"]
    per_beat = r["scheduler_idle_cores"] / (v / heartbeat_interval(v))
    lo, hi = 1, 10_000_000
    while lo < hi:  # the largest N whose load is within one core
        n = (lo + hi + 1) // 2
        if n * c_ms / 1000.0 / seconds + n / heartbeat_interval(n) * per_beat <= 1.0:
            lo = n
        else:
            hi = n - 1
    return lo


def markdown(command: str, on: dict, off: dict) -> str:
    lines = [SECTION, "", f"Command: `{command}`", "",
             f"Machine: {os.cpu_count()} cores, shared with other work (load averages below); all processes on it. "
             f"{on['tasks']} small products (64x64 @ 64x128 float32) on {on['volunteers']} one-thread volunteer "
             "processes.  Plugins on: the lab node (TLS, goblin plugins), each product verified by a Freivalds check "
             "on the lab worker (2 scheduler tasks per product).  Plugins off: plain dask scheduler and workers (TCP), "
             "the products alone.  Scheduler CPU is net of its idle rate (heartbeats) over the run.", "",
             "| | tasks | wall | scheduler CPU | scheduler CPU per product | scheduler idle, per worker | "
             "lab worker CPU | workers' CPU | accepted / rejected | load before → after |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for label, r in (("plugins on (verified)", on), ("plugins off (plain dask)", off)):
        lab = r["others_cpu_s"].get("lab-worker")
        lines.append(
            f"| {label} | {r['tasks']} | {r['wall_s']:.1f} s | {r['scheduler_cpu_s']:.1f} s | "
            f"**{r['scheduler_cpu_per_task_ms']:.2f} ms** | {1000 * r['idle_per_volunteer']:.2f} ms/s | "
            f"{'—' if lab is None else f'{lab:.1f} s'} | {r['volunteers_cpu_s']:.1f} s | "
            f"{r.get('accepted', '—')} / {r.get('rejected', '—')} | "
            f"{r['load_before'][0]:.2f} → {r['load_after'][0]:.2f} |")
    lines += ["", "Volunteers one lab node's scheduler keeps busy (one task thread each), `N = 1 / (c / D + h)` "
              "from the numbers above:", "",
              "| task length D | plugins on, h fixed | plugins off, h fixed | plugins on, heartbeats as distributed "
              "spaces them | plugins off, same |", "|---|---|---|---|---|"]
    for d in (1.0, 10.0):
        lines.append(f"| {d:g} s | {busy(on['scheduler_cpu_per_task_ms'], on['idle_per_volunteer'], d):,.0f} | "
                     f"{busy(off['scheduler_cpu_per_task_ms'], off['idle_per_volunteer'], d):,.0f} | "
                     f"{busy_heartbeats(on['scheduler_cpu_per_task_ms'], on, d):,} | "
                     f"{busy_heartbeats(off['scheduler_cpu_per_task_ms'], off, d):,} |")
    lines += ["", "h fixed: each volunteer costs the scheduler the idle CPU per worker measured here, whatever N "
              "(pessimistic).  distributed spaces heartbeats as the worker count grows (0.5 s up to 10 workers, 1 s "
              "up to 50, 2 s up to 200, then N/200 + 1 s: at most about 200 a second), so the second pair takes the "
              "measured idle cost per heartbeat instead."]
    lab = on["others_cpu_s"].get("lab-worker") or 0.0
    lines += ["", f"The lab worker spent {lab / on['tasks'] * 1000:.2f} ms of CPU per product here (fetching the "
              "result, the check, serving operands); at that rate its own cores bound the grid at "
              f"{1.0 / max(lab / on['tasks'], 1e-9):,.0f} tasks/s per core, but a real 1 s task's check is larger "
              "(Freivalds: O(n^2) per O(n^3) product), so the lab worker's cores must be sized with the tasks."]
    return "\n".join(lines) + "\n"


def _sigterm_exits() -> None:
    """SIGTERM (e.g. from ``timeout``) unwinds the with-blocks, so no grid process is left behind."""
    import signal

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--volunteers", type=int, default=32)
    p.add_argument("--tasks", type=int, default=10_000)
    p.add_argument("--idle", type=float, default=20.0, help="seconds of idle measurement")
    p.add_argument("--only", choices=("on", "off"), default=None)
    p.add_argument("--off-from", default=None, help="take the plugins-off numbers from this --json file")
    p.add_argument("--write", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    _sigterm_exits()
    print("load at start:", os.getloadavg(), flush=True)
    if args.off_from:
        with open(args.off_from) as f:
            off = json.load(f)["off"]
    else:
        off = run_off(args.volunteers, args.tasks, args.idle) if args.only in (None, "off") else None
    print("plugins off:", off, flush=True)
    on = run_on(args.volunteers, args.tasks, args.idle) if args.only in (None, "on") else None
    print("plugins on:", on, flush=True)
    if on and off:
        command = "python benchmarks/scale.py " + " ".join(argv if argv is not None else sys.argv[1:])
        text = markdown(command, on, off)
        print("\n" + text)
        if args.write:
            write_section(SECTION, text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"on": on, "off": off}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
