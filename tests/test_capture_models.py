"""Issue 17: whole models captured with ``goblin_dask.capture``, against torch's own forward from the same weights.

A residual block with batch norm, GPT-style decoder language models (scaled_dot_product_attention with
``is_causal=True``, and an explicit tril mask with masked_fill), a model of integer ops (exact), and the
GPT-style model and the residual block computed on the embedded grid with every volunteer result verified.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import dask  # noqa: E402

import goblin_dask  # noqa: E402
import goblin_dask.array as ga  # noqa: E402
from goblin_dask.ops import catalog  # noqa: E402
from tests.torch_models import GPT, IntegerOps, ResidualBlock  # noqa: E402

VOCAB, CONTEXT = 17, 8


def outputs(out) -> list:
    outs = out if isinstance(out, tuple) else (out,)
    assert all(isinstance(o, ga.Array) for o in outs)
    return list(outs)


def run(graph, *inputs) -> list[np.ndarray]:
    return [o.compute(scheduler="threads") for o in outputs(graph(*inputs))]


def reference(model, *inputs) -> list[np.ndarray]:
    with torch.no_grad():
        out = model(*(torch.from_numpy(x) for x in inputs))
    return [t.numpy() for t in (out if isinstance(out, tuple) else (out,))]


def close(got, want):
    """float32 within 2e-5, relative to the output's scale (logits and activations are O(1)..O(10))."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, g.dtype, w.shape, w.dtype)
        scale = max(1.0, float(np.abs(w).max()))
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5 * scale)


def exact(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, g.dtype, w.shape, w.dtype)
        np.testing.assert_array_equal(g, w)


def images(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def tokens(batch, length=CONTEXT, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, length), dtype=np.int64)


def gpt(explicit_mask: bool, d: int = 16, heads: int = 2, arange_positions: bool = False):
    torch.manual_seed(1)
    model = GPT(vocab=VOCAB, d=d, heads=heads, context=CONTEXT, explicit_mask=explicit_mask,
                arange_positions=arange_positions).eval()
    return model, goblin_dask.capture(model, (torch.from_numpy(tokens(2)),))


@pytest.fixture(scope="module")
def residual():
    torch.manual_seed(0)
    model = ResidualBlock(4).eval()
    return model, goblin_dask.capture(model, (torch.from_numpy(images(2, 4, 6, 6)),))


@pytest.fixture(scope="module")
def gpt_masked():
    return gpt(explicit_mask=True)


# -- 1. residual block ---------------------------------------------------------------------------

@pytest.mark.parametrize("batch", [2, 3])
def test_residual_block_with_batch_norm_matches_torch(residual, batch):
    model, g = residual
    assert {"conv2d", "batch_norm", "relu", "add"} <= g.ops <= set(catalog())
    x = images(batch, 4, 6, 6, seed=batch)
    close(run(g, x), reference(model, x))


# -- 2. GPT-style decoder ------------------------------------------------------------------------

@pytest.mark.parametrize("batch", [2, 5])  # the example's batch size, and another
def test_gpt_with_explicit_causal_mask_matches_torch(gpt_masked, batch):
    model, g = gpt_masked
    assert {"take", "layer_norm", "gelu", "softmax", "matmul", "where"} <= g.ops <= set(catalog())
    ids = tokens(batch, seed=10 + batch)
    close(run(g, ids), reference(model, ids))


def test_gpt_with_scaled_dot_product_attention_is_causal_matches_torch():
    # torch.export decomposes F.scaled_dot_product_attention(is_causal=True) into core ATen that builds
    # the causal mask with aten.arange, aten.full, aten.scalar_tensor and aten.where.
    model, g = gpt(explicit_mask=False)
    assert {"take", "layer_norm", "gelu", "softmax", "matmul"} <= g.ops <= set(catalog())
    for batch in (2, 3):
        ids = tokens(batch, seed=20 + batch)
        close(run(g, ids), reference(model, ids))


def test_gpt_with_position_embedding_looked_up_at_arange_matches_torch():
    model, g = gpt(explicit_mask=True, arange_positions=True)
    ids = tokens(3, seed=40)
    close(run(g, ids), reference(model, ids))


def test_gpt_sequence_length_other_than_the_example_is_refused(gpt_masked):
    """Only the batch size is symbolic: a shorter sequence is refused up front, not computed into wrong logits."""
    _, g = gpt_masked
    assert isinstance(g.inputs[0]["shape"][0], str) and g.inputs[0]["shape"][1] == CONTEXT
    with pytest.raises(ValueError, match="the model takes"):
        g(tokens(2, length=CONTEXT - 3, seed=4))


# -- 3. integer ops ------------------------------------------------------------------------------

def test_integer_model_is_exact():
    model = IntegerOps().eval()
    rng = np.random.default_rng(3)
    g = goblin_dask.capture(model, (torch.from_numpy(rng.integers(0, 1000, (3, 6), dtype=np.int64)),))
    assert {"floor_divide", "remainder", "bitwise_and", "bitwise_or", "bitwise_xor", "invert", "astype",
            "cumsum"} <= g.ops <= set(catalog())
    for batch in (3, 4):
        ids = rng.integers(0, 100_000, (batch, 6), dtype=np.int64)
        want = reference(model, ids)
        assert want[-1].dtype == np.int32 and want[3].dtype == np.int64
        exact(run(g, ids), want)


# -- 4. on the embedded grid ---------------------------------------------------------------------

def _volunteer_accepted(report) -> int:
    return sum(v["accepted"] for v in report["volunteers"].values())


def _verified_by_volunteers(lab, before) -> dict:
    """The ledger since ``before``: volunteers computed tasks, each checked and accepted, by Freivalds (products op
    by op) or by replicas (stage tasks)."""
    after = lab.report()
    assert after["rejected"] == before["rejected"] == 0
    assert all(v["rejected"] == 0 for v in after["volunteers"].values())
    assert after["accepted"] > before["accepted"]
    assert _volunteer_accepted(after) > _volunteer_accepted(before)
    checked = ("freivalds", "replica")
    assert sum(after["by_method"].get(m, 0) - before["by_method"].get(m, 0) for m in checked) > 0
    assert sum(after["by_method"].values()) == after["accepted"]  # every accepted result says how it was checked
    return after


@pytest.mark.slow
def test_captured_models_on_the_grid_are_computed_by_volunteers_and_verified(lab, residual, gpt_masked):
    # The small models' products are far below the default min-flops: send them to volunteers anyway.
    with dask.config.set({"goblin.placement.min-flops": 0, "goblin.placement.min-intensity": 0,
                          "goblin.placement.min-product-intensity": 0}):
        before = lab.report()
        model, g = gpt_masked
        ids = tokens(3, seed=30)
        logits = outputs(g(ids))[0].compute()
        close([logits], reference(model, ids))
        before = _verified_by_volunteers(lab, before)

        model, g = residual
        x = images(3, 4, 6, 6, seed=31)
        y = outputs(g(x))[0].compute()
        close([y], reference(model, x))
        _verified_by_volunteers(lab, before)
