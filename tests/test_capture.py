"""goblin_dask.capture: PyTorch models as graphs of catalog operations, against torch's own forward.

Each model is captured once (``torch.export`` takes seconds) and computed with dask's local
threaded scheduler; float32 results agree with torch within 2e-5.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import dask  # noqa: E402
import goblin_dask  # noqa: E402
import goblin_dask.array as ga  # noqa: E402
from goblin_dask.torch_capture import Graph, UnsupportedOperator, supported  # noqa: E402
from goblin_dask.ops import catalog  # noqa: E402

TOL = dict(rtol=2e-5, atol=2e-5)


def run(graph: Graph, *inputs):
    out = graph(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    assert all(isinstance(o, ga.Array) for o in outs)
    return [o.compute(scheduler="threads") for o in outs]


def reference(model, *inputs):
    with torch.no_grad():
        out = model(*(torch.from_numpy(x) for x in inputs))
    return [t.numpy() for t in (out if isinstance(out, tuple) else (out,))]


def same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, g.dtype, w.shape, w.dtype)
        np.testing.assert_allclose(g, w, **TOL)


def data(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Mixed(nn.Module):
    """Elementwise, reductions, layout, comparisons, casts and a buffer; ten outputs."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 2.0, 6))

    def forward(self, x):
        y = x.view(x.shape[0], 2, 3).transpose(1, 2).reshape(x.shape[0], -1)
        z = torch.cat([y[:, 1:4], x[:, :3]], dim=1).unsqueeze(1).expand(-1, 2, -1)
        a = F.gelu(x) + F.silu(x) + F.softplus(x) + F.leaky_relu(x, 0.1) + F.elu(x) + F.gelu(x, approximate="tanh")
        b = torch.where(x > 0, x.clamp(-1, 1), x.var(dim=1, keepdim=True)) + x.amax(1, keepdim=True) + x.sum(-1, keepdim=True)
        c = x * self.scale - torch.rsqrt(x.abs() + 1) + torch.exp(-x).tanh() + torch.sigmoid(x) / 3 + x ** 2
        d = x.max(dim=1, keepdim=True).values - x.mean(dim=(0, 1), keepdim=True) + torch.maximum(x, torch.zeros_like(x))
        return z.sum(1), a, b, c, d, x.argmax(1), x.flatten(), x[0], x.mean(), (x > 0.5).to(torch.float32).sum(1)


class ConvNet(nn.Module):
    """conv2d, batch norm (eval), pooling, layer norm, softmax / log_softmax / logsumexp."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.pool = nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.MaxPool2d(2)
        self.ln, self.fc = nn.LayerNorm(16), nn.Linear(16, 5)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x):
        h = self.pool(F.relu(self.bn(self.conv(x))))
        h = F.avg_pool2d(h, 2) + F.adaptive_avg_pool2d(h, 2)
        y = self.fc(self.ln(h.flatten(1)))
        return y.softmax(-1), y.log_softmax(-1), torch.logsumexp(y, 1)


class Indexing(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("idx", torch.tensor([3, 0, 1]))

    def forward(self, x):
        return F.pad(x, (1, 2)), x[:, self.idx], x.cumsum(1)


class TinyLM(nn.Module):
    """Token ids -> embedding -> a transformer encoder layer (attention, layer norm, GELU) -> logits."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.encoder = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, activation="gelu", batch_first=True)
        self.head = nn.Linear(8, 11)

    def forward(self, ids):
        return self.head(self.encoder(self.embed(ids))).log_softmax(-1)


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(4, 3, batch_first=True)

    def forward(self, x):
        out, h = self.gru(x)
        return out, h


class Bessel(nn.Module):
    def forward(self, x):
        return torch.special.bessel_j0(x) + 1


class WithBessel(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 4), Bessel())

    def forward(self, x):
        return self.block(x).sum(-1)


class Spectrum(nn.Module):
    def forward(self, x):
        return torch.fft.rfft(x).abs()


class FixedBatch(nn.Module):
    def forward(self, x):
        return x.reshape(20) * 2  # the batch size is baked in: no symbolic batch dimension


@pytest.fixture(scope="module")
def mlp():
    torch.manual_seed(0)
    model = MLP().eval()
    return model, goblin_dask.capture(model, (torch.from_numpy(data(5, 6)),))


@pytest.fixture(scope="module")
def mixed():
    model = Mixed().eval()
    return model, goblin_dask.capture(model, (torch.from_numpy(data(5, 6)),))


def test_mlp_matches_torch(mlp):
    model, g = mlp
    x = data(5, 6, seed=1)
    out = g(x)
    assert isinstance(out, ga.Array)  # one output: one array, not a tuple
    same(run(g, x), reference(model, x))
    same(run(g, ga.from_array(x)), reference(model, x))  # ga inputs as well as NumPy


@pytest.mark.parametrize("batch", [1, 2, 11])
def test_mlp_other_batch_sizes(mlp, batch):
    model, g = mlp
    assert isinstance(g.inputs[0]["shape"][0], str)  # a symbolic batch size
    x = data(batch, 6, seed=batch)
    same(run(g, x), reference(model, x))


@pytest.mark.parametrize("batch", [5, 3])
def test_elementwise_reduction_shape_model(mixed, batch):
    model, g = mixed
    x = data(batch, 6, seed=batch)
    same(run(g, x), reference(model, x))


def test_nn_model():
    torch.manual_seed(0)
    model = ConvNet().eval()
    g = goblin_dask.capture(model, (torch.from_numpy(data(3, 2, 8, 8)),))
    assert {"conv2d", "batch_norm", "max_pool2d", "avg_pool2d", "layer_norm", "softmax", "log_softmax"} <= g.ops
    for batch in (3, 4):
        x = data(batch, 2, 8, 8, seed=batch)
        same(run(g, x), reference(model, x))


def test_take_pad_cumsum_with_a_buffer_index():
    model = Indexing().eval()
    g = goblin_dask.capture(model, (torch.from_numpy(data(5, 4)),))
    assert {"take", "pad", "cumsum"} <= g.ops
    x = data(7, 4, seed=3)
    same(run(g, x), reference(model, x))


class Products(nn.Module):
    """torch.cumprod along a row, of floats and of integers (torch's int32 cumprod is int64)."""

    def forward(self, x):
        counts = (x.abs() * 2).to(torch.int32) + 1
        return x.cumprod(1), torch.cumprod(x, -1, dtype=torch.float64), counts.cumprod(1)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cumprod_is_torchs(dtype):
    from goblin_dask.torch_capture.aten import TABLE

    model = Products().eval()
    g = goblin_dask.capture(model, (torch.from_numpy(data(5, 4).astype(dtype)),))
    assert "cumprod" in g.ops
    for batch in (5, 8):
        x = (1 + data(batch, 4, seed=batch) / 4).astype(dtype)  # products that neither vanish nor blow up
        got, want = run(g, x), reference(model, x)
        same(got, want)
        np.testing.assert_array_equal(got[2], want[2])  # integers: exact
        if dtype == np.float64:
            np.testing.assert_allclose(got[0], want[0], rtol=1e-14)
        # along the batch axis: the row itself (as stage tasks, a captured pass is cut along the batch)
        down = TABLE["aten.cumprod.default"].fn(ga, ga.from_array(x, chunks=(3, 2)), 0).compute(scheduler="sync")
        np.testing.assert_allclose(down, torch.cumprod(torch.from_numpy(x), 0).numpy(), **TOL)


def test_transformer_with_token_ids_and_gru():
    torch.manual_seed(0)
    lm = TinyLM().eval()
    g = goblin_dask.capture(lm, (torch.randint(0, 11, (2, 5)),))
    assert {"take", "layer_norm", "softmax", "matmul", "gelu"} <= g.ops
    ids = np.random.default_rng(1).integers(0, 11, (3, 5))  # token ids as NumPy: the embedding's take indices
    same(run(g, ids), reference(lm, ids))

    rnn = Recurrent().eval()
    g = goblin_dask.capture(rnn, (torch.randn(2, 5, 4),))
    x = data(3, 5, 4, seed=4)
    same(run(g, x), reference(rnn, x))


def test_what_depends_on_constants_alone_is_computed_once_and_read_as_a_constant():
    """A Linear's transposed weight is a node of constants alone: folded at the lab once, it is no task of
    any pass, and it reaches the products as a content-named lab array (``source-<hash>``: the same key in
    every pass, which a volunteer's panel cache keeps).  ``Graph.ops`` still lists the ops it took."""
    from goblin_dask.ops import CatalogTask

    torch.manual_seed(0)
    model = MLP().eval()
    g = goblin_dask.capture(model, (torch.from_numpy(data(5, 6)),))
    folded = g._folded()
    weights = {k: v.detach().numpy() for k, v in model.state_dict().items() if k.endswith("weight")}
    assert len(folded) == 2 and all(any(np.array_equal(v, w.T) for w in weights.values()) for v in folded.values())

    def pass_graph(x):
        # op by op, whatever grid an earlier test left as the default client (a pass as one stage task reads
        # the constants as one flat array instead: tests/test_stage_tasks.py)
        with dask.config.set(scheduler="sync"):
            out = g(x)
        return out, dict(out.__dask_graph__())

    out1, dsk1 = pass_graph(data(5, 6, seed=1))
    out2, dsk2 = pass_graph(data(7, 6, seed=2))
    for dsk in (dsk1, dsk2):
        assert not any(isinstance(t, CatalogTask) and t.op.name == "transpose" for t in dsk.values())
    def sources(dsk):
        names = {k[0] if isinstance(k, tuple) else k for k in dsk}
        return {n for n in names if str(n).startswith("source-")}

    # the same keys in both passes: two weights (transposed) and two biases; the inputs differ
    assert len(sources(dsk1) & sources(dsk2)) == 4
    assert "transpose" in g.ops
    same([out1.compute(scheduler="sync")], reference(model, data(5, 6, seed=1)))
    same([out2.compute(scheduler="sync")], reference(model, data(7, 6, seed=2)))


def test_random_operators_are_not_folded():
    """A random mask drawn over a buffer (dropout's): each pass draws anew (folding would freeze one draw)."""

    class NoisyBuffer(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("w", torch.ones(64))

        def forward(self, x):
            return x + torch.bernoulli(self.w, 0.5)  # dropout's mask

    g = goblin_dask.capture(NoisyBuffer(), (torch.zeros(2, 64),))
    assert g._folded() == {}
    x = np.zeros((2, 64), np.float32)
    draws = {g(x).compute(scheduler="sync").tobytes() for _ in range(4)}
    assert len(draws) > 1


def test_ops(mlp, mixed):
    _, g = mlp
    assert {"matmul_accumulate", "relu"} <= g.ops and g.ops <= set(catalog())  # Linear: bias + x @ W.T in one op
    _, m = mixed
    assert {"gelu", "elu", "leaky_relu", "where", "clip", "max", "sum", "reshape", "transpose", "greater",
            "astype"} <= m.ops
    assert m.ops <= set(catalog())


def test_json_npz_round_trip(mlp, mixed, tmp_path):
    for i, (model, g) in enumerate((mlp, mixed)):
        text = g.to_json()
        d = json.loads(text)
        assert d["nodes"] == g.nodes and sorted(d["ops"]) == sorted(g.ops)
        assert set(d["constants"]) == set(g.constants)  # names, shapes and dtypes; the values are in the .npz
        json_path, npz_path = g.save(tmp_path / f"model{i}")
        with np.load(npz_path, allow_pickle=False) as z:
            assert set(z.files) == set(g.constants)
        loaded = Graph.load(tmp_path / f"model{i}")
        again = Graph.from_json(text, npz_path)
        also = Graph.from_json(text, dict(g.constants))
        assert loaded.ops == again.ops == also.ops == g.ops
        x = data(4, 6, seed=7)
        want = run(g, x)
        for h in (loaded, again, also):
            got = run(h, x)
            for a, b in zip(got, want):
                np.testing.assert_array_equal(a, b)


def test_missing_constant_is_refused(mlp):
    _, g = mlp
    with pytest.raises(ValueError, match="missing"):
        Graph.from_json(g.to_json(), {})


def test_unsupported_operator_names_operator_module_and_line():
    with pytest.raises(UnsupportedOperator) as e:
        goblin_dask.capture(WithBessel(), (torch.randn(3, 4),))
    msg = str(e.value)
    assert "aten.special_bessel_j0" in msg
    assert "'block.1'" in msg and "Bessel" in msg  # the module path from nn_module_stack
    assert "test_capture.py" in msg and "torch.special.bessel_j0(x) + 1" in msg  # the source line

    with pytest.raises(UnsupportedOperator) as e:
        goblin_dask.capture(Spectrum(), (torch.randn(3, 8),))
    assert "aten._fft_r2c" in str(e.value) and "torch.fft.rfft(x).abs()" in str(e.value)


class Volume(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(1, 2, 3)

    def forward(self, x):
        return self.conv(x)


def test_row_that_refuses_its_arguments_fails_at_capture():
    with pytest.raises(UnsupportedOperator) as e:
        goblin_dask.capture(Volume(), (torch.randn(2, 1, 4, 4, 4),))
    msg = str(e.value)
    assert "aten.convolution.default" in msg and "only 1-d and 2-d convolutions are mapped" in msg
    assert "this one has 3 spatial dimensions" in msg and "'conv' (Conv3d)" in msg
    assert "what to do: run that part of the model in torch on your machine" in msg


CONVOLUTIONS = [  # (layer, input shape): 1-d as 2-d of height 1, transposed as the convolution of the dilated input
    (lambda: nn.Conv1d(3, 5, 4), (2, 3, 17)),
    (lambda: nn.Conv1d(4, 6, 3, stride=2, padding=2, dilation=2, groups=2), (2, 4, 19)),
    (lambda: nn.Conv1d(3, 5, 3, padding="same", bias=False), (2, 3, 10)),
    (lambda: nn.Conv1d(2, 3, 5, padding=4), (1, 2, 3)),  # a kernel longer than the input
    (lambda: nn.ConvTranspose1d(3, 5, 4, stride=3, padding=1, output_padding=2), (2, 3, 9)),
    (lambda: nn.ConvTranspose1d(4, 6, 3, stride=2, padding=4, dilation=2, groups=2), (2, 4, 9)),  # padding > reach
    (lambda: nn.ConvTranspose2d(3, 4, (3, 2), stride=(2, 1), padding=(1, 0), output_padding=(1, 0)), (2, 3, 5, 6)),
    (lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2, dilation=(1, 2), padding=(2, 1), bias=False),
     (1, 4, 5, 5)),
]


@pytest.mark.parametrize("make, shape", CONVOLUTIONS, ids=[
    "conv1d", "conv1d-strided-dilated-grouped", "conv1d-same", "conv1d-kernel-longer-than-input", "convT1d-output-padding",
    "convT1d-grouped-cropped", "convT2d-output-padding", "convT2d-grouped-dilated"])
def test_conv1d_and_transposed_convolutions_match_torch(make, shape):
    torch.manual_seed(3)
    layer = make()
    g = goblin_dask.capture(layer, (torch.from_numpy(data(*shape)),))
    x = data(*shape, seed=4)
    got = run(g, x)
    same(got, reference(layer, x))
    assert "conv2d" in g.ops, f"the convolution is the catalog's conv2d (Freivalds-checked): {g.ops}"


@pytest.mark.parametrize("spatial", [1, 2])
@pytest.mark.parametrize("length, k, stride, padding, dilation", [
    (24, 3, 2, 1, 2),  # the strided forward's last window stops short of the padded end: its rows still get gradient
    (24, 3, 2, 1, 1), (23, 3, 2, 1, 2), (24, 5, 1, 2, 1), (12, 3, 2, 0, 2),
    (11, 3, 2, 4, 1),  # padding beyond the kernel's reach
])
def test_convolution_gradients_match_torch_in_float64(spatial, length, k, stride, padding, dilation):
    """The backward row on its own (what a training round's joint graph computes), against torch's autograd."""
    from goblin_dask.torch_capture.aten import TABLE

    rng = np.random.default_rng(length * k + stride)
    x = torch.tensor(rng.standard_normal((2, 3) + (length,) * spatial), requires_grad=True)
    w = torch.tensor(rng.standard_normal((4, 3) + (k,) * spatial), requires_grad=True)
    conv = F.conv1d if spatial == 1 else F.conv2d
    y = conv(x, w, stride=stride, padding=padding, dilation=dilation)
    g = torch.tensor(rng.standard_normal(tuple(y.shape)))
    y.backward(g)
    each = lambda v: [v] * spatial  # noqa: E731
    gi, gw, gb = TABLE["aten.convolution_backward.default"].fn(
        ga, ga.from_array(g.numpy(), chunks=1), ga.from_array(x.detach().numpy()), ga.from_array(w.detach().numpy()),
        [4], each(stride), each(padding), each(dilation), False, each(0), 1, [True, True, True])
    np.testing.assert_allclose(gi.compute(scheduler="sync"), x.grad.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(gw.compute(scheduler="sync"), w.grad.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(gb.compute(scheduler="sync"), g.numpy().sum(axis=(0, *range(2, 2 + spatial))),
                               rtol=1e-12)


class Wave(nn.Module):
    """Conv1d stack on a signal, with F.conv1d on a weight of the model's own."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(2, 4, 5, padding=2)
        self.up = nn.ConvTranspose1d(4, 3, 4, stride=2, padding=1)
        self.kernel = nn.Parameter(torch.randn(3, 3, 3))

    def forward(self, x):
        h = F.relu(self.conv(x))
        return F.conv1d(torch.tanh(self.up(h)), self.kernel, stride=2)


def test_a_captured_conv1d_model_matches_torch_at_other_batch_sizes():
    torch.manual_seed(5)
    model = Wave().eval()
    g = goblin_dask.capture(model, (torch.from_numpy(data(3, 2, 16)),))
    for batch in (3, 1):
        x = data(batch, 2, 16, seed=batch)
        same(run(g, x), reference(model, x))


def test_static_fallback_and_input_checks():
    model = FixedBatch()
    g = goblin_dask.capture(model, (torch.from_numpy(data(5, 4)),))
    assert g.inputs[0]["shape"] == [5, 4]
    x = data(5, 4, seed=2)
    same(run(g, x), reference(model, x))
    with pytest.raises(ValueError, match="shape"):
        g(data(6, 4))
    with pytest.raises(TypeError, match="dtype"):
        g(x.astype(np.float64))


def test_capture_is_callable_and_table_listed():
    import goblin_dask.torch_capture  # noqa: F401  (importing the package leaves goblin_dask.capture the function)

    assert callable(goblin_dask.capture) and goblin_dask.capture.__module__ == "goblin_dask.torch_capture"
    assert goblin_dask.Graph is Graph
    assert {"aten.addmm.default", "aten.mm.default", "aten.view.default", "aten._softmax.default"} <= set(supported())


def test_import_goblin_dask_does_not_import_torch():
    code = ("import sys, goblin_dask; goblin_dask.Graph; import goblin_dask.torch_capture; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
