"""Issue 18: training on the grid, against torch's own training from the same initial weights and batches.

Every test runs real rounds on the embedded grid (lab node + 2 volunteer processes on 127.0.0.1):
the micro-batches' forward+backward products on volunteers (Freivalds-checked), the gradient sum
and the optimizer step on the lab worker.  The reference is torch's gradient accumulation over the
same micro-batches (``(loss_i * n_i / n).backward()``, then ``optimizer.step()``).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import dask  # noqa: E402
from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from goblin_dask.training import Trainer  # noqa: E402
from tests.torch_models import GPT  # noqa: E402

#: send even these small products to volunteers, so every round is computed and checked on the grid
TO_VOLUNTEERS = {"goblin.placement.min-flops": 0, "goblin.placement.min-intensity": 0,
                 "goblin.placement.min-product-intensity": 0}


def torch_rounds(model, loss_fn, optimizer, batches, micro_batches):
    """torch's own training: gradient accumulation over the same micro-batches, one step per batch."""
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        total = 0.0
        for idx in np.array_split(np.arange(len(x)), micro_batches):
            xi, yi = torch.from_numpy(x[idx]), torch.from_numpy(y[idx])
            loss = loss_fn(model(xi), yi) * (len(idx) / len(x))
            loss.backward()
            total += float(loss.detach())
        optimizer.step()
        losses.append(total)
    return losses


def grid_rounds(lab, model, loss_fn, optimizer, batches, micro_batches):
    trainer = Trainer(model, loss_fn, optimizer, micro_batches=micro_batches, client=lab.client)
    with dask.config.set(TO_VOLUNTEERS):
        history = trainer.fit(batches, progress=False)
    return trainer, [h["loss"] for h in history], history


def assert_same_training(trainer, losses, ref_model, ref_losses, tol):
    np.testing.assert_allclose(losses, ref_losses, rtol=tol, atol=tol)
    got, want = trainer.state_dict(), ref_model.state_dict()
    assert set(got) == set(want)
    for name, w in want.items():
        w = w.detach().numpy()
        assert got[name].shape == w.shape and got[name].dtype == w.dtype, name
        np.testing.assert_allclose(got[name], w, rtol=tol, atol=tol, err_msg=name)


def assert_checked_on_volunteers(history):
    """Every round: volunteer results accepted by the lab's checks, none rejected; products by Freivalds when
    the round runs op by op, stage tasks (a micro-batch's forward and backward) by replicas (``audit``: a replica
    pair the lab recomputed too, drawn at random, so a round of few stage tasks may count only audits)."""
    for h in history:
        v = h["verification"]
        assert v["rejected"] == 0 and v["accepted"] > 0
        assert sum(v["by_method"].get(m, 0) for m in ("freivalds", "replica", "audit")) > 0
        assert h["seconds"] > 0


def classification_batches(n_batches, batch, features, classes, seed):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((batch, *features)).astype(np.float32),
             rng.integers(0, classes, batch, dtype=np.int64)) for _ in range(n_batches)]


# -- 1. an MLP with SGD + momentum -----------------------------------------------------------------

@pytest.mark.slow
def test_mlp_sgd_momentum_matches_torch_over_8_steps_with_4_micro_batches(lab):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 5))
    ref = copy.deepcopy(model)
    batches = classification_batches(8, 16, (12,), 5, seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)

    trainer, losses, history = grid_rounds(lab, model, F.cross_entropy, opt, batches, 4)
    ref_losses = torch_rounds(ref, F.cross_entropy, ref_opt, batches, 4)

    assert_same_training(trainer, losses, ref, ref_losses, 1e-4)
    assert losses[-1] < losses[0]
    assert_checked_on_volunteers(history)
    fresh = copy.deepcopy(model)
    fresh.load_state_dict({k: torch.from_numpy(v) for k, v in trainer.state_dict().items()})
    assert trainer.plan.micro_batches == 4 and sum(s.parameter_bytes for s in trainer.plan.stages) == \
        sum(p.numel() * 4 for p in model.parameters())


# -- 2. a small CNN with BatchNorm in train mode -----------------------------------------------------

#: products (convolutions, linear layers) to volunteers; elementwise work stays at the lab (the default rule)
PRODUCTS_TO_VOLUNTEERS = {"goblin.placement.min-flops": 0, "goblin.placement.min-product-intensity": 0}


class SmallCNN(nn.Module):
    """conv-bn-relu, a strided conv-bn-relu, global average pool, linear: BatchNorm in train mode."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 12, 3, stride=2, padding=1), nn.BatchNorm2d(12), nn.ReLU())
        self.head = nn.Linear(12, 5)

    def forward(self, x):
        return self.head(self.features(x).mean(dim=(2, 3)))


@pytest.mark.slow
def test_cnn_with_batch_norm_in_train_mode_matches_torch_over_5_steps(lab):
    torch.manual_seed(2)
    model = SmallCNN().train()
    ref = copy.deepcopy(model)
    batches = classification_batches(5, 16, (3, 9, 9), 5, seed=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, nesterov=True)

    trainer = Trainer(model, F.cross_entropy, opt, micro_batches=4, client=lab.client)
    with dask.config.set(PRODUCTS_TO_VOLUNTEERS):
        history = trainer.fit(batches, progress=False)
    ref_losses = torch_rounds(ref, F.cross_entropy, ref_opt, batches, 4)

    assert_same_training(trainer, [h["loss"] for h in history], ref, ref_losses, 1e-4)
    # the running statistics moved (20 micro-batch forwards), and match torch's
    state = trainer.state_dict()
    assert int(state["features.1.num_batches_tracked"]) == 20
    assert not np.allclose(state["features.1.running_var"], 1.0)
    assert_checked_on_volunteers(history)


class SignalCNN(nn.Module):
    """Conv1d layers (one strided, one dilated) on a 2-channel signal, average over time, linear."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv1d(2, 6, 5, padding=2), nn.ReLU(),
                                      nn.Conv1d(6, 8, 3, stride=2, dilation=2, padding=1), nn.Tanh())
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.features(x).mean(dim=2))


def test_conv1d_training_matches_torch_over_3_steps(lab):
    """Conv1d forward and backward as 2-d convolutions of height 1, on the grid, against torch's own training."""
    torch.manual_seed(6)
    model = SignalCNN().train()
    ref = copy.deepcopy(model)
    batches = classification_batches(3, 8, (2, 24), 4, seed=7)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)

    trainer = Trainer(model, F.cross_entropy, opt, micro_batches=2, client=lab.client)
    with dask.config.set(PRODUCTS_TO_VOLUNTEERS):
        history = trainer.fit(batches, progress=False)
    ref_losses = torch_rounds(ref, F.cross_entropy, ref_opt, batches, 2)

    assert_same_training(trainer, [h["loss"] for h in history], ref, ref_losses, 1e-4)
    assert_checked_on_volunteers(history)


def test_training_a_transposed_convolution_is_refused_with_what_to_do():
    """Its forward is captured (tests/test_capture.py); its gradient is not mapped, and the refusal says so."""
    model = nn.Sequential(nn.ConvTranspose1d(2, 3, 3, stride=2), nn.Flatten(), nn.Linear(33, 2))
    trainer = Trainer(model.train(), F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(NotImplementedError) as e:
        trainer.round_graph(np.zeros((4, 2, 5), np.float32), np.zeros(4, np.int64))
    msg = str(e.value)
    assert "convolution_backward is mapped for 1-d and 2-d, non-transposed, groups=1" in msg
    assert "train a ConvTranspose or grouped layer in torch, or capture it for inference" in msg


# -- 3. a GPT-style language model with AdamW ------------------------------------------------------

VOCAB, CONTEXT = 17, 8


def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def volunteer_task_bytes(dsk, key):
    """Bytes of inputs + result of every task the round's graph places on volunteers, measured: the round is
    computed here (``dask.get``) and each volunteer task's dependencies and result weighed."""
    from dask.local import get_sync

    from goblin_dask.ops import CatalogTask

    keys = list(dsk)
    values = dict(zip(keys, get_sync(dsk, keys)))
    return {k: (t.op.name, sum(np.asarray(values[d]).nbytes for d in t.dependencies) + np.asarray(values[k]).nbytes)
            for k, t in dsk.items() if isinstance(t, CatalogTask) and t.placement == "volunteer"}


def peak_rss(pid):
    """The kernel's record of a process tree's peak resident memory (``VmHWM``, each process's high-water mark)."""
    import psutil

    root = psutil.Process(pid)
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        with open(f"/proc/{proc.pid}/status") as f:
            total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    return total


STAGE_MEMORY = 8000
VOLUNTEER_MEMORY = 1 << 30


@pytest.mark.slow
def test_gpt_language_model_with_adamw_matches_torch_over_5_steps():
    """Cut into 4 stages by ``stage_memory``; every volunteer task (a tile of a stage's forward or backward)
    holds at most ``stage_memory`` bytes of inputs and result; each volunteer's measured peak memory stays
    below its memory limit."""
    from goblin_dask.node.local import LabNode

    torch.manual_seed(4)
    model = GPT(vocab=VOCAB, d=16, heads=2, context=CONTEXT, layers=2).train()
    ref = copy.deepcopy(model)
    rng = np.random.default_rng(5)
    batches = []
    for _ in range(5):
        ids = rng.integers(0, VOCAB, (8, CONTEXT + 1), dtype=np.int64)
        batches.append((ids[:, :-1].copy(), ids[:, 1:].copy()))  # next-token targets
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1)

    with LabNode.local(volunteers=2, memory_limit=VOLUNTEER_MEMORY) as node:
        trainer = Trainer(model, lm_loss, opt, micro_batches=4, client=node.client, stage_memory=STAGE_MEMORY)
        # the tiles: the first round's graph, computed here, every volunteer task weighed
        with dask.config.set(scheduler="sync", **PRODUCTS_TO_VOLUNTEERS):
            tiles = volunteer_task_bytes(*trainer.round_graph(*batches[0]))
        with dask.config.set(PRODUCTS_TO_VOLUNTEERS):
            history = trainer.fit(batches, progress=False)
        workers = node.client.scheduler_info(n_workers=-1)["workers"]
        limits = {name: workers[addr]["memory_limit"] for name, addr in node.volunteer_addresses().items()}
        peaks = {name: peak_rss(node.processes[name].pid) for name in limits}
    ref_losses = torch_rounds(ref, lm_loss, ref_opt, batches, 4)

    assert_same_training(trainer, [h["loss"] for h in history], ref, ref_losses, 2e-3)
    assert_checked_on_volunteers(history)
    # the plan: embeddings together, each decoder block its own stage (13 kB > 8 kB), then norm + head
    assert len(trainer.plan.stages) >= 3
    assert [s.layers for s in trainer.plan.stages] == [["tok", "pos"], ["blocks.0"], ["blocks.1"], ["ln", "head"]]
    assert sum(s.parameter_bytes for s in trainer.plan.stages) == sum(p.numel() * 4 for p in model.parameters())
    # every volunteer task fits stage_memory (products cut into tiles: without the cap some hold 9.5 kB)
    assert tiles and {op for op, _ in tiles.values()} >= {"matmul", "matmul_accumulate"}
    assert max(b for _, b in tiles.values()) <= STAGE_MEMORY, max(tiles.values(), key=lambda t: t[1])
    # each volunteer's peak resident memory (the kernel's high-water mark, startup included) below its limit
    assert len(peaks) == 2 and all(limits[n] == VOLUNTEER_MEMORY for n in limits)
    assert all(0 < peaks[n] < limits[n] for n in peaks), (peaks, limits)


# -- 4. a cheating volunteer during training --------------------------------------------------------

@pytest.mark.slow
def test_a_cheating_volunteer_never_corrupts_a_gradient():
    """One honest volunteer and one that adds noise to every result: training still equals torch's
    (every corrupted result was rejected and recomputed before the lab summed it), the cheater is banned."""
    honest, cheater, report, history = train_mlp_beside(
        "noise", seed=6, rounds=6, batch_seed=7, optimizer=lambda params: torch.optim.Adam(params, lr=1e-2))
    assert report["volunteers"][cheater]["rejected"] >= 1 and report["volunteers"][cheater]["banned"]
    assert all(report["volunteers"][h]["rejected"] == 0 and not report["volunteers"][h]["banned"] for h in honest)
    assert sum(h["verification"]["rejected"] for h in history) >= 1


# -- 4b. a volunteer killed in the middle of a round -------------------------------------------------

@pytest.mark.slow
def test_a_volunteer_killed_in_the_middle_of_a_round_the_round_completes_right():
    """A volunteer killed while it computes a task of a round (it holds one, or finished one and the round goes
    on): the round completes with torch's numbers, and so does the next.  A round can finish before the kill
    lands (a small MLP's round is a few stage tasks): then the next round is tried, up to four."""
    import threading

    from goblin_dask.node.local import LabNode
    from tests.conftest import wait_for

    torch.manual_seed(12)
    model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    ref = copy.deepcopy(model)
    batches = classification_batches(6, 16, (12,), 4, seed=13)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    used = []
    with LabNode.local(volunteers=2) as node:
        victim = node.volunteer_names()[0]
        address = next(a for a, w in node.client.scheduler_info()["workers"].items() if w.get("name") == victim)
        trainer = Trainer(model, F.cross_entropy, opt, micro_batches=4, client=node.client)
        with dask.config.set(TO_VOLUNTEERS):
            trainer.step(*batches[0])
            used.append(batches[0])
            killed, errors = False, []
            for batch in batches[1:5]:
                done = node.report()["volunteers"][victim]["accepted"]

                def round_k(batch=batch):
                    try:
                        trainer.step(*batch)
                    except Exception as e:  # pragma: no cover - reported below
                        errors.append(e)

                t = threading.Thread(target=round_k)
                t.start()
                used.append(batch)
                wait_for(lambda: not t.is_alive() or node.client.processing(workers=[address]).get(address)
                         or node.report()["volunteers"][victim]["accepted"] > done,
                         f"{victim} to take a task of the round", interval=0.005)
                if t.is_alive():
                    node.kill_volunteer(victim)
                    killed = True
                t.join()
                assert not errors, errors
                if killed:
                    break
            assert killed, "every round finished before the volunteer could be killed"
            trainer.step(*batches[5])
            used.append(batches[5])
        trainer.state_dict()  # while the lab worker that kept the last round's parameters is there
    ref_losses = torch_rounds(ref, F.cross_entropy, ref_opt, used, 4)
    assert_same_training(trainer, [h["loss"] for h in trainer.history], ref, ref_losses, 1e-4)
    assert all(h["verification"]["rejected"] == 0 for h in trainer.history)


# -- 4c. a slow volunteer: the round goes on without it after its deadline -------------------------

@pytest.mark.slow
def test_a_slow_volunteer_never_holds_a_round_past_its_deadline():
    """A volunteer that takes a task and never returns it (``tests.cheaters --cheat stall``): after
    ``goblin.verification.deadline`` the ledger reissues its tasks to the honest volunteer and the volunteer
    rests (``goblin.faults.cooldown``), and every round completes with torch's numbers."""
    with dask.config.set({"goblin.verification.deadline": 1.0}):  # the lab node takes the caller's goblin.* config
        honest, slow, report, history = train_mlp_beside(
            "stall", seed=14, rounds=3, batch_seed=15,
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    assert report["reissued"] >= 1 and report["volunteers"][slow]["late"] >= 1
    # once late, it rests (a cooldown of 60 s, longer than the rounds): no round waits on it a second time
    assert report["volunteers"][slow]["late"] == report["volunteers"][slow]["cooldowns"] == 1
    assert report["volunteers"][slow]["accepted"] == 0  # it never returned anything: all its tasks went elsewhere
    assert all(report["volunteers"][h]["accepted"] > 0 for h in honest)
    assert all(h["verification"]["rejected"] == 0 for h in history)


# -- 4d. dropout: seeded masks, the same on every replica --------------------------------------------

class MaskedDropout(nn.Module):
    """The reference's dropout: multiplies by the next of ``masks`` (the grid's, drawn again with NumPy)."""

    def __init__(self, masks, p):
        super().__init__()
        self.masks, self.p = iter(masks), p

    def forward(self, x):
        return x * torch.from_numpy(next(self.masks)) / (1 - self.p)


def grid_masks(seed, rounds, micro_batches, rows, width, p):
    """The grid's dropout masks, drawn again: micro-batch i of round r keeps where
    ``PCG64((seed, r, i, k=0, block 0, 0)).random() < 1 - p`` (one block per activation here)."""
    out = []
    for r in range(rounds):
        for i, n in enumerate(rows):
            u = np.random.Generator(np.random.PCG64([seed, r, i, 0, 0, 0])).random((n, width), dtype=np.float32)
            out.append((u < np.float32(1 - p)).astype(np.float32))
    return out


@pytest.mark.slow
def test_dropout_in_train_mode_uses_seeded_masks_that_replicas_agree_on(lab):
    """nn.Dropout in train mode trains on the grid: each micro-batch's mask comes from the trainer's seed, the
    round and the micro-batch (catalog ``random_uniform`` blocks, replica-checked on volunteers); torch with the
    same masks gives the same training, and the masks keep 1 - p of the units."""
    torch.manual_seed(16)
    p, seed = 0.25, 1234
    model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Dropout(p), nn.Linear(32, 5)).train()
    ref = copy.deepcopy(model)
    batches = classification_batches(3, 16, (12,), 5, seed=17)
    masks = grid_masks(seed, 3, 4, [4, 4, 4, 4], 32, p)
    ref[2] = MaskedDropout(masks, p)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)

    trainer = Trainer(model, F.cross_entropy, opt, micro_batches=4, client=lab.client, seed=seed)
    with dask.config.set(TO_VOLUNTEERS):
        history = trainer.fit(batches, progress=False)
    ref_losses = torch_rounds(ref, F.cross_entropy, ref_opt, batches, 4)

    assert_same_training(trainer, [h["loss"] for h in history], ref, ref_losses, 1e-4)
    assert_checked_on_volunteers(history)
    assert sum(h["verification"]["by_method"].get("replica", 0) for h in history) > 0  # the masks, replicated
    kept = np.mean(masks)  # 1536 units: the rate within 0.05 of 1 - p (4.5 standard deviations)
    assert abs(kept - (1 - p)) < 0.05, kept
    assert all(0 < m.mean() < 1 for m in masks)  # every micro-batch dropped some units and kept some


def test_dropout_masks_depend_on_the_seed_round_and_micro_batch_only():
    """Two trainers with the same seed build the same random tasks (replicas and validators draw the same
    masks) and compute the same loss; another seed, or the next round, draws other masks."""
    from dask.local import get_sync

    from goblin_dask.ops import CatalogTask

    torch.manual_seed(18)
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.5), nn.Linear(16, 3)).train()
    x = np.random.default_rng(1).standard_normal((8, 6)).astype(np.float32)
    y = np.arange(8, dtype=np.int64) % 3

    def seeds_and_loss(seed, rounds=0):
        trainer = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), micro_batches=2,
                          seed=seed)
        trainer.rounds = rounds
        with dask.config.set(scheduler="sync"):
            dsk, key = trainer.round_graph(x, y)
        seeds = sorted(tuple(t.kwargs["seed"]) for t in dsk.values()
                       if isinstance(t, CatalogTask) and t.op.name == "random_uniform")
        return seeds, get_sync(dsk, key)["loss"]

    seeds, loss = seeds_and_loss(7)
    assert seeds == [(7, 0, 0, 0, 0, 0), (7, 0, 1, 0, 0, 0)]
    assert seeds_and_loss(7) == (seeds, loss)
    assert seeds_and_loss(8)[1] != loss and seeds_and_loss(7, rounds=1)[1] != loss


# -- 5. checkpoints ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_resuming_from_a_checkpoint_continues_the_same_training(lab, tmp_path):
    """4 rounds with a checkpoint every 2; a new Trainer resumed from round 2 (fresh model and optimizer)
    reaches the same parameters and Adam state as the uninterrupted run."""
    torch.manual_seed(10)
    model = nn.Sequential(nn.Linear(10, 16), nn.GELU(), nn.Linear(16, 3))
    initial = copy.deepcopy(model)
    batches = classification_batches(4, 8, (10,), 3, seed=11)
    trainer = Trainer(model, F.cross_entropy, torch.optim.Adam(model.parameters(), lr=1e-2), micro_batches=2,
                      client=lab.client, checkpoint_dir=tmp_path, checkpoint_every=2)
    with dask.config.set(PRODUCTS_TO_VOLUNTEERS):
        trainer.fit(batches, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "round-000002", "round-000004"]
    assert (tmp_path / "latest").read_text() == "round-000004"

    again = copy.deepcopy(initial)
    resumed = Trainer.resume(tmp_path / "round-000002", again, F.cross_entropy,
                             torch.optim.Adam(again.parameters(), lr=1e-2), micro_batches=2, client=lab.client)
    assert resumed.rounds == 2 and len(resumed.history) == 2
    assert resumed.seed == trainer.seed  # dropout's masks continue the same draws
    with dask.config.set(PRODUCTS_TO_VOLUNTEERS):
        resumed.fit(batches[2:], progress=False)
    assert [h["loss"] for h in resumed.history] == pytest.approx([h["loss"] for h in trainer.history], abs=1e-6)
    for name, want in trainer.state_dict().items():
        np.testing.assert_allclose(resumed.state_dict()[name], want, rtol=1e-6, atol=1e-7, err_msg=name)
    assert resumed._state[0]["step"] == 4.0
    with pytest.raises(ValueError, match="another model"):
        other = nn.Linear(10, 3)
        Trainer.resume(tmp_path, other, F.cross_entropy, torch.optim.Adam(other.parameters()))


# -- fast: the lab's optimizer mathematics, the contract's errors, no torch in goblin_dask ------------

@pytest.mark.parametrize("make", [
    lambda p: torch.optim.SGD(p, lr=0.1),
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01),
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, maximize=True),
    lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.01),
    lambda p: torch.optim.Adam(p, lr=1e-2, betas=(0.3, 0.9), amsgrad=True),
    lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
], ids=["sgd", "sgd-momentum-dampening-wd", "sgd-nesterov-maximize", "adam-wd", "adam-amsgrad-beta", "adamw"])
def test_the_labs_optimizer_step_is_torchs(make):
    from goblin_dask.training import optim
    from goblin_dask.training.trainer import _hyper

    rng = np.random.default_rng(8)
    p0 = rng.standard_normal((5, 7)).astype(np.float32)
    t = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    opt = make([t])
    p, state = p0.copy(), {}
    for _ in range(6):
        g = rng.standard_normal((5, 7)).astype(np.float32)
        t.grad = torch.from_numpy(g.copy())
        opt.step()
        h = _hyper(opt.param_groups[0], type(opt).__name__)
        p = (optim.sgd if h["kind"] == "sgd" else optim.adam)(p, g, state, h)
        assert p.dtype == np.float32
    np.testing.assert_allclose(p, t.detach().numpy(), rtol=1e-6, atol=1e-7)


def test_bad_input_is_refused_before_anything_is_sent():
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="RMSprop"):
        Trainer(model, F.mse_loss, torch.optim.RMSprop(model.parameters()))
    with pytest.raises(ValueError, match="micro_batches"):
        Trainer(model, F.mse_loss, opt, micro_batches=0)
    other = nn.Linear(4, 2)
    with pytest.raises(ValueError, match="not the model's"):
        Trainer(model, F.mse_loss, torch.optim.SGD(other.parameters(), lr=0.1))
    trainer = Trainer(model, F.mse_loss, opt, micro_batches=4)
    x, y = np.zeros((8, 4), np.float32), np.zeros((8, 2), np.float32)
    with pytest.raises(ValueError, match=r"\(8, 4\).*\(6, 2\)"):
        trainer.round_graph(x, y[:6])
    with pytest.raises(ValueError, match="batch of 2 cannot be cut into 4"):
        trainer.round_graph(x[:2], y[:2])
    with pytest.raises(TypeError, match="float64.*float32"):
        trainer.round_graph(x.astype(np.float64), y)


class Spectrum(nn.Module):
    def forward(self, x):
        return torch.fft.rfft(x).abs()  # an FFT: no catalog operation computes it


def test_an_operator_the_catalog_lacks_is_refused_at_trace_time_with_its_place():
    from goblin_dask.torch_capture import UnsupportedOperator

    model = nn.Sequential(nn.Linear(4, 8), Spectrum(), nn.Linear(5, 2)).train()
    trainer = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(UnsupportedOperator, match=r"aten\._fft_r2c(.|\n)*test_training\.py") as e:
        trainer.round_graph(np.zeros((8, 4), np.float32), np.zeros(8, np.int64))
    assert "what to do: run that part of the model in torch on your machine" in str(e.value)


def test_a_gradient_the_table_lacks_is_refused_as_the_backward_of_a_forward_that_maps():
    """Max pooling's forward maps (tests/test_capture.py); its gradient is an operator the table lacks, written by
    torch's autograd with no source line of the model's: the refusal says it is the backward, and what to do."""
    from goblin_dask.torch_capture import UnsupportedOperator

    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8, 2)).train()
    trainer = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(UnsupportedOperator, match=r"aten\.max_pool2d_with_indices_backward(.|\n)*in the backward "
                                                  r"pass") as e:
        trainer.round_graph(np.zeros((8, 1, 6, 6), np.float32), np.zeros(8, np.int64))
    assert "capture the model for inference, or train that part in torch" in str(e.value)


class OrderStatistics(nn.Module):
    """Scores, then sort (descending, along either axis), topk, median and kthvalue of them: each one's gradient is
    torch's scatter of the incoming gradient to the positions its indices name."""

    def __init__(self):
        super().__init__()
        self.score = nn.Linear(6, 8)

    def forward(self, x):
        h = self.score(x)
        return (torch.sort(h, dim=1, descending=True).values[:, :3].sum(1) + torch.topk(h, 2, dim=1).values.sum(1)
                + torch.median(h, dim=1).values + torch.kthvalue(h, 3, dim=1).values
                + torch.sort(h, dim=0).values[1].sum() + torch.msort(h)[0].sum())


def test_gradients_through_sort_topk_median_kthvalue_are_torchs():
    """The round's graph (forward and backward, traced as the Trainer traces it) against torch's autograd."""
    from goblin_dask.training import joint

    torch.manual_seed(3)
    model = OrderStatistics().train()
    x, y = torch.randn(5, 6), torch.randn(5)  # random scores: no ties, so every index torch gives is defined

    def loss_fn(out, target):
        return ((out - target) ** 2).mean()

    names = [n for n, _ in model.named_parameters()]
    graph = joint.trace(model, loss_fn, x.numpy(), y.numpy(), names, [])
    assert "aten.scatter.src" in {n["op"] for n in graph.nodes}
    got = [o.compute(scheduler="sync") for o in graph(*(p.detach().numpy() for p in model.parameters()), x.numpy(),
                                                     y.numpy())]
    loss = loss_fn(model(x), y)
    loss.backward()
    np.testing.assert_allclose(got[0], loss.item(), rtol=1e-6)
    for name, g, p in zip(names, got[1:], model.parameters()):
        np.testing.assert_allclose(g, p.grad.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


class Quantiles(nn.Module):
    """Scores, then torch.quantile and nanquantile of them in each interpolation, a level a float or a buffer of
    several: the gradient of each level goes to the one or two values it lies between (scatter_add)."""

    def __init__(self):
        super().__init__()
        self.score = nn.Linear(6, 8)
        self.register_buffer("levels", torch.tensor([0.1, 0.5, 0.9]))

    def forward(self, x):
        h = self.score(x)
        return (torch.quantile(h, 0.3, dim=1) + torch.quantile(h, 0.75, dim=1, interpolation="nearest")
                + torch.nanquantile(h, 0.4, dim=1, interpolation="midpoint")
                + torch.quantile(h, self.levels, dim=1).sum(0) + torch.quantile(h, 0.6, dim=0, keepdim=True).sum()
                + torch.quantile(h, 0.2, dim=1, interpolation="lower") * torch.quantile(h, 0.8, dim=1,
                                                                                        interpolation="higher"))


def test_gradients_through_quantile_and_nanquantile_are_torchs():
    """The round's graph against torch's autograd (quantile's backward scatters into an empty_permuted tensor)."""
    from goblin_dask.training import joint

    torch.manual_seed(4)
    model = Quantiles().train()
    x, y = torch.randn(5, 6), torch.randn(5)

    def loss_fn(out, target):
        return ((out - target) ** 2).mean()

    names = [n for n, _ in model.named_parameters()]
    graph = joint.trace(model, loss_fn, x.numpy(), y.numpy(), names, ["levels"])
    assert {"aten.scatter_add.default", "aten.empty_permuted.default"} <= {n["op"] for n in graph.nodes}
    got = [o.compute(scheduler="sync") for o in graph(*(p.detach().numpy() for p in model.parameters()),
                                                     model.levels.numpy(), x.numpy(), y.numpy())]
    loss = loss_fn(model(x), y)
    loss.backward()
    np.testing.assert_allclose(got[0], loss.item(), rtol=1e-6)
    for name, g, p in zip(names, got[1:], model.parameters()):
        np.testing.assert_allclose(g, p.grad.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


def test_the_round_is_one_graph_ending_at_the_lab():
    """Per micro-batch forward+backward catalog tasks, then one task (the lab's optimizer step) that reads them all."""
    from dask._task_spec import Task

    from goblin_dask.ops import CatalogTask
    from goblin_dask.ops.spec import LabChain

    torch.manual_seed(9)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    trainer = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), micro_batches=2)
    x = np.random.default_rng(0).standard_normal((6, 6)).astype(np.float32)
    y = np.arange(6, dtype=np.int64) % 3
    with dask.config.set({"goblin.stage.tasks": False}):  # op by op, even where a lab node from another test is around
        dsk, key = trainer.round_graph(x, y)
    others = [k for k, t in dsk.items() if isinstance(t, Task) and not isinstance(t, CatalogTask) and
              getattr(t.func, "__module__", "").startswith("goblin_dask.training")]
    assert others == [key]
    steps = [s for t in dsk.values() for s in (t.steps if isinstance(t, LabChain) else (t,))]  # fused lab chains opened
    assert sum(isinstance(t, CatalogTask) and t.op.name == "matmul" for t in steps) >= 2 * 3  # fwd + bwd, per micro-batch
    assert trainer.plan.micro_batches == 2 and [s.layers for s in trainer.plan.stages] == [["0", "1", "2"]]
    cut = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), stage_memory=120).plan
    assert [s.layers for s in cut.stages] == [["0"], ["1", "2"]]  # 224 bytes > 120: its own stage; 0 + 108 fit


def test_goblin_dask_and_the_training_package_import_without_torch():
    import subprocess
    import sys

    code = ("import sys, goblin_dask, goblin_dask.training; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_fit_progress_is_one_line_redrawn_with_a_bar(capsys):
    from goblin_dask.training.trainer import _progress_line

    entry = {"round": 3, "loss": 1.25, "seconds": 0.5, "verification": {"accepted": 7, "rejected": 1}}
    _progress_line(entry, 3, 4, width=8, tty=True)
    _progress_line(entry, 5, None, tty=True)
    err = capsys.readouterr().err
    assert err.startswith("\r[######  ] 3/4 round 3: loss 1.25000, 0.50 s, 7 checked results, 1 rejected")
    assert "\r5 rounds round 3" in err and "\n" not in err


def test_fit_progress_off_a_terminal_is_one_line_per_round(capsys):
    from goblin_dask.training.trainer import _progress_line

    entry = {"round": 3, "loss": 1.25, "seconds": 0.5, "verification": {"accepted": 7, "rejected": 1}}
    _progress_line(entry, 3, 4, width=8)  # capsys's stderr is no terminal: a log file's lines
    _progress_line(entry, 4, 4, width=8)
    assert capsys.readouterr().err.splitlines() == [
        "[######  ] 3/4 round 3: loss 1.25000, 0.50 s, 7 checked results, 1 rejected",
        "[########] 4/4 round 3: loss 1.25000, 0.50 s, 7 checked results, 1 rejected"]


def train_mlp_beside(cheat: str, *, seed: int, rounds: int, batch_seed: int, optimizer):
    """An MLP trained on one honest volunteer and one running ``tests.cheaters --cheat CHEAT``; asserts torch's
    numbers (1e-4) and returns (honest names, the other's name, ``node.report()``, the trainer's history)."""
    from goblin_dask.node.local import LabNode

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 4))
    ref = copy.deepcopy(model)
    batches = classification_batches(rounds, 16, (12,), 4, seed=batch_seed)
    opt, ref_opt = optimizer(model.parameters()), optimizer(ref.parameters())
    with LabNode.local(volunteers=1) as node:
        honest = node.volunteer_names()
        other = node.add_volunteer(module="tests.cheaters", extra_args=("--cheat", cheat))
        trainer = Trainer(model, F.cross_entropy, opt, micro_batches=4, client=node.client)
        with dask.config.set(TO_VOLUNTEERS):
            history = trainer.fit(batches, progress=False)
        report = node.report()
    ref_losses = torch_rounds(ref, F.cross_entropy, ref_opt, batches, 4)
    assert_same_training(trainer, [h["loss"] for h in history], ref, ref_losses, 1e-4)
    return honest, other, report, history


def _numpy_adam(p, g, state, h):
    """torch's single-tensor Adam written with NumPy operations, in torch's order: the one-pass kernel's oracle."""
    if h["maximize"]:
        g = -g
    step = float(state.get("step", 0.0)) + 1
    state["step"] = step
    lr, (beta1, beta2), wd = h["lr"], h["betas"], h["weight_decay"]
    if wd != 0:
        if h["decoupled_weight_decay"]:
            p = p * (1 - lr * wd)
        else:
            g = g + wd * p
    ea, eas = state.get("exp_avg", np.zeros_like(p)), state.get("exp_avg_sq", np.zeros_like(p))
    w = 1 - beta1
    ea = ea + w * (g - ea) if w < 0.5 else g - (g - ea) * (1 - w)
    eas = eas * beta2 + (1 - beta2) * g * g
    state["exp_avg"], state["exp_avg_sq"] = ea, eas
    if h["amsgrad"]:
        eas = np.maximum(state.get("max_exp_avg_sq", np.zeros_like(p)), eas)
        state["max_exp_avg_sq"] = eas
    denom = np.sqrt(eas) / (1 - beta2 ** step) ** 0.5 + h["eps"]
    return p + (-(lr / (1 - beta1 ** step))) * (ea / denom)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_one_pass_adam_step_gives_numpys_numbers_bit_for_bit_and_leaves_its_inputs(dtype):
    """The lab's optimizer step runs Adam in one numba pass (AdamW's defaults and every other branch): the same
    bits as NumPy's operations in torch's order, over steps, for every option, zeros and a NaN included; the
    state that came in (a value the lab worker may still hold) is never written; and within rounding of torch."""
    import itertools

    from goblin_dask.training import optim

    rng = np.random.default_rng(3)
    for amsgrad, maximize, wd, decoupled, beta1 in itertools.product((False, True), (False, True), (0.0, 0.01),
                                                                      (False, True), (0.9, 0.3)):
        h = dict(lr=1e-2, betas=(beta1, 0.999), weight_decay=wd, decoupled_weight_decay=decoupled, amsgrad=amsgrad,
                 maximize=maximize, eps=1e-8)
        want_p = got_p = rng.standard_normal((7, 33)).astype(dtype)
        want_s, got_s = {}, {}
        for k in range(3):
            g = rng.standard_normal((7, 33)).astype(dtype)
            g[0, :3] = 0
            if k == 2:
                g[1, 1] = np.nan
            came_in = [(v, v.copy()) for v in (got_p, g, *got_s.values()) if isinstance(v, np.ndarray)]
            want_p = _numpy_adam(want_p, g, want_s, h)
            got_p = optim.adam(got_p, g, got_s, h)
            assert got_p.dtype == dtype and got_p.shape == (7, 33)
            np.testing.assert_array_equal(got_p, want_p, err_msg=str(h))
            assert set(got_s) == set(want_s)
            for n in want_s:
                np.testing.assert_array_equal(np.asarray(got_s[n]), np.asarray(want_s[n]), err_msg=n)
            for v, copy_ in came_in:  # the inputs, state included, as they came
                np.testing.assert_array_equal(v, copy_)
    # beside torch's AdamW itself
    p = torch.randn(500, dtype=torch.float32 if dtype == np.float32 else torch.float64)
    mine, state = p.numpy().copy(), {}
    p = p.clone().requires_grad_(True)
    opt = torch.optim.AdamW([p], lr=1e-2)
    h = dict(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.01, decoupled_weight_decay=True, amsgrad=False,
             maximize=False, eps=1e-8)
    for _ in range(4):
        g = torch.randn_like(p)
        p.grad = g.clone()
        opt.step()
        mine = optim.adam(mine, g.numpy(), state, h)
    np.testing.assert_allclose(mine, p.detach().numpy(), rtol=1e-5, atol=1e-6)
