"""The verified product, a captured forward pass and training rounds over home-broadband links, shaped
and unshaped in one run (root; ip, nft, tc).

    python benchmarks/wan.py --n 4096 --repeats 1 --forward-repeats 2 --training-rounds 3 --inner-steps 1,4 [--json]

On the network testbed (tests/nettestbed.py: the lab node in its namespace, two volunteers behind NAT,
each home 50 Mbit/s up and 200 Mbit/s down, 20 ms each way), then on the same testbed unshaped (no tbf,
the relay adding no delay: the bytes are counted by the same relay).  For each workload: its seconds
(the product and the forward pass: best of the repeats, operands made, the grid warm; training: the mean
of the rounds after the first, which traces), the bytes each home sent and received during it, and the
bound the links set:

    bound = max over homes of max(bytes up / up rate, bytes down / down rate) + dependent round trips x RTT

where a volunteer thread's tasks are its dependent round trips, 3 each (compute-task to it, its fetch
of the inputs, the lab's fetch of its result), and RTT the relay's 2 x 20 ms.  The machine's load
average is recorded before and after each workload (the testbed shares this machine's cores).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))  # capture.gpt: the LM of benchmarks/training.py

from tests.nettestbed import Testbed, unavailable_reason  # noqa: E402

UP_MBIT, DOWN_MBIT, DELAY = 50.0, 200.0, 0.020
ROUND_TRIPS_PER_TASK = 3


def links_bound(per_home: dict, volunteer_tasks: float, threads: int) -> dict:
    """The bound the shaped links set for moving ``per_home`` bytes ({home: {"up", "down"}}) and running
    ``volunteer_tasks`` tasks on ``threads`` volunteer threads (see the module's docstring)."""
    transfer = max(max(m["up"] / (UP_MBIT * 1e6 / 8), m["down"] / (DOWN_MBIT * 1e6 / 8)) for m in per_home.values())
    trips = int(ROUND_TRIPS_PER_TASK * -(-volunteer_tasks // threads))
    return {"transfer_s": round(transfer, 2), "round_trips": trips, "rtt_s": 2 * DELAY,
            "seconds": round(transfer + trips * 2 * DELAY, 2)}


def load() -> float:
    return round(os.getloadavg()[0], 2)


def measure(bed: Testbed, n: int, repeats: int, shaped: bool) -> dict:
    import goblin_dask.array as ga

    bed.client()
    rng = np.random.default_rng(2026)
    a, b = rng.standard_normal((n, n)), rng.standard_normal((n, n))
    reference = a @ b
    (ga.from_array(a[:256, :256]) @ ga.from_array(b[:256, :256])).compute()  # warm: connections, kernels
    best, load0 = None, load()
    for _ in range(repeats):
        time.sleep(1.5)  # the relay's counts are written every second
        before = bed.relayed_bytes()
        tasks_before = bed.report()["tasks"]
        t = time.perf_counter()
        product = ga.from_array(a) @ ga.from_array(b)
        c = product.compute()
        seconds = time.perf_counter() - t
        time.sleep(1.5)
        after = bed.relayed_bytes()
        report = bed.report()
        error = float(np.abs(c - reference).max() / np.abs(reference).max())
        moved = {h: {d: after[h][d] - before.get(h, {}).get(d, 0) for d in ("up", "down")} for h in after}
        tasks = report["tasks"] - tasks_before
        run = {"seconds": round(seconds, 2), "bytes": moved, "volunteer_tasks": tasks,
               "blocks": list(product.chunksize), "max_relative_error": error, "rejected": report["rejected"]}
        if best is None or seconds < best["seconds"]:
            best = run
    if shaped:
        best["bound"] = links_bound(best["bytes"], best["volunteer_tasks"], len(bed.homes))  # one task thread each
        best["shaped_over_bound"] = round(best["seconds"] / best["bound"]["seconds"], 2)
    best["load"] = [load0, load()]
    bed.close_clients()
    return best


def measure_forward(bed: Testbed, repeats: int, shaped: bool, batch: int = 16) -> dict:
    """A captured forward pass of the GPT-style LM of benchmarks/training.py (d_model 256, 4 layers, seq 128,
    vocab 64) with :func:`goblin_dask.capture`: best of ``repeats`` after a warm-up pass (its constants go
    up once), against torch's own output."""
    import torch

    import goblin_dask
    from capture import gpt

    bed.client()  # the default client of the computes below
    torch.manual_seed(0)
    model = gpt(64, 256, 4, 128, 4).eval()
    ids = np.random.default_rng(1).integers(0, 64, (batch, 128)).astype(np.int64)
    with torch.no_grad():
        want = model(torch.from_numpy(ids)).numpy()
    graph = goblin_dask.capture(model, (torch.from_numpy(ids),))
    graph(ids).compute()  # warm-up
    best, load0 = None, load()
    for _ in range(repeats):
        time.sleep(1.5)
        before, tasks_before = bed.relayed_bytes(), bed.report()["tasks"]
        t = time.perf_counter()
        got = graph(ids).compute()
        seconds = time.perf_counter() - t
        time.sleep(1.5)
        after, report = bed.relayed_bytes(), bed.report()
        run = {"seconds": round(seconds, 2), "volunteer_tasks": report["tasks"] - tasks_before,
               "bytes": {h: {d: after[h][d] - before.get(h, {}).get(d, 0) for d in ("up", "down")} for h in after},
               "max_abs_error": float(np.abs(got - want).max()), "rejected": report["rejected"]}
        if best is None or seconds < best["seconds"]:
            best = run
    if shaped:
        best["bound"] = links_bound(best["bytes"], best["volunteer_tasks"], len(bed.homes))
        best["shaped_over_bound"] = round(best["seconds"] / best["bound"]["seconds"], 2)
    best["load"] = [load0, load()]
    bed.close_clients()
    return best


def measure_training(bed: Testbed, rounds: int, shaped: bool, inner_steps: int = 1, batch: int = 32,
                     micro: int = 4) -> dict:
    """Rounds of the GPT-style character LM of benchmarks/training.py (d_model 256, 4 layers, seq 128, vocab
    64, AdamW) with :class:`goblin_dask.training.Trainer` and its defaults (stage tasks: each micro-batch
    group's forward and backward one volunteer task, replicated): seconds and bytes per home of the later
    rounds (the first traces the joint graph).  ``inner_steps`` H > 1: local steps (DiLoCo), a round of H
    inner steps on each of ``micro`` workers, H times the batch."""
    import torch
    import torch.nn.functional as F

    from capture import gpt, volunteer_chains
    from goblin_dask.training import Trainer

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    model = gpt(64, 256, 4, 128, 4).train()

    def loss(logits, y):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    client = bed.client()
    trainer = Trainer(model, loss, torch.optim.AdamW(model.parameters(), lr=3e-4), micro_batches=micro, client=client,
                      inner_steps=inner_steps)
    seconds, moved, tasks, losses, load0 = [], [], [], [], load()
    graph_tasks = trips = None
    for r in range(rounds):
        ids = rng.integers(0, 64, (batch * inner_steps, 129))
        x, y = ids[:, :-1].copy(), ids[:, 1:].copy()
        if r == 1:  # the graph of a traced round: its volunteer tasks and lab <-> volunteer round trips
            chains = volunteer_chains(trainer.round_graph(x, y)[0])
            graph_tasks, trips = chains["volunteer_tasks"], chains["round_trips"]
        time.sleep(1.5)  # the relay's counts are written every second
        before, tasks_before = bed.relayed_bytes(), bed.report()["tasks"]
        t = time.perf_counter()
        losses.append(float(trainer.step(x, y)))
        elapsed = time.perf_counter() - t
        time.sleep(1.5)
        after, report = bed.relayed_bytes(), bed.report()
        if r:
            seconds.append(elapsed)
            tasks.append(report["tasks"] - tasks_before)
            moved.append({h: {d: after[h][d] - before.get(h, {}).get(d, 0) for d in ("up", "down")} for h in after})
    rejected = bed.report()["rejected"]
    bed.close_clients()
    per_home = {h: {d: int(np.mean([m[h][d] for m in moved])) for d in ("up", "down")} for h in moved[0]}
    out = {"inner_steps": inner_steps, "round_seconds": round(float(np.mean(seconds)), 2),
           "rounds_timed": len(seconds), "bytes_per_round": per_home,
           "volunteer_tasks_per_round": float(np.mean(tasks)), "graph_volunteer_tasks": graph_tasks,
           "graph_round_trips": trips, "losses": [round(v, 4) for v in losses], "rejected": rejected,
           "parameter_bytes": int(sum(p.numel() * p.element_size() for p in model.parameters())),
           "load": [load0, load()]}
    if shaped:
        out["bound"] = links_bound(per_home, out["volunteer_tasks_per_round"], len(bed.homes))
        out["shaped_over_bound"] = round(out["round_seconds"] / out["bound"]["seconds"], 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--forward-repeats", type=int, default=0,
                        help="also a captured forward pass of the character LM, best of this many")
    parser.add_argument("--training-rounds", type=int, default=0,
                        help="also this many rounds of the character LM (benchmarks/training.py's), first one untimed")
    parser.add_argument("--inner-steps", default="1",
                        help="comma-separated: a training run for each (1: synchronous; H > 1: local steps)")
    args = parser.parse_args()
    inner = [int(h) for h in args.inner_steps.split(",") if h.strip()]
    if not inner or min(inner) < 1:
        sys.exit(f"benchmarks/wan.py: --inner-steps wants positive integers, got {args.inner_steps!r}")
    why = unavailable_reason()
    if why is not None:
        sys.exit(f"benchmarks/wan.py: the network testbed cannot be built here: {why}")
    out = {"n": args.n, "dtype": "float64", "links": {"up_mbit": UP_MBIT, "down_mbit": DOWN_MBIT, "delay_s": DELAY},
           "cpus": os.cpu_count()}
    t0 = time.perf_counter()
    for label, shaped in (("shaped", True), ("unshaped", False)):
        with tempfile.TemporaryDirectory(prefix="goblin-wan-") as work:
            options = dict(up_mbit=UP_MBIT, down_mbit=DOWN_MBIT, delay=DELAY) if shaped else \
                dict(up_mbit=None, down_mbit=None, delay=0.0)
            with Testbed(Path(work), **options) as bed:
                out[label] = measure(bed, args.n, args.repeats, shaped)
                if args.forward_repeats > 0:
                    out[label]["forward"] = measure_forward(bed, args.forward_repeats, shaped)
                if args.training_rounds > 1:
                    out[label]["training"] = {str(h): measure_training(bed, args.training_rounds, shaped, h) for h in inner}
        if not args.json:
            print(f"{label}: {json.dumps(out[label])}", flush=True)
    out["seconds_whole_run"] = round(time.perf_counter() - t0, 1)
    out["shaped_over_unshaped"] = round(out["shaped"]["seconds"] / out["unshaped"]["seconds"], 2)
    result_bytes = args.n * args.n * 8
    out["upload_over_result"] = round(sum(m["up"] for m in out["shaped"]["bytes"].values()) / result_bytes, 3)
    if args.forward_repeats > 0:
        out["forward_shaped_over_unshaped"] = round(out["shaped"]["forward"]["seconds"] / out["unshaped"]["forward"]["seconds"], 2)
    if args.training_rounds > 1:
        out["training_shaped_over_unshaped"] = {
            h: round(out["shaped"]["training"][h]["round_seconds"] / out["unshaped"]["training"][h]["round_seconds"], 2)
            for h in out["shaped"]["training"]}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
