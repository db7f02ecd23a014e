"""Samples per second of training on the embedded grid against torch's own loop (issue 18).

    python benchmarks/training.py [--quick] [--rounds 3] [--write]

One run, on this machine, the same models, initial weights, batches and micro-batches:

* **torch**: gradient accumulation over the micro-batches, then ``optimizer.step()``
  (``torch.set_num_threads(2)``);
* **grid**: :class:`goblin_dask.training.Trainer` on ``LabNode.local(volunteers=2)``: each round one
  dask graph, products on volunteers where the placement rule sends them, every volunteer result
  verified, the gradient sum and the optimizer step on the lab worker.

Models: an MLP (SGD + momentum), a small CNN with BatchNorm in train mode (SGD), a GPT-style
language model (AdamW; ``--d-model``, ``--layers``, ``--seq``; the issue's target size is 256/4/128).
The first grid round traces the joint graph (torch ``make_fx``) and is reported apart ("first");
samples/s is over the later rounds.  A round is timed as graph building + computing; the share of
building is given ("build").  ``--write`` records the table in ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _results import write_section  # noqa: E402

SECTION = "## Training on the grid (issue 18)"


def models(args):
    import torch
    from torch import nn
    import torch.nn.functional as F

    class CNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                          nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU())
            self.head = nn.Linear(32, 10)

        def forward(self, x):
            return self.head(self.features(x).mean(dim=(2, 3)))

    class Block(nn.Module):
        def __init__(self, d, heads, seq):
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
            self.register_buffer("mask", torch.ones(seq, seq, dtype=torch.bool).tril())

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
            q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask).transpose(1, 2).reshape(b, t, c)
            x = x + self.proj(y)
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class LM(nn.Module):
        def __init__(self, vocab, d, layers, seq, heads):
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
            self.blocks = nn.Sequential(*(Block(d, heads, seq) for _ in range(layers)))
            self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

        def forward(self, ids):
            return self.head(self.ln(self.blocks(self.tok(ids) + self.pos.weight[: ids.shape[1]])))

    def lm_loss(logits, y):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    b = args.batch
    out = []
    mlp = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    out.append(("MLP 256-512-512-10", mlp, F.cross_entropy,
                lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                [(rng.standard_normal((b, 256)).astype(np.float32), rng.integers(0, 10, b)) for _ in range(args.rounds)]))
    side = 16 if args.quick else 32
    out.append((f"CNN (BatchNorm, train) {side}x{side}", CNN().train(), F.cross_entropy,
                lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                [(rng.standard_normal((b, 3, side, side)).astype(np.float32), rng.integers(0, 10, b))
                 for _ in range(args.rounds)]))
    vocab, d, layers, seq = 64, args.d_model, args.layers, args.seq
    batches = []
    for _ in range(args.rounds):
        ids = rng.integers(0, vocab, (b, seq + 1))
        batches.append((ids[:, :-1].copy(), ids[:, 1:].copy()))
    out.append((f"LM d={d} layers={layers} seq={seq}", LM(vocab, d, layers, seq, max(1, d // 64)).train(), lm_loss,
                lambda p: torch.optim.AdamW(p, lr=3e-4), batches))
    return out


def torch_loop(model, loss_fn, opt, batches, micro):
    import torch

    t0 = time.perf_counter()
    for x, y in batches:
        opt.zero_grad()
        for idx in np.array_split(np.arange(len(x)), micro):
            (loss_fn(model(torch.from_numpy(x[idx])), torch.from_numpy(y[idx])) * (len(idx) / len(x))).backward()
        opt.step()
    return time.perf_counter() - t0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--only", default="", help="run only models whose name contains this")
    p.add_argument("--write", action="store_true", help="record the table in benchmarks/RESULTS.md")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.d_model, args.layers, args.seq, args.rounds = 8, 32, 2, 16, 3

    import torch

    from goblin_dask import LabNode
    from goblin_dask.training import Trainer

    torch.set_num_threads(2)
    rows = []
    with LabNode.local(volunteers=2) as node:
        for name, model, loss_fn, make_opt, batches in models(args):
            if args.only and args.only not in name:
                continue
            ref = copy.deepcopy(model)
            t_torch = torch_loop(ref, loss_fn, make_opt(ref.parameters()), batches, args.micro_batches)
            trainer = Trainer(model, loss_fn, make_opt(model.parameters()), micro_batches=args.micro_batches,
                              client=node.client)
            builds = []
            for x, y in batches:
                t0 = time.perf_counter()
                trainer.round_graph(x, y) if trainer.rounds else None  # build time alone (traced already)
                builds.append(time.perf_counter() - t0)
                trainer.step(x, y)
            h = trainer.history
            later = [e["seconds"] for e in h[1:]] or [h[0]["seconds"]]
            n = len(batches[0][0])
            grid_sps, torch_sps = n / np.mean(later), n * len(batches) / t_torch
            v = {}
            for e in h[1:]:
                for k, c in (e["verification"] or {}).get("by_method", {}).items():
                    v[k] = v.get(k, 0) + c
            rows.append((name, torch_sps, grid_sps, grid_sps / torch_sps, h[0]["seconds"],
                         np.mean(builds[1:]) if len(builds) > 1 else float("nan"), np.mean(later), v,
                         abs(h[-1]["loss"])))
            print(f"{name}: torch {torch_sps:.1f}/s, grid {grid_sps:.1f}/s ({grid_sps / torch_sps:.3f}x), "
                  f"first round {h[0]['seconds']:.1f} s, build {rows[-1][5]:.2f} s of {np.mean(later):.2f} s, "
                  f"checked {v}", flush=True)
    text = [SECTION, "",
            f"`python benchmarks/training.py{' --quick' if args.quick else ''}`: batch {args.batch}, "
            f"{args.micro_batches} micro-batches, {args.rounds} rounds, 2 volunteers, default placement.", "",
            "| model | torch samples/s | grid samples/s | grid / torch | first round s | build s | round s | checked (later rounds) |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name, ts, gs, ratio, first, build, rnd, v, _ in rows:
        text.append(f"| {name} | {ts:.1f} | {gs:.2f} | {ratio:.3f} | {first:.1f} | {build:.2f} | {rnd:.2f} | "
                    f"{', '.join(f'{k} {c}' for k, c in sorted(v.items()))} |")
    print("\n".join(text))
    if args.write:
        write_section(SECTION, "\n".join(text))


if __name__ == "__main__":
    main()
