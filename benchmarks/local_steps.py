"""Local steps (DiLoCo) against synchronous training, the same samples: loss, rounds, plotted (issue 28).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/local_steps.py [--steps 48] [--inner-steps 4 8]
        [--quick] [--write]

The notebook's language model (``notebooks/04_training.ipynb``: a character-level GPT, d 64, 4 heads,
2 layers, context 32, on Shakespeare's sonnets; AdamW lr 1e-2, weight decay 0.01), trained on
``LabNode.local(volunteers=2)`` by :class:`goblin_dask.training.Trainer` from the same initial weights on
the same stream of samples:

* **synchronous**: ``--steps`` rounds of ``--batch`` samples, each one optimizer step (``micro_batches=4``);
* **local steps H**: ``inner_steps=H``, ``--workers`` workers (``micro_batches``; 4, so that no task holds
  more than ``goblin.minimization.max-share``, a quarter, of a round's batch), rounds of ``H x --batch``
  samples (the next H synchronous batches): each worker takes H AdamW steps on its quarter, the lab one
  outer Nesterov SGD step (DiLoCo's lr 0.7, momentum 0.9).  So after the same samples each worker has
  taken as many steps as the synchronous run, on a quarter of its batch, and the lab has exchanged with
  the volunteers H times less often.

The loss compared is the held-out loss (512 windows the training never reads, computed by torch in
this process) every ``8 x --batch`` samples.  Every round's stage tasks are verified (replicas, the lab's
audits); the table says how many results were checked and rejected.  ``--write`` records the table in
``benchmarks/RESULTS.md`` and the plot in ``benchmarks/local_steps.png``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _results import write_section  # noqa: E402

SECTION = "## Local steps (DiLoCo) against synchronous training (issue 28)"
DATA = os.path.join(HERE, os.pardir, "notebooks", "data", "sonnets.txt")
CONTEXT = 32


def notebook_gpt(vocab: int):
    """The notebook's GPT (``04_training.ipynb``), built here so the benchmark needs no notebook."""
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self, d, heads):
            super().__init__()
            self.heads, self.ln1, self.ln2 = heads, nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(d, dim=2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self, d=64, heads=4, layers=2):
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(CONTEXT, d)
            self.blocks = nn.Sequential(*(Block(d, heads) for _ in range(layers)))
            self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

        def forward(self, ids):
            x = self.tok(ids) + self.pos.weight[:ids.shape[1]]
            return self.head(self.ln(self.blocks(x)))

    return GPT()


def lm_loss(logits, targets):
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def windows(tokens: np.ndarray, count: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    starts = rng.integers(0, len(tokens) - CONTEXT - 1, count)
    ids = np.stack([tokens[s:s + CONTEXT + 1] for s in starts])
    return ids[:, :-1].copy(), ids[:, 1:].copy()


def train(node, make_model, batches, inner: int, workers: int, eval_every: int, held_out) -> dict:
    """One run: rounds of ``inner`` consecutive batches; the held-out loss every ``eval_every`` samples."""
    import torch

    from goblin_dask.training import Trainer

    model = make_model()
    trainer = Trainer(model, lm_loss, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01),
                      micro_batches=workers, inner_steps=inner, client=node.client)
    probe = make_model()

    def held_out_loss() -> float:
        probe.load_state_dict({k: torch.from_numpy(v) for k, v in trainer.state_dict().items()})
        with torch.no_grad():
            return float(lm_loss(probe(torch.from_numpy(held_out[0])), torch.from_numpy(held_out[1])))

    curve, samples, t0 = [(0, held_out_loss())], 0, time.perf_counter()
    before = node.report()
    for r in range(len(batches) // inner):
        chunk = batches[r * inner:(r + 1) * inner]
        x, y = np.concatenate([c[0] for c in chunk]), np.concatenate([c[1] for c in chunk])
        trainer.step(x, y)
        samples += len(x)
        if samples % eval_every == 0:
            curve.append((samples, held_out_loss()))
    after = node.report()
    return {"curve": curve, "rounds": trainer.rounds, "seconds": time.perf_counter() - t0,
            "checked": after["accepted"] - before["accepted"], "rejected": after["rejected"] - before["rejected"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=48, help="synchronous optimizer steps (rounds)")
    p.add_argument("--batch", type=int, default=64, help="samples per synchronous step")
    p.add_argument("--inner-steps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--workers", type=int, default=4, help="micro_batches: the synchronous run's micro-batches, the "
                   "local-steps runs' workers")
    p.add_argument("--quick", action="store_true", help="a smoke run: 8 steps, H = 4")
    p.add_argument("--write", action="store_true", help=f"write {SECTION!r} and benchmarks/local_steps.png")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.inner_steps = 8, [4]
    cmd = "env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/local_steps.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    print("command:", cmd, flush=True)
    import torch

    from goblin_dask.node.local import LabNode

    text = open(DATA, encoding="utf-8").read()
    chars = sorted(set(text))
    tokens = np.array([chars.index(c) for c in text], dtype=np.int64)
    rng = np.random.default_rng(0)
    held_out = windows(tokens, 512, np.random.default_rng(999))
    batches = [windows(tokens, args.batch, rng) for _ in range(args.steps)]
    torch.manual_seed(0)
    initial = notebook_gpt(len(chars)).state_dict()

    def make_model():
        m = notebook_gpt(len(chars))
        m.load_state_dict(initial)
        return m.train()

    eval_every = 8 * args.batch
    runs = {}
    with LabNode.local(volunteers=2) as node:
        for inner in [1, *args.inner_steps]:
            runs[inner] = train(node, make_model, batches, inner, args.workers, eval_every, held_out)
            print(f"H={inner}: {runs[inner]}", flush=True)

    sync = dict(runs[1]["curve"])
    lines = [SECTION, "", f"`{cmd}`: the notebook's GPT, {args.steps} x {args.batch} samples, {args.workers} workers, 2 volunteers, one run.  "
             "Held-out loss (nats) after the same samples; in brackets, against synchronous training.", "",
             "| samples | " + " | ".join("synchronous" if h == 1 else f"local steps H={h}" for h in runs) + " |",
             "|---:|" + "---:|" * len(runs)]
    for samples, _ in runs[1]["curve"]:
        cells = []
        for h, r in runs.items():
            got = dict(r["curve"]).get(samples)
            cells.append("" if got is None else f"{got:.4f}" if h == 1 else f"{got:.4f} ({got / sync[samples] - 1:+.1%})")
        lines.append(f"| {samples} | " + " | ".join(cells) + " |")
    lines += ["", "| run | rounds (lab <-> volunteer exchanges) | optimizer steps per worker | wall s | results checked | rejected |",
              "|---|---:|---:|---:|---:|---:|"]
    for h, r in runs.items():
        lines.append(f"| {'synchronous' if h == 1 else f'H={h}'} | {r['rounds']} | {args.steps} | {r['seconds']:.0f} | "
                     f"{r['checked']} | {r['rejected']} |")
    print("\n".join(lines))
    if args.write:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for h, r in runs.items():
            xs, ys = zip(*r["curve"])
            ax.plot(xs, ys, "o-" if h == 1 else "x--", label="synchronous" if h == 1 else f"local steps, H={h}")
        ax.set_xlabel("samples")
        ax.set_ylabel("held-out cross-entropy (nats)")
        ax.set_title("the notebook's GPT: DiLoCo rounds against synchronous steps")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(HERE, "local_steps.png"), dpi=100)
        lines += ["", "![held-out loss against samples](local_steps.png)"]
        write_section(SECTION, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
