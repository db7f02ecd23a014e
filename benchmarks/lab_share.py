"""The lab's share of the work (issue 28): CPU seconds per process, bytes on the wire, round trips.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/lab_share.py [--quick] [--write]
        [--d-model 256 --layers 4] [--only LM] [--stages 4]

With volunteers on machines of their own, the lab node's processes bound how fast the grid can go,
so wall time on this 2-core machine (every process on the same cores) says little.  For each
workload, on ``LabNode.local(volunteers=2)``, over the measured repetitions (after a warm-up one):

* CPU seconds (user + system) of each process: the scheduler, the lab worker, the researcher's own
  process (this one: building graphs, receiving results; the same process measures nothing else
  meanwhile) and the volunteers (summed);
* the reference: torch's (or numpy's) own CPU seconds for the same work, one thread, in this process;
* bytes on the wire: every byte through the lab node's two ports (the scheduler's, the lab worker's),
  both directions, TCP payload and headers, counted by an nftables rule on the loopback interface
  (volunteers reach the lab only through those ports; none reaches another), so TLS framing and
  dask's messages count as well as the arrays.  Needs root and ``nft``; else left out;
* lab <-> volunteer round trips on the graph's longest path (``capture.volunteer_chains``: every result goes
  back to the lab to be verified before any task reads it);
* the projection: on machines of their own, no process can finish a round before its own CPU time,
  so a round takes at least ``max(scheduler, lab worker, researcher, volunteers / N)`` CPU seconds;
  speed-up over torch's own CPU = reference / that.  It leaves out the network (see the bytes and the
  round trips) and assumes the volunteers' work splits N ways.

Workloads (the issue's three): a training round of the GPT language model (``--d-model``, ``--layers``,
seq 128, batch 32, 4 micro-batches, AdamW), a captured forward pass of the same model (batch 16), whole
and cut into ``--stages`` stages (as a model larger than one volunteer thread's share is), and the
4096 x 4096 float32 product from numpy (second compute).
"""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _results import write_section  # noqa: E402
from capture import process_cpu, volunteer_chains  # noqa: E402

SECTION = "## The lab's share: CPU per process, bytes on the wire (issue 28)"


class WireCounter:
    """Bytes through the lab node's ports on the loopback interface (an nftables table of its own,
    removed on exit); ``read()`` is None where nft is missing or not permitted."""

    TABLE = "goblin_bench_wire"

    def __init__(self, ports: list[int]):
        self.ports, self.ok = ports, False
        rules = [f"add table inet {self.TABLE}",
                 f"add chain inet {self.TABLE} out {{ type filter hook output priority 0 ; }}"]
        for p in ports:
            rules += [f"add rule inet {self.TABLE} out oif lo tcp dport {p} counter",
                      f"add rule inet {self.TABLE} out oif lo tcp sport {p} counter"]
        try:
            subprocess.run(["nft", "-f", "-"], input="\n".join(rules) + "\n", text=True, check=True,
                           capture_output=True)
            self.ok = True
        except (OSError, subprocess.CalledProcessError) as e:
            print(f"bytes on the wire not counted (nft: {e})", file=sys.stderr)

    def read(self) -> dict | None:
        """Bytes so far {"to scheduler", "from scheduler", "to lab worker", "from lab worker"} (ports in order)."""
        if not self.ok:
            return None
        out = subprocess.run(["nft", "list", "table", "inet", self.TABLE], text=True, capture_output=True).stdout
        counts = [int(line.split("bytes")[1].split()[0]) for line in out.splitlines() if "counter packets" in line]
        names = [f"{d} {w}" for w in ("scheduler", "lab worker") for d in ("to", "from")]
        return dict(zip(names, counts))

    def close(self) -> None:
        if self.ok:
            subprocess.run(["nft", "delete", "table", "inet", self.TABLE], capture_output=True)
            self.ok = False


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def round_trips(a) -> int:
    """Lab <-> volunteer round trips of computing ``a`` (its graph optimized as compute would, checks inserted)."""
    return volunteer_chains(dict(a.__dask_optimize__(dict(a.__dask_graph__()), a.__dask_keys__())))["round_trips"]


class Measure:
    """CPU per process and bytes on the wire between ``start()`` and ``stop(n)`` (per repetition)."""

    def __init__(self, node, wire: WireCounter):
        self.node, self.wire = node, wire

    def start(self) -> None:
        self.cpu0, self.bytes0, self.t0 = process_cpu(self.node, researcher=True), self.wire.read(), time.perf_counter()

    def stop(self, n: int) -> dict:
        cpu1, bytes1, wall = process_cpu(self.node, researcher=True), self.wire.read(), (time.perf_counter() - self.t0) / n
        cpu = {k: (cpu1[k] - self.cpu0.get(k, 0.0)) / n for k in cpu1}
        if bytes1 is None:
            return {"cpu": cpu, "bytes": None, "wire": {}, "wall": wall}
        wire = {k: (bytes1[k] - self.bytes0[k]) / n for k in bytes1}
        return {"cpu": cpu, "bytes": sum(wire.values()), "wire": wire, "wall": wall}


def idle_cpu(node, seconds: float) -> dict[str, float]:
    """CPU seconds per second of each process of an idle grid (heartbeats, monitors): a share of every
    measured round that grows with its wall time, which on this shared machine is longer than on machines
    of their own."""
    c0, t0 = process_cpu(node, researcher=True), time.perf_counter()
    time.sleep(seconds)
    c1, t1 = process_cpu(node, researcher=True), time.perf_counter()
    return {k: (c1[k] - c0.get(k, 0.0)) / (t1 - t0) for k in c1}


def reference_cpu(fn, repeat: int) -> float:
    """This process's CPU seconds for ``fn()`` (one thread), best of ``repeat`` after a warm-up call."""
    import threadpoolctl

    with threadpoolctl.threadpool_limits(limits=1):
        fn()
        best = None
        for _ in range(repeat):
            c = time.process_time()
            fn()
            best = min(best or 1e9, time.process_time() - c)
    return best


def lm_round(node, wire, args, inner_steps: int = 1, stages: int = 1) -> dict:
    """A training round of the GPT; ``inner_steps`` H > 1: local steps (DiLoCo), ``micro_batches`` workers each
    taking H steps, a round of H times the batch, its reference H of torch's synchronous steps.  ``stages`` > 1:
    the Trainer's ``stage_memory`` (and the stage budget, all of it) a ``stages``-th of the parameter bytes, as
    for a model larger than a volunteer: each micro-batch a pipeline of stage tasks."""
    import contextlib

    import dask
    import torch
    import torch.nn.functional as F

    from capture import gpt
    from goblin_dask.training import Trainer

    torch.manual_seed(0)
    model = gpt(args.vocab, args.d_model, args.layers, args.seq, max(1, args.d_model // 64)).train()
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(args.rounds + 1):
        ids = rng.integers(0, args.vocab, (args.batch * inner_steps, args.seq + 1))
        batches.append((ids[:, :-1].copy(), ids[:, 1:].copy()))

    def loss_fn(logits, y):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-4)

    def torch_round(batch=batches[0]):
        for rows in np.array_split(np.arange(len(batch[0])), inner_steps):
            x, y = batch[0][rows], batch[1][rows]
            ref_opt.zero_grad()
            for idx in np.array_split(np.arange(len(x)), args.micro_batches):
                (loss_fn(ref(torch.from_numpy(x[idx])), torch.from_numpy(y[idx])) * (len(idx) / len(x))).backward()
            ref_opt.step()

    torch.set_num_threads(1)
    reference = reference_cpu(torch_round, args.repeat)
    torch.set_num_threads(2)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    cut, stage_memory = contextlib.nullcontext(), None
    if stages > 1:
        stage_memory = param_bytes // stages + 1
        cut = dask.config.set({"goblin.stage.memory-fraction": 1.0})
    with cut:
        trainer = Trainer(model, loss_fn, torch.optim.AdamW(model.parameters(), lr=3e-4),
                          micro_batches=args.micro_batches, client=node.client, inner_steps=inner_steps,
                          stage_memory=stage_memory)
        trainer.step(*batches[0])  # traces the joint graph; the model's arrays go up once
        dsk, _ = trainer.round_graph(*batches[1])
        trips = volunteer_chains(dsk)["round_trips"]
        m = Measure(node, wire)
        rep0 = node.report()
        m.start()
        for x, y in batches[1:]:
            trainer.step(x, y)
        out = m.stop(len(batches) - 1)
    rep1 = node.report()
    out.update(reference=reference, trips=trips, steps=inner_steps, tasks=(rep1["tasks"] - rep0["tasks"]) / (len(batches) - 1),
               param_bytes=param_bytes,
               by_method={k: v - rep0["by_method"].get(k, 0) for k, v in rep1["by_method"].items()})
    return out


def gpt_forward(node, wire, args, stages: int = 1) -> dict:
    """The captured forward pass; ``stages`` > 1: with ``goblin.stage.memory-fraction`` lowered until the model
    is cut into about that many stages (as a model larger than a volunteer thread's share would be)."""
    import contextlib

    import dask
    import torch

    import goblin_dask
    from capture import gpt

    model = gpt(args.vocab, args.d_model, args.layers, args.seq, max(1, args.d_model // 64))
    ids = np.random.default_rng(1).integers(0, args.vocab, (args.forward_batch, args.seq)).astype(np.int64)
    tids = torch.from_numpy(ids)
    torch.set_num_threads(1)
    with torch.no_grad():
        reference = reference_cpu(lambda: model(tids), args.repeat)
        want = model(tids).numpy()
    torch.set_num_threads(2)
    graph = goblin_dask.capture(model, (tids,))
    cut = contextlib.nullcontext()
    if stages > 1:
        from goblin_dask.torch_capture.graph import stage_budget

        params = sum(v.nbytes for v in graph.constants.values())
        fraction = float(dask.config.get("goblin.stage.memory-fraction")) * params / stages / stage_budget()
        cut = dask.config.set({"goblin.stage.memory-fraction": fraction})
    with cut:
        graph(ids).compute()  # warm-up: the constants go up once, kernels compile
        out_arr = graph(ids)
        trips = round_trips(out_arr)
        m = Measure(node, wire)
        rep0 = node.report()
        m.start()
        for _ in range(args.repeat):
            got = graph(ids).compute()
        out = m.stop(args.repeat)
    rep1 = node.report()
    out.update(reference=reference, trips=trips, tasks=(rep1["tasks"] - rep0["tasks"]) / args.repeat,
               param_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
               error=float(np.abs(got - want).max()))
    return out


def product(node, wire, args) -> dict:
    import goblin_dask.array as ga

    n = args.n
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((n, n), dtype=np.float32), rng.standard_normal((n, n), dtype=np.float32)
    reference = reference_cpu(lambda: a @ b, 1)
    x, y = ga.from_array(a), ga.from_array(b)
    (x @ y).compute()
    trips = round_trips(x @ y)
    m = Measure(node, wire)
    rep0 = node.report()
    m.start()
    got = (x @ y).compute()
    out = m.stop(1)
    rep1 = node.report()
    want = a.astype(np.float64) @ b.astype(np.float64)
    out.update(reference=reference, trips=trips, tasks=rep1["tasks"] - rep0["tasks"], param_bytes=a.nbytes + b.nbytes,
               error=float(np.abs(got - want).max() / np.abs(want).max()))
    return out


WORKLOADS = {"LM": lm_round, "LM local steps": lambda node, wire, args: lm_round(node, wire, args, args.inner_steps),
             "forward": gpt_forward,
             "LM in stages": lambda node, wire, args: lm_round(node, wire, args, stages=args.stages),
             "forward in stages": lambda node, wire, args: gpt_forward(node, wire, args, args.stages),
             "product": product}


def row(name: str, r: dict, volunteers: int, idle: dict) -> str:
    c = r["cpu"]
    lab_parts = ("scheduler", "lab worker", "researcher")
    lab = sum(c.get(k, 0.0) for k in lab_parts)
    net = sum(max(0.0, c.get(k, 0.0) - idle.get(k, 0.0) * r["wall"]) for k in lab_parts)
    vol = c.get("volunteers", 0.0)
    ref = r["reference"]
    wire = "n/a" if r["bytes"] is None else (
        f"{r['bytes'] / 2**20:.1f} MiB = {r['bytes'] / r['param_bytes']:.1f}x; {r['bytes'] / volunteers / r['param_bytes']:.1f}x "
        f"per volunteer ({', '.join(f'{k} {v / 2**20:.1f}' for k, v in r['wire'].items())})"
        + (f"; per optimizer step {r['bytes'] / r['steps'] / volunteers / r['param_bytes']:.2f}x per volunteer"
           if r.get("steps", 1) > 1 else ""))
    bound = max(c.get(k, 0.0) for k in lab_parts)
    speed = ", ".join(f"{n}: {ref / max(bound, vol / n):.1f}x" for n in (2, 8, 32))
    return (f"| {name} | {r['wall']:.2f} | {c.get('scheduler', 0):.3f} | {c.get('lab worker', 0):.3f} | "
            f"{c.get('researcher', 0):.3f} | {vol:.3f} | {ref:.3f} | **{lab / ref:.2f}x** ({net / ref:.2f}x) | "
            f"{vol / ref:.2f}x | {wire} | {r['trips']} | {r['tasks']:.0f} | {speed} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--forward-batch", type=int, default=16)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--inner-steps", type=int, default=8,
                   help="the local-steps LM workload's inner steps per round (DiLoCo); 1 leaves it out")
    p.add_argument("--rounds", type=int, default=3, help="measured training rounds (after one more)")
    p.add_argument("--repeat", type=int, default=3, help="measured forward passes; the reference's best of")
    p.add_argument("--n", type=int, default=4096, help="the product's size")
    p.add_argument("--stages", type=int, default=4,
                   help="also the forward pass cut into this many stages (a model larger than one stage); < 2: not")
    p.add_argument("--only", default="", help="run only the workloads whose name holds this (LM, forward, product)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    p.add_argument("--volunteers", type=int, default=2, help="volunteer processes of the local grid")
    p.add_argument("--idle-only", action="store_true",
                   help="measure only the idle grid: CPU per process and bytes on the wire per second")
    p.add_argument("--write", action="store_true", help=f"write {SECTION!r} of benchmarks/RESULTS.md")
    args = p.parse_args(argv)
    if args.quick:
        args.d_model, args.layers, args.seq, args.batch, args.forward_batch, args.n, args.rounds, args.repeat = (
            32, 2, 16, 8, 4, 256, 2, 1)
    cmd = "env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/lab_share.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    print("command:", cmd, flush=True)

    from goblin_dask.node.local import LabNode

    volunteers = args.volunteers
    results, idle = {}, {}
    with LabNode.local(volunteers=volunteers) as node:
        wire = WireCounter([port_of(node.address), port_of(node.lab_worker_address())])
        seconds = 3 if args.quick else 20
        bytes0 = wire.read()
        idle = idle_cpu(node, seconds)
        bytes1 = wire.read()
        print("idle CPU-s per s:", {k: round(v, 4) for k, v in idle.items()}, flush=True)
        if bytes0 is not None and bytes1 is not None:
            print("idle bytes per s:", {k: round((bytes1[k] - bytes0[k]) / seconds) for k in bytes1}, flush=True)
        if args.idle_only:
            wire.close()
            return 0
        try:
            for name, fn in WORKLOADS.items():
                if (args.only and args.only not in name) or (name == "LM local steps" and args.inner_steps < 2) \
                        or (name.endswith(" in stages") and args.stages < 2):
                    continue
                t = time.perf_counter()
                results[name] = fn(node, wire, args)
                print(f"{name} ({time.perf_counter() - t:.0f} s): {results[name]}", flush=True)
        finally:
            wire.close()
    titles = {"LM local steps": f"LM, local steps: {args.micro_batches} workers x {args.inner_steps} inner AdamW steps, "
                                f"batch {args.batch} per step, outer Nesterov SGD (one round = {args.inner_steps} steps)",
              "LM": f"LM training round, GPT d_model {args.d_model}, {args.layers} layers, seq {args.seq}, batch "
                    f"{args.batch}, {args.micro_batches} micro-batches (AdamW)",
              "LM in stages": f"LM training round, same model and batch, stage_memory = 1/{args.stages} of the "
                              "parameters (pipelines of stage tasks, micro-batches grouped per volunteer thread)",
              "forward": f"captured GPT forward, same model, batch {args.forward_batch}",
              "forward in stages": f"captured GPT forward, same model and batch, cut into {args.stages} stages "
                                   "(a pipeline of stage tasks)",
              "product": f"{args.n}x{args.n} float32 product from numpy, second compute"}
    text = [SECTION, "", f"`{cmd}`: {volunteers} volunteers, one run.  CPU seconds per round / pass / product "
            "(user + system); reference = torch's or numpy's own CPU for the same work, one thread; lab = "
            "scheduler + lab worker + researcher's process.  Bytes: through the lab node's ports, both ways, "
            "against the parameter bytes (the operands' bytes for the product).  Projected speed-up over the "
            "reference with N volunteers on machines of their own: reference / max(each lab process, volunteers / N) "
            "(CPU-bound; the network is in the bytes and round trips columns).  In brackets, the lab's CPU net of "
            "what the idle grid spends in the same wall time (measured first, 20 s: "
            + ", ".join(f"{k} {v * 1000:.0f} ms/s" for k, v in idle.items()) + "): heartbeats and monitors, a share "
            "that shrinks with the round's wall time.", "",
            "| workload | wall s | scheduler | lab worker | researcher | volunteers | reference | lab / reference (net of idle) | "
            "volunteers / reference | bytes on the wire (MiB) | round trips | checked results | projected speed-up (N volunteers) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|"]
    for name, r in results.items():
        text.append(row(titles[name], r, volunteers, idle))
    print("\n".join(text))
    if args.write:
        write_section(SECTION, "\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
