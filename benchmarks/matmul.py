"""Verified matrix product on the embedded grid vs numpy and plain dask.array (issue 3).

One run, on this machine, side by side:

* numpy ``a @ b`` with 2 BLAS threads (the benchmark process),
* the grid: ``goblin_dask.LabNode.local(volunteers=2, threads_per_volunteer=1)``, ``ga`` matmul,
  every block product Freivalds-checked on the lab worker,
* plain ``dask.array`` matmul on a 2-worker ``distributed.LocalCluster`` (1 thread each),
  with the same blocks as the grid's product.

For n = 8192 and 4096, float64 and float32.  Inputs are persisted first (that transfer is
timed on its own); then ``(x @ y).compute()`` (result returned to the client) and
``(x @ y).persist()`` + wait (product and verification only) are timed, best of
``--repeats``.  Each result is compared with numpy's.  Per timed section it prints the
load average and the busy CPU of the machine just before, the CPU seconds each process
spent, and (grid) a breakdown from the task stream: volunteer compute, block transfers,
Freivalds checks on the lab worker, gather to the client.

Run: ``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE /work/venv/bin/python benchmarks/matmul.py``

``--from-numpy`` runs issue 19's case instead (:func:`from_numpy_case`): ``ga.from_array`` of numpy
inputs, no persist, ``compute()`` twice, next to numpy and to plain dask with persisted inputs,
with the load average before and after each column (its own RESULTS.md section).

``--lab-share`` runs issue 28's case (:func:`lab_share_case`): the 4096 float32 (and float64) product from
numpy on ``LabNode.local(volunteers=2)``, computed once and then ``--repeats`` times more; for those later
computes (medians) it prints the CPU seconds of each process (scheduler, lab worker, the researcher's process, each volunteer) next to numpy's own CPU
for the product (one BLAS thread), the bytes the lab worker sent and received, the volunteer tasks and the
lab <-> volunteer round trips on the longest chain of dependent volunteer tasks (its own RESULTS.md section).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _results import write_section  # noqa: E402
from capture import process_cpu, volunteer_chains  # noqa: E402

CLK = os.sysconf("SC_CLK_TCK")
SECTION = "## Matrix product (issue 3)"


# -- machine state ------------------------------------------------------------------------

def _cpu_totals() -> tuple[float, float]:
    with open("/proc/stat") as f:
        parts = [float(x) for x in f.readline().split()[1:]]
    idle = parts[3] + parts[4]
    return sum(parts), idle


def busy_cores(seconds: float = 1.0) -> float:
    """Cores busy (all processes) over the last ``seconds``."""
    t0, i0 = _cpu_totals()
    time.sleep(seconds)
    t1, i1 = _cpu_totals()
    ncpu = os.cpu_count() or 1
    return ncpu * (1.0 - (i1 - i0) / max(t1 - t0, 1e-9))


BUSY_THRESHOLD = 0.35


def quiet_machine(label: str, log: list, max_wait: float = 45.0, threshold: float | None = None) -> dict:
    """Wait (up to ``max_wait`` s) until under ``threshold`` cores are busy; note the load."""
    threshold = BUSY_THRESHOLD if threshold is None else threshold
    waited = 0.0
    busy = busy_cores()
    while busy > threshold and waited < max_wait:
        time.sleep(4.0)
        waited += 5.0
        busy = busy_cores()
    la = os.getloadavg()
    entry = {"section": label, "loadavg": [round(x, 2) for x in la], "busy_cores": round(busy, 2),
             "waited_s": waited}
    log.append(entry)
    print(f"    [{label}] loadavg {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}, busy cores {busy:.2f}"
          + (f", waited {waited:.0f} s" if waited else ""), flush=True)
    return entry


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` so far."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (float(fields[11]) + float(fields[12])) / CLK
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return float("nan")


class CpuMeter:
    def __init__(self, pids: dict[str, int]):
        self.pids = pids

    def __enter__(self):
        self.start = {k: proc_cpu(p) for k, p in self.pids.items()}
        return self

    def __exit__(self, *exc):
        self.used = {k: proc_cpu(p) - self.start[k] for k, p in self.pids.items()}


def max_rel_error(c, ref) -> float:
    c = np.asarray(c)
    scale = float(np.abs(ref).max())
    return float(np.abs(c.astype(np.float64) - ref.astype(np.float64)).max() / scale)


# -- BLAS info --------------------------------------------------------------------------------

def blas_info() -> list[dict]:
    import threadpoolctl

    return [{k: d.get(k) for k in ("internal_api", "architecture", "num_threads", "version", "threading_layer")}
            for d in threadpoolctl.threadpool_info()]


_VOLUNTEER_PROBE = """
import json, threadpoolctl
from goblin_dask.volunteer import prepare_process
prepare_process(False)
print(json.dumps([{k: d.get(k) for k in ("internal_api", "architecture", "num_threads", "version")}
                  for d in threadpoolctl.threadpool_info()]))
"""


def volunteer_blas_probe() -> list[dict]:
    """threadpool_info() in a process started like LabNode.local starts a volunteer.

    A volunteer refuses ``client.run``, so this replays its start: same interpreter, same
    environment (``os.environ`` + PYTHONUNBUFFERED), same ``prepare_process``.
    """
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    out = subprocess.run([sys.executable, "-c", _VOLUNTEER_PROBE], env=env, capture_output=True, text=True,
                         timeout=300)
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return [{"error": out.stderr[-500:]}]


def env_threads(pid: int) -> dict:
    keys = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(x.split(b"=", 1) for x in f.read().split(b"\0") if b"=" in x)
    except OSError:
        return {}
    return {k: env.get(k.encode(), b"<unset>").decode() for k in keys}


def dask_worker_blas() -> list[dict]:
    import threadpoolctl

    return [{k: d.get(k) for k in ("internal_api", "architecture", "num_threads")}
            for d in threadpoolctl.threadpool_info()]


# -- task stream breakdown --------------------------------------------------------------------

def grid_breakdown(stream: list[dict], lab_addr: str, volunteer_addrs: set, t_start: float, t_end: float) -> dict:
    """Seconds of each kind of work in one grid run, from the task stream.

    vol_compute: sum over volunteer product tasks; vol_transfer_in: blocks fetched by
    volunteers (from the lab worker, TLS); lab_check: Freivalds checks (check tasks on the
    lab worker); lab_transfer_in: results fetched by the lab worker from volunteers;
    first_task: submit + schedule until the first task starts; tail: end of the last task
    until the client has the result (gather of the result to the client, finalize).
    """
    out = defaultdict(float)
    others: set = set()
    first, last = float("inf"), 0.0
    for rec in stream:
        w = rec.get("worker")
        key = rec.get("key")
        name = key[0] if isinstance(key, (tuple, list)) else str(key)
        name = name[0] if isinstance(name, (tuple, list)) else name
        for ss in rec.get("startstops", ()):
            dur = ss["stop"] - ss["start"]
            first, last = min(first, ss["start"]), max(last, ss["stop"])
            act = ss["action"]
            if w in volunteer_addrs:
                where = "vol"
            elif w == lab_addr:
                where = "lab"
            else:
                where = "other"
            if act == "compute":
                if where == "vol":
                    out["vol_compute"] += dur
                elif str(name).startswith("matmul"):
                    out["lab_check"] += dur
                else:
                    out["lab_other_compute"] += dur
                    others.add(str(name).split("-")[0])
            elif act == "transfer":
                out[f"{where}_transfer_in"] += dur
            else:
                out[f"{where}_{act}"] += dur
    out["first_task"] = (first - t_start) if first != float("inf") else float("nan")
    out["tail"] = t_end - last if last else float("nan")
    out["span"] = (last - first) if last else float("nan")
    res = {k: round(v, 2) for k, v in out.items()}
    if others:
        res["lab_other_ops"] = sorted(others)
    return res


def dask_breakdown(stream: list[dict], t_start: float, t_end: float) -> dict:
    out = defaultdict(float)
    first, last = float("inf"), 0.0
    for rec in stream:
        for ss in rec.get("startstops", ()):
            first, last = min(first, ss["start"]), max(last, ss["stop"])
            out[ss["action"]] += ss["stop"] - ss["start"]
    out["first_task"] = (first - t_start) if first != float("inf") else float("nan")
    out["tail"] = t_end - last if last else float("nan")
    out["span"] = (last - first) if last else float("nan")
    return {k: round(v, 2) for k, v in out.items()}


# -- report ---------------------------------------------------------------------------------

def markdown(command: str, info: dict, results: list[dict]) -> str:
    """The RESULTS.md section: command, machine, the table, and where the grid's time went."""
    blas = info["numpy_blas"][0] if info["numpy_blas"] else {}
    vol = next((d for d in info["volunteer_blas_probe"] if d.get("internal_api") not in ("openmp",)), {})
    lines = [SECTION, "", f"Command: `{command}`", "",
             f"Machine: {os.cpu_count()} cores, {_cpu_model()}; BLAS (threadpoolctl): {blas.get('internal_api')} "
             f"{blas.get('version')}, kernel {blas.get('architecture')}; numpy with {blas.get('num_threads')} threads, "
             f"each volunteer and each dask worker with {vol.get('num_threads')} (1 task thread each).  "
             "Inputs are persisted first (their transfer is timed apart: for the grid it lands on the lab worker, "
             "which holds the lab's data; for dask on its workers).  Times are the best of the repeats; "
             "speed = numpy's time / that time (target for the grid: at least 0.8x).", "",
             "| n | dtype | blocks (bm, bk, bn) | numpy 2 threads | grid, verified (`compute()`) | grid / numpy "
             "| grid `persist()` | dask LocalCluster 2x1 | dask / numpy | grid max rel. error |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        dask_cols = (f"{r['dask']:.2f} s | {r['dask_vs_numpy']:.2f}x" if r["dask"] == r["dask"] else "— | —")
        lines.append(f"| {r['n']} | {r['dtype']} | {tuple(r['blocks'])} | {r['numpy']:.2f} s | {r['grid']:.2f} s "
                     f"| **{r['grid_vs_numpy']:.2f}x** | {r['grid_persist']:.2f} s | {dask_cols} | {r['grid_err']:.1e} |")
    lines += ["", "Where the grid's time went (best run; seconds summed over processes, from the task stream and "
              "/proc CPU times):", "",
              "| n | dtype | volunteer compute | volunteer fetch of blocks | lab fetch of results | Freivalds checks "
              "| gather to client | span of tasks | CPU s: volunteers / lab / scheduler / client "
              "| volunteer results accepted / rejected (all repeats) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        b, c = r["grid_breakdown"], r["grid_cpu"]
        vols = sum(v for k, v in c.items() if k.startswith("volunteer"))
        lines.append(f"| {r['n']} | {r['dtype']} | {b.get('vol_compute', 0):.1f} | {b.get('vol_transfer_in', 0):.1f} "
                     f"| {b.get('lab_transfer_in', 0):.1f} | {b.get('lab_check', 0):.1f} | {b.get('tail', 0):.1f} "
                     f"| {b.get('span', 0):.1f} | {vols:.1f} / {c.get('lab-worker', 0):.1f} / {c.get('scheduler', 0):.1f}"
                     f" / {c.get('client', 0):.1f} | {r['grid_report']['accepted']} / {r['grid_report']['rejected']} |")
    return "\n".join(lines) + "\n"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown processor"


# -- the benchmark ----------------------------------------------------------------------------

def timed_products(label: str, run, ref, client, pids: dict, repeats: int, loads: list, what: str,
                   breakdown) -> dict:
    """Best of ``repeats`` runs of ``run()`` (a product returned to the client), each checked against ``ref``,
    with the task-stream ``breakdown`` and the CPU seconds of ``pids``; keys prefixed by ``label``."""
    from distributed import get_task_stream

    times, errs, breakdowns, cpus = [], [], [], []
    for _ in range(repeats):
        quiet_machine(f"{label} compute {what}", loads)
        with CpuMeter(pids) as cm, get_task_stream(client=client) as ts:
            t, t_wall = time.perf_counter(), time.time()
            c = run()
            dur, t_wall_end = time.perf_counter() - t, time.time()
        times.append(dur)
        errs.append(max_rel_error(c, ref))
        del c
        breakdowns.append(breakdown(ts.data, t_wall, t_wall_end))
        cpus.append({k: round(v, 2) for k, v in cm.used.items()})
        print(f"  {label} compute: {dur:.2f} s, err {errs[-1]:.2e}, {breakdowns[-1]}, cpu {cpus[-1]}", flush=True)
    best = int(np.argmin(times))
    return {label: times[best], f"{label}_all": times, f"{label}_err": max(errs),
            f"{label}_breakdown": breakdowns[best], f"{label}_cpu": cpus[best]}


def timed_persist(label: str, persist, repeats: int, loads: list, what: str) -> float | None:
    """Best of ``repeats``: ``persist()`` and wait until the product is in memory (not returned to the client)."""
    from distributed import wait

    times = []
    for _ in range(repeats):
        quiet_machine(f"{label} persist {what}", loads)
        t = time.perf_counter()
        z = persist()
        wait(z)
        times.append(time.perf_counter() - t)
        del z
        time.sleep(0.5)
    print(f"  {label} persist: {', '.join(f'{v:.2f}' for v in times)} s", flush=True)
    return min(times) if times else None


SECTION_19 = "## Matrix product from numpy inputs (issue 19)"


def _load() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def from_numpy_case(n: int, dt, *, chunks: int, repeats: int, node, dclient, rng, log: list) -> dict:
    """Issue 19's case: ``ga.from_array`` of numpy inputs, no persist, ``compute()`` twice.

    Columns, each with the load average before and after: numpy 2 threads (best of ``repeats``);
    the grid's first compute (``from_array`` of both inputs, hashing and upload to the lab worker
    included) and second compute of the same expression (reuses the lab's copies); plain dask on
    the 2x1 LocalCluster with its inputs persisted first (best of ``repeats``).
    """
    import threadpoolctl
    import dask.array as da
    from distributed import wait

    import goblin_dask.array as ga

    a = rng.standard_normal((n, n)).astype(dt)
    b = rng.standard_normal((n, n)).astype(dt)
    row: dict = {"n": n, "dtype": str(dt), "chunks": chunks, "load": {}}

    row["load"]["numpy"] = [_load()]
    times = []
    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
        for _ in range(repeats):
            t = time.perf_counter()
            ref = a @ b
            times.append(time.perf_counter() - t)
    row["load"]["numpy"].append(_load())
    row["numpy"] = min(times)
    print(f"  numpy: {', '.join(f'{v:.2f}' for v in times)} s, load {row['load']['numpy']}", flush=True)

    rep0 = node.report()
    row["load"]["grid"] = [_load()]
    t = time.perf_counter()
    x, y = ga.from_array(a, chunks=chunks), ga.from_array(b, chunks=chunks)
    row["grid_from_array"] = time.perf_counter() - t
    z = x @ y
    c = z.compute()
    row["grid_first"] = time.perf_counter() - t
    row["grid_err_first"] = max_rel_error(c, ref)
    del c
    row["load"]["grid"].append(_load())
    row["load"]["grid2"] = [_load()]
    t = time.perf_counter()
    c = z.compute()
    row["grid_second"] = time.perf_counter() - t
    row["load"]["grid2"].append(_load())
    row["grid_err_second"] = max_rel_error(c, ref)
    del c, z, x, y
    rep1 = node.report()
    row["grid_report"] = {"accepted": rep1["accepted"] - rep0["accepted"], "rejected": rep1["rejected"] - rep0["rejected"]}
    print(f"  grid: from_array {row['grid_from_array']:.2f} s, first compute (incl. from_array) {row['grid_first']:.2f} s, "
          f"second {row['grid_second']:.2f} s, err {row['grid_err_first']:.1e}/{row['grid_err_second']:.1e}, "
          f"{row['grid_report']}, load {row['load']['grid']} {row['load']['grid2']}", flush=True)
    time.sleep(1.0)

    import warnings

    xd, yd = da.from_array(a, chunks=chunks), da.from_array(b, chunks=chunks)
    with warnings.catch_warnings():  # dask's own persist embeds the inputs (its "large graph", not timed)
        warnings.filterwarnings("ignore", message="Sending large graph")
        xd, yd = dclient.persist([xd, yd])
        wait([xd, yd])
    row["load"]["dask"] = [_load()]
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        c = dclient.compute(xd @ yd).result()
        times.append(time.perf_counter() - t)
    row["load"]["dask"].append(_load())
    row["dask"] = min(times)
    row["dask_err"] = max_rel_error(c, ref)
    del c, xd, yd
    print(f"  dask (inputs persisted): {', '.join(f'{v:.2f}' for v in times)} s, load {row['load']['dask']}", flush=True)
    log.append(row)
    return row


def markdown_19(command: str, info: dict, rows: list[dict], section: str = SECTION_19) -> str:
    blas = info["numpy_blas"][0] if info["numpy_blas"] else {}
    fmt = lambda pair: " → ".join(f"{v[0]:.2f}" for v in pair)  # noqa: E731  (1-minute load, before → after)
    lines = [section, "", f"Command: `{command}`", "",
             f"Machine: {os.cpu_count()} cores (shared with other work: see the load averages), {_cpu_model()}; "
             f"BLAS (threadpoolctl): {blas.get('internal_api')} {blas.get('version')}, kernel "
             f"{blas.get('architecture')}; numpy with 2 threads; grid: LabNode.local(volunteers=2, 1 thread each), "
             f"`goblin.minimization.max-share` = {info.get('max_share')}; "
             "dask: LocalCluster 2 workers x 1 thread, inputs persisted first (not timed).  The grid starts from "
             "numpy arrays, as a new user would: `z = ga.from_array(a, chunks=c) @ ga.from_array(b, chunks=c)`, "
             "`z.compute()` twice; the first includes `from_array` (hashing both inputs and sending them to the "
             "lab worker once), the second reuses the lab's copies.  Speed = numpy's time / that time.  Load: "
             "1-minute load average before → after each column.", "",
             "| n | dtype | chunks | numpy 2 threads | grid 1st compute (from numpy) | grid 2nd compute | grid 2nd / numpy "
             "| dask 2x1, persisted | grid 2nd / dask | of which `from_array` | accepted / rejected | max rel. error "
             "| load: numpy; grid 1st; grid 2nd; dask |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ld = r["load"]
        lines.append(
            f"| {r['n']} | {r['dtype']} | {r['chunks']} | {r['numpy']:.2f} s | {r['grid_first']:.2f} s "
            f"({r['numpy'] / r['grid_first']:.2f}x) | {r['grid_second']:.2f} s | **{r['numpy'] / r['grid_second']:.2f}x** "
            f"| {r['dask']:.2f} s ({r['numpy'] / r['dask']:.2f}x) | **{r['dask'] / r['grid_second']:.2f}x** "
            f"| {r['grid_from_array']:.2f} s | {r['grid_report']['accepted']} / {r['grid_report']['rejected']} "
            f"| {max(r['grid_err_first'], r['grid_err_second']):.1e} "
            f"| {fmt(ld['numpy'])}; {fmt(ld['grid'])}; {fmt(ld['grid2'])}; {fmt(ld['dask'])} |")
    return "\n".join(lines) + "\n"


def main_19(args, argv) -> int:
    """``--from-numpy``: issue 19's case (see :func:`from_numpy_case`), its own RESULTS.md section."""
    import distributed
    from distributed import Client, LocalCluster

    import goblin_dask

    import dask

    cases = [(int(c.split(":")[0]), np.dtype(c.split(":")[1])) for c in args.cases.split(",")]
    info = {"numpy_blas": blas_info()}
    if args.max_share is not None:  # before the node starts: it takes the caller's goblin.* config
        dask.config.set({"goblin.minimization.max-share":
                         None if args.max_share.lower() == "none" else float(args.max_share)})
    info["max_share"] = dask.config.get("goblin.minimization.max-share", None)
    print("BLAS, benchmark process (numpy):", info["numpy_blas"], flush=True)
    rows: list[dict] = []
    rng = np.random.default_rng(0)
    with goblin_dask.LabNode.local(volunteers=2, threads_per_volunteer=1) as node, \
            LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster, \
            Client(cluster, set_as_default=False) as dclient:
        assert distributed.default_client() is node.client
        for n, dt in cases:
            chunks = args.chunks or max(n // 4, 1)
            print(f"\n== n={n} {dt}, chunks={chunks}", flush=True)
            from_numpy_case(n, dt, chunks=chunks, repeats=args.repeats, node=node, dclient=dclient, rng=rng, log=rows)
    command = "env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/matmul.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    section = SECTION_19 if args.max_share is None else f"{SECTION_19[:-1]}, max-share {args.max_share})"
    text = markdown_19(command, info, rows, section)
    print("\n" + text)
    if args.write:
        write_section(section, text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "results": rows}, f, indent=1, default=str)
    return 0


SECTION_28 = "## The lab's share of a verified product (issue 28)"


def lab_worker_traffic(dask_worker=None) -> dict:
    """On the lab worker (``client.run``): bytes it sent to and received from peers so far."""
    from distributed import get_worker

    w = dask_worker or get_worker()
    return {"sent": int(w.transfer_outgoing_bytes_total),
            "received": int(sum(e.get("total", 0) for e in w.transfer_incoming_log)),
            "received_log": len(w.transfer_incoming_log), "sent_log": len(w.transfer_outgoing_log)}


def lab_share_case(n: int, dt, *, chunks: int, node, rng, repeats: int = 3) -> dict:
    """Issue 28's case: ``ga.from_array(a) @ ga.from_array(b)`` computed once, then ``repeats`` times more;
    the later computes' CPU per process (median of each), bytes through the lab worker, volunteer tasks
    and round trips, next to numpy's CPU."""
    import threadpoolctl
    from distributed import get_task_stream

    import goblin_dask.array as ga

    a = rng.standard_normal((n, n)).astype(dt)
    b = rng.standard_normal((n, n)).astype(dt)
    with threadpoolctl.threadpool_limits(limits=1, user_api="blas"):
        t = time.process_time()
        ref = a @ b
        numpy_cpu = time.process_time() - t
    client, lab = node.client, node.lab_worker_address()
    vol_addrs = set(node.volunteer_addresses().values())
    z = ga.from_array(a, chunks=chunks) @ ga.from_array(b, chunks=chunks)
    graph = z.__dask_optimize__(dict(z.__dask_graph__()), z.__dask_keys__())
    chains = volunteer_chains(dict(graph))
    c = z.compute()
    err_first = max_rel_error(c, ref)
    del c
    runs = []
    for _ in range(repeats):  # each a second (or later) compute of the same expression
        time.sleep(1.0)
        rep0 = node.report()
        net0 = client.run(lab_worker_traffic, workers=[lab])[lab]
        cpu0 = process_cpu(node, each=True, researcher=True)
        t = time.perf_counter()
        c = z.compute()
        wall = time.perf_counter() - t
        cpu1 = process_cpu(node, each=True, researcher=True)
        net1 = client.run(lab_worker_traffic, workers=[lab])[lab]
        rep1 = node.report()
        err_first = max(err_first, max_rel_error(c, ref))
        del c
        runs.append({"wall": wall, "cpu": {k: cpu1[k] - cpu0.get(k, 0.0) for k in cpu1},
                     "sent": net1["sent"] - net0["sent"], "received": net1["received"] - net0["received"],
                     "check_cpu": rep1["seconds"]["check_cpu"] - rep0["seconds"]["check_cpu"],
                     "accepted": rep1["accepted"] - rep0["accepted"], "rejected": rep1["rejected"] - rep0["rejected"]})
    with get_task_stream(client=client) as ts:  # one more, apart: the stream costs the scheduler and this process
        z.compute()
    ran_on_volunteers = sum(1 for rec in ts.data if rec.get("worker") in vol_addrs)
    med = lambda xs: float(np.median(xs))  # noqa: E731
    cpu = {k: med([r["cpu"].get(k, 0.0) for r in runs]) for k in runs[0]["cpu"]}
    row = {"n": n, "dtype": str(dt), "chunks": chunks, "numpy_cpu": numpy_cpu, "repeats": repeats,
           "wall": med([r["wall"] for r in runs]), "cpu": cpu, "check_cpu": med([r["check_cpu"] for r in runs]),
           "sent": med([r["sent"] for r in runs]), "received": med([r["received"] for r in runs]),
           "err": err_first, "stream_volunteer_tasks": ran_on_volunteers, **chains,
           "accepted": sum(r["accepted"] for r in runs), "rejected": sum(r["rejected"] for r in runs),
           "runs": runs}
    lab_cpu = cpu.get("scheduler", 0.0) + cpu.get("lab worker", 0.0) + cpu.get("researcher", 0.0)
    row["lab_cpu"], row["lab_vs_numpy"] = lab_cpu, lab_cpu / numpy_cpu
    print(f"  {n} {dt}: " + str({k: v for k, v in row.items() if k != "runs"}), flush=True)
    return row


def markdown_28(command: str, rows: list[dict]) -> str:
    lines = [SECTION_28, "", f"Command: `{command}`", "",
             f"Machine: {os.cpu_count()} cores (shared), {_cpu_model()}.  `z = ga.from_array(a, chunks=c) @ "
             "ga.from_array(b, chunks=c)` on `LabNode.local(volunteers=2, threads_per_volunteer=1)`, computed "
             "once and then `--repeats` times more; the numbers are the median of the later computes (each process's CPU a median of its own).  CPU seconds per process (psutil, user + system); "
             "lab = scheduler + lab worker + the researcher's process; numpy = `time.process_time()` of `a @ b` "
             "in the benchmark process, one BLAS thread.  Bytes: the lab worker's transfers (distributed's "
             "`transfer_outgoing_bytes_total` and `transfer_incoming_log`); what it sends includes the result the researcher gathers (64 MiB in float32); the volunteers keep the input blocks of the first compute (the volunteer cache), so later computes send them none.  Round trips: lab -> volunteer -> "
             "lab trips on the longest chain of dependent volunteer tasks (a volunteer task fed by another "
             "volunteer result on the same path adds none).", "",
             "| n | dtype | chunks | scheduler | lab worker | researcher | volunteers (each) | numpy CPU "
             "| **lab / numpy** | of which checks (lab worker thread CPU) | lab worker sent / received | volunteer tasks (graph / ran) | round trips | accepted / rejected "
             "| wall | max rel. error |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r["cpu"]
        vols = sorted((k, v) for k, v in c.items() if k not in ("scheduler", "lab worker", "researcher"))
        lines.append(
            f"| {r['n']} | {r['dtype']} | {r['chunks']} | {c.get('scheduler', 0):.2f} | {c.get('lab worker', 0):.2f} "
            f"| {c.get('researcher', 0):.2f} | {' + '.join(f'{v:.2f}' for _, v in vols)} | {r['numpy_cpu']:.2f} "
            f"| **{r['lab_vs_numpy']:.2f}x** | {r['check_cpu']:.2f} | {r['sent'] / 2**20:.0f} / {r['received'] / 2**20:.0f} MiB "
            f"| {r['volunteer_tasks']} / {r['stream_volunteer_tasks']} | {r['round_trips']} | {r['accepted']} / {r['rejected']} | {r['wall']:.2f} s "
            f"| {r['err']:.1e} |")
    return "\n".join(lines) + "\n"


def main_28(args, argv) -> int:
    """``--lab-share``: issue 28's case (see :func:`lab_share_case`), its own RESULTS.md section."""
    import goblin_dask

    cases = [(int(c.split(":")[0]), np.dtype(c.split(":")[1])) for c in args.cases.split(",")]
    rows: list[dict] = []
    rng = np.random.default_rng(0)
    with goblin_dask.LabNode.local(volunteers=2, threads_per_volunteer=1) as node:
        for n, dt in cases:
            rows.append(lab_share_case(n, dt, chunks=args.chunks or max(n // 4, 1), node=node, rng=rng,
                                       repeats=args.repeats))
    command = "env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/matmul.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    text = markdown_28(command, rows)
    print("\n" + text)
    if args.write:
        write_section(SECTION_28, text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": rows}, f, indent=1, default=str)
    return 0


def _sigterm_exits() -> None:
    """SIGTERM (e.g. from ``timeout``) unwinds the with-blocks, so no grid process is left behind."""
    import signal

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def main(argv=None) -> int:
    _sigterm_exits()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="8192,4096")
    p.add_argument("--dtypes", default="float64,float32")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--persist-repeats", type=int, default=1, help="repeats of the persist-only timing")
    p.add_argument("--start-wait", type=float, default=300, help="seconds to wait for a quiet machine first")
    p.add_argument("--busy-threshold", type=float, default=0.35,
                   help="wait before a timed section while more cores than this are busy")
    p.add_argument("--skip-dask", action="store_true", help="leave out the plain dask.array baseline")
    p.add_argument("--write", action="store_true", help="write its section of benchmarks/RESULTS.md")
    p.add_argument("--json", default=None, help="also write all numbers to this file")
    p.add_argument("--from-numpy", action="store_true",
                   help="issue 19's case: from numpy inputs, no persist, compute twice (its own section)")
    p.add_argument("--lab-share", action="store_true",
                   help="issue 28's case: CPU per process, bytes and round trips of the product from numpy")
    p.add_argument("--cases", default=None,
                   help="with --from-numpy (default 8192:float64,4096:float32) or --lab-share (default "
                        "4096:float32,4096:float64): n:dtype,...")
    p.add_argument("--chunks", type=int, default=2048, help="with --from-numpy or --lab-share: from_array's chunks (0: n/4)")
    p.add_argument("--max-share", default=None,
                   help="with --from-numpy: goblin.minimization.max-share for the node ('none': no cap; default: "
                        "the configured 0.25, which cuts a product of two lab arrays into 4x as many tasks)")
    args = p.parse_args(argv)
    if args.lab_share:
        args.cases = args.cases or "4096:float32,4096:float64"
        return main_28(args, argv)
    args.cases = args.cases or "8192:float64,4096:float32"
    if args.from_numpy:
        return main_19(args, argv)
    global BUSY_THRESHOLD
    BUSY_THRESHOLD = args.busy_threshold
    sizes = [int(s) for s in args.sizes.split(",")]
    dtypes = [np.dtype(d) for d in args.dtypes.split(",")]

    import dask
    import dask.array as da
    import distributed
    import threadpoolctl
    from distributed import Client, LocalCluster, wait

    import goblin_dask
    import goblin_dask.array as ga
    from goblin_dask import settings
    from goblin_dask.array.linalg import product_blocks, volunteer_capacity

    import warnings

    warnings.filterwarnings("ignore", message="Sending large graph")
    t_bench = time.perf_counter()
    print("command:", "env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE", sys.executable, " ".join(sys.argv))
    print("env:", {k: os.environ.get(k, "<unset>") for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE",
                                                              "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")})
    print(f"numpy {np.__version__}, dask {dask.__version__}, distributed {distributed.__version__}, "
          f"cpus {os.cpu_count()}")
    info = {"numpy_blas": blas_info(), "volunteer_blas_probe": volunteer_blas_probe()}
    print("BLAS, benchmark process (numpy):", info["numpy_blas"])
    print("BLAS, volunteer probe (same env + prepare_process):", info["volunteer_blas_probe"])

    results: list[dict] = []
    loads: list[dict] = []
    quiet_machine("start", loads, max_wait=float(args.start_wait))
    rng = np.random.default_rng(0)

    with goblin_dask.LabNode.local(volunteers=2, threads_per_volunteer=1) as node, \
            LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster, \
            Client(cluster, set_as_default=False) as dclient:
        gclient = node.client
        assert distributed.default_client() is gclient
        vol_addrs = node.volunteer_addresses()
        lab_addr = node.lab_worker_address()
        grid_pids = {name: proc.pid for name, proc in node.processes.items()}
        grid_pids["client"] = os.getpid()
        dask_pids = {f"worker{i}": pid for i, pid in enumerate(dclient.run(os.getpid).values())}
        dask_pids["client+scheduler"] = os.getpid()
        info["volunteer_env"] = {n: env_threads(grid_pids[n]) for n in vol_addrs}
        info["dask_worker_blas"] = list(dclient.run(dask_worker_blas).values())
        budget, threads = volunteer_capacity()
        info["volunteer_capacity"] = {"bytes_per_thread": budget, "threads": threads}
        winfo = gclient.scheduler_info(n_workers=-1)["workers"]
        info["grid_workers"] = {w.get("name"): {"nthreads": w.get("nthreads"), "memory_limit": w.get("memory_limit")}
                                for w in winfo.values()}
        print("volunteers' environment:", info["volunteer_env"])
        print("dask LocalCluster workers' BLAS:", info["dask_worker_blas"])
        print("grid workers:", info["grid_workers"], "capacity:", info["volunteer_capacity"])

        for n in sizes:
            for dt in dtypes:
                frac = float(settings.get("goblin.product.memory-fraction"))
                bm, bk, bn = product_blocks(n, n, n, dt.itemsize, budget * frac, threads)
                print(f"\n== n={n} {dt}: product blocks (bm, bk, bn) = ({bm}, {bk}, {bn})", flush=True)
                a = rng.standard_normal((n, n)).astype(dt)
                b = rng.standard_normal((n, n)).astype(dt)
                row = {"n": n, "dtype": str(dt), "blocks": [bm, bk, bn]}

                # numpy, 2 threads
                quiet_machine(f"numpy n={n} {dt}", loads)
                times = []
                with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
                    for _ in range(args.repeats):
                        t = time.perf_counter()
                        ref = a @ b
                        times.append(time.perf_counter() - t)
                row["numpy"] = min(times)
                row["numpy_all"] = times
                print(f"  numpy a@b: {', '.join(f'{x:.2f}' for x in times)} s", flush=True)

                # the grid
                x, y = ga.from_array(a, chunks=(bm, bk)), ga.from_array(b, chunks=(bk, bn))
                quiet_machine(f"grid inputs n={n} {dt}", loads)
                with CpuMeter(grid_pids) as cm:
                    t = time.perf_counter()
                    x, y = x.persist(), y.persist()
                    wait([x, y])
                    row["grid_input"] = time.perf_counter() - t
                row["grid_input_cpu"] = {k: round(v, 2) for k, v in cm.used.items()}
                print(f"  grid input transfer: {row['grid_input']:.2f} s, cpu {row['grid_input_cpu']}", flush=True)
                rep0 = node.report()
                row.update(timed_products(
                    "grid", lambda: (x @ y).compute(), ref, gclient, grid_pids, args.repeats, loads, f"n={n} {dt}",
                    lambda stream, t0, t1: grid_breakdown(stream, lab_addr, set(vol_addrs.values()), t0, t1)))
                rep1 = node.report()
                row["grid_report"] = {"tasks": rep1["tasks"] - rep0["tasks"],
                                      "accepted": rep1["accepted"] - rep0["accepted"],
                                      "rejected": rep1["rejected"] - rep0["rejected"],
                                      "by_method": rep1["by_method"], "overhead_cumulative": rep1["overhead"]}
                print(f"  grid report: {row['grid_report']}", flush=True)
                row["grid_persist"] = timed_persist("grid", lambda: (x @ y).persist(), args.persist_repeats, loads,
                                                    f"n={n} {dt}")
                del x, y
                time.sleep(1.0)

                if args.skip_dask:
                    row.update(dask=float("nan"), dask_persist=float("nan"), dask_input=float("nan"),
                               dask_err=float("nan"))
                    row["grid_vs_numpy"] = row["numpy"] / row["grid"]
                    row["dask_vs_numpy"] = float("nan")
                    results.append(row)
                    print(f"  => numpy/grid {row['grid_vs_numpy']:.2f}x", flush=True)
                    continue
                # plain dask.array on a LocalCluster, same blocks
                xd, yd = da.from_array(a, chunks=(bm, bk)), da.from_array(b, chunks=(bk, bn))
                quiet_machine(f"dask inputs n={n} {dt}", loads)
                t = time.perf_counter()
                xd, yd = dclient.persist([xd, yd])
                wait([xd, yd])
                row["dask_input"] = time.perf_counter() - t
                print(f"  dask input transfer: {row['dask_input']:.2f} s", flush=True)
                row.update(timed_products(
                    "dask", lambda: dclient.compute(xd @ yd).result(), ref, dclient, dask_pids, args.repeats, loads,
                    f"n={n} {dt}", dask_breakdown))
                row["dask_persist"] = timed_persist("dask", lambda: dclient.persist(xd @ yd), args.persist_repeats,
                                                    loads, f"n={n} {dt}")
                del xd, yd, ref, a, b
                time.sleep(1.0)
                row["grid_vs_numpy"] = row["numpy"] / row["grid"]
                row["dask_vs_numpy"] = row["numpy"] / row["dask"]
                results.append(row)
                print(f"  => numpy/grid {row['grid_vs_numpy']:.2f}x, numpy/dask {row['dask_vs_numpy']:.2f}x",
                      flush=True)

    command = "env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/matmul.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    text = markdown(command, info, results)
    print("\n" + text)
    print(f"total benchmark time {time.perf_counter() - t_bench:.0f} s")
    if args.write:
        write_section(SECTION, text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "results": results, "loads": loads}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
