"""Forward passes per second of a captured GPT-style decoder: grid vs numpy-only vs torch (issue 17).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/capture.py --write

One run, on this machine, side by side, the same model and the same token ids:

* **torch**: the model's own forward (``torch.no_grad``, ``torch.set_num_threads(2)``);
* **numpy-only**: the captured :class:`goblin_dask.torch_capture.Graph` computed with dask's local
  threaded scheduler (no grid, no verification);
* **grid**: the same graph on ``LabNode.local(volunteers=2)``, every volunteer result verified.

The model: token + position embedding, ``--layers`` decoder blocks (pre-layer-norm, causal
``F.scaled_dot_product_attention`` with ``--heads`` heads, GELU MLP of 4x width), a final layer
norm and an LM head.  The causal mask is a boolean buffer passed as ``attn_mask`` and the
positions are a buffer: ``is_causal=True`` and ``torch.arange`` in ``forward`` export to
``aten.arange``, which the capture table had no row for when this was written.

A pass of the graph = building the dask graph for the inputs (``graph(ids)``) + ``.compute()``;
both are timed apart.  Passes/s = 1 / best of ``--repeat``.  ``--quick``: tiny sizes (smoke run).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _results import write_section  # noqa: E402

SECTION = "## Captured PyTorch models (issue 17)"


def gpt(vocab: int, d_model: int, layers: int, seq: int, heads: int):
    import torch
    from torch import nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
            self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
            self.fc, self.out = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)
            self.register_buffer("mask", torch.ones(seq, seq, dtype=torch.bool).tril())

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
            q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask).transpose(1, 2).reshape(b, t, c)
            x = x + self.proj(y)
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, d_model), nn.Embedding(seq, d_model)
            self.blocks = nn.ModuleList([Block() for _ in range(layers)])
            self.ln, self.head = nn.LayerNorm(d_model), nn.Linear(d_model, vocab, bias=False)
            self.register_buffer("positions", torch.arange(seq))

        def forward(self, ids):
            x = self.tok(ids) + self.pos(self.positions)
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.ln(x))

    torch.manual_seed(0)
    return GPT().eval()


def blas() -> str:
    import threadpoolctl

    info = [d for d in threadpoolctl.threadpool_info() if d.get("user_api") == "blas"]
    return ", ".join(f"{d['internal_api']} {d['version']}, kernel {d.get('architecture')}, "
                     f"{d.get('num_threads')} threads" for d in info) or "none"


def stream_breakdown(stream: list[dict], vol_addrs: set, lab_addr: str) -> dict:
    """Seconds (summed over processes) of compute/transfer on volunteers and on the lab worker; tasks and
    bytes of task outputs per place."""
    from dask.utils import key_split

    out: dict = defaultdict(float)
    ops: dict = defaultdict(float)
    for rec in stream:
        w = rec.get("worker")
        where = "vol" if w in vol_addrs else ("lab" if w == lab_addr else "other")
        out[f"{where}_tasks"] += 1
        out[f"{where}_out_bytes"] += rec.get("nbytes", 0) or 0
        key = rec.get("key")
        name = key_split(key)
        for ss in rec.get("startstops", ()):
            out[f"{where}_{ss['action']}"] += ss["stop"] - ss["start"]
            if ss["action"] == "compute":
                ops[f"{where}:{name}"] += ss["stop"] - ss["start"]
    res = dict(out)
    res["top_ops"] = sorted(((k, round(v, 2)) for k, v in ops.items()), key=lambda kv: -kv[1])[:8]
    return res


def process_cpu(node, *, each: bool = False, researcher: bool = False) -> dict[str, float]:
    """CPU seconds (user + system, children included) of the grid's processes so far: lab worker,
    scheduler, volunteers (summed; ``each``: by name), and with ``researcher`` this process's own."""
    import psutil

    from goblin_dask.roles import LAB_WORKER_NAME

    out: dict[str, float] = {}
    for part, proc in node.processes.items():
        try:
            t = psutil.Process(proc.pid).cpu_times()
        except psutil.Error:
            continue
        where = "lab worker" if part == LAB_WORKER_NAME else (
            part if each or part == "scheduler" else "volunteers")
        out[where] = out.get(where, 0.0) + t.user + t.system + t.children_user + t.children_system
    if researcher:
        t = psutil.Process().cpu_times()
        out["researcher"] = t.user + t.system
    return out


def volunteer_chains(graph: dict) -> dict:
    """Volunteer tasks of an optimized graph (its checks inserted), and lab <-> volunteer round trips on its
    longest path: a volunteer task whose input on the path is not itself a volunteer result starts a new trip."""
    from graphlib import TopologicalSorter

    from dask._task_spec import GraphNode

    from goblin_dask.validation.checks import is_unverified_key

    deps = {k: {d for d in (v.dependencies if isinstance(v, GraphNode) else ()) if d in graph}
            for k, v in graph.items()}
    vol = {k for k in graph if is_unverified_key(k)}
    trips: dict = {}
    for key in TopologicalSorter(deps).static_order():
        if key in vol:  # fed by another volunteer result: the same trip; else a new one
            trips[key] = max((trips[d] + (0 if d in vol else 1) for d in deps[key]), default=1)
        else:
            trips[key] = max((trips[d] for d in deps[key]), default=0)
    return {"volunteer_tasks": len(vol), "round_trips": max(trips.values(), default=0)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="tiny sizes, one repeat (a smoke run)")
    p.add_argument("--no-grid", action="store_true", help="torch and numpy-only columns only")
    p.add_argument("--write", action="store_true", help="write its section of benchmarks/RESULTS.md")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.d_model, args.heads, args.seq, args.batch, args.vocab, args.repeat = 1, 16, 2, 8, 2, 32, 1

    import threadpoolctl
    import torch

    import goblin_dask

    torch.set_num_threads(2)
    t_all = time.perf_counter()
    cmd = "env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/capture.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    print("command:", cmd, flush=True)
    print("env:", {k: os.environ.get(k, "<unset>") for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")})
    model = gpt(args.vocab, args.d_model, args.layers, args.seq, args.heads)
    ids = np.random.default_rng(0).integers(0, args.vocab, (args.batch, args.seq)).astype(np.int64)
    tids = torch.from_numpy(ids)
    nparams = sum(p.numel() for p in model.parameters())

    t = time.perf_counter()
    graph = goblin_dask.capture(model, (tids,))
    t_capture = time.perf_counter() - t
    print(f"capture: {t_capture:.2f} s, {len(graph.nodes)} nodes, {nparams / 1e6:.2f} M parameters", flush=True)

    load_start = os.getloadavg()
    # torch
    with torch.no_grad():
        ref = model(tids).numpy()
        times = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            model(tids)
            times.append(time.perf_counter() - t)
    r = {"torch": min(times), "load_start": load_start}
    print(f"torch forward: {', '.join(f'{x:.3f}' for x in times)} s", flush=True)

    def passes(compute) -> tuple[float, float, float, int, np.ndarray]:
        """best (build + compute), build and compute of that pass, tasks, result.

        One untimed pass first, as torch's reference forward is: kernels compile (numba), modules
        import and the lab's constants arrive once, in every column alike."""
        t0 = time.perf_counter()
        compute(graph(ids))
        print(f"  warm-up pass {time.perf_counter() - t0:.3f} s (not timed)", flush=True)
        best = None
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            out = graph(ids)
            t1 = time.perf_counter()
            res = compute(out)
            t2 = time.perf_counter()
            ntasks = len(dict(out.__dask_graph__()))
            print(f"  build {t1 - t0:.3f} s, compute {t2 - t1:.3f} s, {ntasks} tasks", flush=True)
            if best is None or t2 - t0 < best[0]:
                best = (t2 - t0, t1 - t0, t2 - t1, ntasks, res)
        return best

    # numpy-only: dask's threaded scheduler (2 threads, one BLAS thread each)
    print("numpy-only (threaded scheduler):", flush=True)
    with threadpoolctl.threadpool_limits(limits=1, user_api="blas"):
        r["np"], r["np_build"], r["np_compute"], r["np_tasks"], res = passes(
            lambda o: o.compute(scheduler="threads", num_workers=2))
    r["np_err"] = float(np.abs(res - ref).max())

    print("floor (sync scheduler, whole arrays, 1 BLAS thread, checks as on the grid):", flush=True)
    r["floor"] = floor(graph, ids, args.repeat)
    print("  ", {k: round(v, 4) for k, v in r["floor"].items()}, flush=True)

    if not args.no_grid:
        from distributed import get_task_stream

        from goblin_dask.node.local import LabNode

        print("grid (LabNode.local, 2 volunteers):", flush=True)
        t = time.perf_counter()
        with LabNode.local(volunteers=2) as node:
            r["grid_start"] = time.perf_counter() - t
            vol = set(node.volunteer_addresses().values())
            lab = node.lab_worker_address()
            warm = {}

            def grid_compute(o):  # the task stream and the report cover the timed passes only
                if "rep0" not in warm:
                    warm["rep0"] = True
                    return o.compute()
                if "ts" not in warm:
                    warm["cpu"] = process_cpu(node)
                    warm["rep"] = node.report()
                    warm["ts"] = get_task_stream(client=node.client)
                    warm["ts"].__enter__()
                return o.compute()

            r["grid"], r["grid_build"], r["grid_compute"], r["grid_tasks"], res = passes(grid_compute)
            ts, rep0 = warm["ts"], warm["rep"]
            ts.__exit__(None, None, None)
            rep1 = node.report()
            cpu1 = process_cpu(node)
            r["cpu"] = {part: cpu1[part] - warm["cpu"].get(part, 0.0) for part in cpu1}
            r["grid_err"] = float(np.abs(res - ref).max())
            r["stream"] = stream_breakdown(ts.data, vol, lab)
            r["report"] = {k: (rep1[k] - rep0[k]) if isinstance(rep1.get(k), (int, float)) and
                           isinstance(rep0.get(k), (int, float)) else rep1.get(k) for k in rep1}
            print("  node.report() delta:", r["report"], flush=True)
            print("  task stream (timed passes):", {k: (round(v, 3) if isinstance(v, float) else v)
                                                  for k, v in r["stream"].items()}, flush=True)
    r["load_end"] = os.getloadavg()
    r["blas"] = blas()
    r["total"] = time.perf_counter() - t_all

    text = markdown(cmd, args, r, t_capture, nparams)
    print("\n" + text)
    print(f"total benchmark time {r['total']:.0f} s")
    if args.write:
        write_section(SECTION, text)
    return 0


def task_seconds(compute) -> dict:
    """``compute()`` (a compute on dask's sync scheduler) with each task's seconds summed by kind.

    Kinds: ``products`` (catalog ops checked by Freivalds, and fused lab chains holding one), ``product checks`` (the lab's checks of
    them), ``other ops`` (the rest of the catalog, fused lab chains included), ``other checks``,
    ``glue`` (dask's own tasks).  Plus ``pass``: the wall time of the whole compute.
    """
    from dask.callbacks import Callback

    from goblin_dask.ops.spec import CatalogTask, Freivalds, LabChain
    from goblin_dask.validation.checks import accept

    def kind(task) -> str:
        if isinstance(task, CatalogTask):
            return "products" if isinstance(task.op.verify, Freivalds) else "other ops"
        if isinstance(task, LabChain):  # a fused chain of lab steps: a product's if it holds one
            return "products" if any(isinstance(t.op.verify, Freivalds) for t in task.steps) else "other ops"
        if getattr(task, "func", None) is accept:
            return "product checks" if isinstance(task.kwargs.get("op").verify, Freivalds) else "other checks"
        return "glue"

    class Seconds(Callback):
        def __init__(self):
            super().__init__()
            self.by, self.t0 = defaultdict(float), {}

        def _pretask(self, key, dsk, state):
            self.t0[key] = time.perf_counter()

        def _posttask(self, key, result, dsk, state, worker_id):
            self.by[kind(dsk[key])] += time.perf_counter() - self.t0.pop(key)

    t0 = time.perf_counter()
    with Seconds() as sec:
        compute()
    return {"pass": time.perf_counter() - t0, **sec.by}


def floor(graph, ids, repeat: int) -> dict:
    """The least CPU any verified schedule of this graph needs: its tasks' own seconds, nothing else.

    The graph computed on whole arrays in this process (dask's sync scheduler, one BLAS thread, as a
    volunteer and the lab worker run), the lab's checks inserted as on the grid (:func:`task_seconds`),
    best pass of ``repeat`` (graph building included in ``pass``).  No scheduling, no transfers, no
    TLS: a grid pass on the same cores cannot take less than the tasks' sum spread over them.
    """
    import threadpoolctl

    best = None
    with threadpoolctl.threadpool_limits(limits=1, user_api="blas"):
        graph(ids).compute(scheduler="sync")  # warm-up
        for _ in range(repeat):
            t0 = time.perf_counter()
            out = graph(ids)
            sec = task_seconds(lambda: out.compute(scheduler="sync"))
            sec["pass"] = time.perf_counter() - t0
            if best is None or sec["pass"] < best["pass"]:
                best = sec
    return best


def floor_text(f: dict, torch_seconds: float, what: str) -> str:
    """A :func:`floor` (or a training round's) in words, with the bound it sets against torch."""
    work = {k: v for k, v in f.items() if k != "pass"}
    need, cores = sum(work.values()), os.cpu_count()
    return (", ".join(f"{k} {v:.3f}" for k, v in sorted(work.items(), key=lambda kv: -kv[1]))
            + f"; {need:.3f} s in all.  Spread over {cores} cores with no scheduling, transfer or idle time, a "
            f"verified {what} takes at least {need / cores:.3f} s: **at most {torch_seconds * cores / need:.2f}x "
            f"torch** on this machine, whatever the grid's schedule (the products alone: {f.get('products', 0):.3f} "
            f"s, against torch's whole {what} of {torch_seconds:.3f} s)")


def markdown(cmd: str, args, r: dict, t_capture: float, nparams: int) -> str:
    def col(key):
        if key not in r:
            return "— | — | — | — | —"
        return (f"{1 / r[key]:.2f} | **{r['torch'] / r[key]:.2f}x** | {r[key + '_build']:.3f} s / "
                f"{r[key + '_compute']:.3f} s | {r[key + '_tasks']} | {r[key + '_err']:.1e}")

    lines = [SECTION, "", f"Command: `{cmd}`", "",
             f"Model: GPT-style decoder, vocab {args.vocab}, d_model {args.d_model}, {args.heads} heads, "
             f"{args.layers} layers, sequence {args.seq}, batch {args.batch} ({nparams / 1e6:.2f} M parameters, "
             f"float32); captured in {t_capture:.1f} s.  Machine: {os.cpu_count()} cores; BLAS (threadpoolctl): "
             f"{r['blas']}.  torch with `torch.set_num_threads(2)`; numpy-only = the captured graph on dask's "
             "threaded scheduler (2 threads, 1 BLAS thread each); grid = `LabNode.local(volunteers=2)`, results "
             f"verified.  Best of {args.repeat}, one run; a pass = building the graph for the inputs + `.compute()`.  "
             "The machine was shared with other test runs: load average (1 min) "
             f"{r['load_start'][0]:.2f} before the torch column, {r['load_end'][0]:.2f} after the grid column.",
             "",
             "| | passes/s | vs torch | build / compute | tasks | max abs error vs torch |",
             "|---|---|---|---|---|---|",
             f"| torch forward | {1 / r['torch']:.2f} | 1.00x | — | — | — |",
             f"| numpy-only (threaded scheduler) | {col('np')} |",
             f"| grid, 2 volunteers, verified | {col('grid')} |"]
    if "floor" in r:
        lines += ["", f"**Floor** (`floor()`: the same graph on whole arrays in one process, dask's sync scheduler, one "
                  f"BLAS thread, the lab's checks inserted as on the grid; best of {args.repeat}; the pass took "
                  f"{r['floor']['pass']:.3f} s with graph building): task seconds per pass "
                  + floor_text(r["floor"], r["torch"], "forward") + "."]
    if "stream" in r:
        s, rep = r["stream"], r["report"]
        lines += ["", f"Grid, task stream summed over the {args.repeat} timed passes (after one untimed warm-up pass) (seconds of all processes): "
                  f"volunteers {s.get('vol_tasks', 0):.0f} tasks, compute {s.get('vol_compute', 0):.2f} s, fetching "
                  f"inputs {s.get('vol_transfer', 0):.2f} s, outputs {s.get('vol_out_bytes', 0) / 2**20:.1f} MiB; "
                  f"lab worker {s.get('lab_tasks', 0):.0f} tasks, compute {s.get('lab_compute', 0):.2f} s "
                  f"(checks and lab-only ops), fetching {s.get('lab_transfer', 0):.2f} s, outputs "
                  f"{s.get('lab_out_bytes', 0) / 2**20:.1f} MiB.  Compute seconds by task name (place:name): "
                  f"{', '.join(f'{k} {v:.2f}' for k, v in s['top_ops'])}.  `node.report()` over the passes: "
                  f"{rep.get('tasks')} volunteer tasks ledgered, accepted {rep.get('accepted')}, rejected "
                  f"{rep.get('rejected')}, by method {rep.get('by_method')}, overhead {rep.get('overhead', 0):.2f}, seconds {rep.get('seconds')}.  "
                  f"Grid start {r['grid_start']:.1f} s (not in the passes)."]
        cpu = {k: v / args.repeat for k, v in (r.get("cpu") or {}).items()}
        if cpu:
            total = sum(cpu.values())
            lab_side = cpu.get("lab worker", 0.0) + cpu.get("scheduler", 0.0)
            lines += ["", "CPU seconds per pass (processes' user + system over the timed passes): "
                      + ", ".join(f"{k} {v:.3f}" for k, v in sorted(cpu.items()))
                      + f"; in all {total:.3f} s, against torch's forward of {r['torch']:.3f} s wall on {os.cpu_count()} cores.  A pass cannot take less than that CPU spread over the "
                      f"{os.cpu_count()} cores: here the grid cannot pass {r['torch'] * os.cpu_count() / total:.2f}x torch, "
                      f"and the lab node's own share alone (lab worker and scheduler, {lab_side:.3f} s: the checks, "
                      f"lab-only ops, moving blocks, scheduling) caps it at "
                      f"{r['torch'] * os.cpu_count() / max(lab_side, 1e-9):.2f}x whatever the volunteers do."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
