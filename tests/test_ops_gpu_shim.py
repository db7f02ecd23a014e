"""The cupy code paths, run against a NumPy stand-in for cupy (no GPU here).

This checks the Python side of the GPU kernels (dtype handling, argument passing, the
host fallback, benchmarks/gpu_check.py's flow); the CUDA code itself is checked by
gpu_check.py on a GPU machine.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from goblin_dask.ops import catalog, get
from goblin_dask.ops._samples import example_calls


class FakeElementwiseKernel:
    made: list = []

    def __init__(self, in_params, out_params, operation, name, preamble):
        FakeElementwiseKernel.made.append((in_params, out_params, operation, name))

    def __call__(self, *args):
        raise NotImplementedError("no CUDA in the stand-in")


@pytest.fixture
def fake_cupy(monkeypatch):
    fake = types.ModuleType("cupy")
    fake.__version__ = "numpy-stand-in"
    fake.ndarray = np.ndarray
    fake.asarray = np.asarray
    fake.asnumpy = np.asarray
    fake.ElementwiseKernel = FakeElementwiseKernel
    for name in dir(np):
        if isinstance(getattr(np, name), np.ufunc):
            setattr(fake, name, getattr(np, name))
    device = types.SimpleNamespace(synchronize=lambda: None)
    fake.cuda = types.SimpleNamespace(
        Device=lambda *a: device, runtime=types.SimpleNamespace(getDeviceProperties=lambda i: {"name": b"stand-in"})
    )
    monkeypatch.setitem(sys.modules, "cupy", fake)
    return fake


UFUNC_OPS = sorted(n for n, s in catalog().items() if isinstance(s.numpy, np.ufunc))


@pytest.mark.parametrize("name", UFUNC_OPS + ["matmul", "matmul_accumulate", "tensordot", "einsum"])
def test_cupy_kernels_give_numpy_results_and_dtypes(fake_cupy, name):
    spec = get(name)
    for dtype in ("float32", "int64"):
        for args, params in example_calls(name, 3, np.random.default_rng(1), dtype):
            with np.errstate(all="ignore"):
                want = np.asarray(spec.numpy(*args, **params))
                got = np.asarray(spec.kernel("gpu")(*args, **params))
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_allclose(got, want, rtol=1e-6)


def test_cupy_ufunc_kernels_keep_weak_scalars_weak(fake_cupy):
    x = np.ones(3, np.float32)
    assert get("add").cupy(x, 2.0).dtype == np.float32
    assert get("add").cupy(x, np.float64(2.0)).dtype == np.float64


def test_fused_ops_build_one_elementwise_kernel_from_the_validated_program(fake_cupy):
    FakeElementwiseKernel.made.clear()
    with pytest.raises(NotImplementedError):
        get("sigmoid").cupy(np.ones(3, np.float32))
    ((in_params, out_params, operation, kernel_name),) = FakeElementwiseKernel.made
    assert (in_params, out_params) == ("float32 x0", "float32 y")
    assert "goblin_sigmoid(x0)" in operation and kernel_name.startswith("goblin_formula_")


def test_dtypes_cuda_lacks_run_on_the_host(fake_cupy):
    x = np.linspace(-2, 2, 5).astype(np.float16)
    out = get("formula").cupy(x, expr="sigmoid(x0) * 2")
    np.testing.assert_array_equal(out, get("formula").numpy(x, expr="sigmoid(x0) * 2"))


def test_gpu_check_runs_and_reports(fake_cupy, capsys):
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    assert gpu_check.main(["--n", "8", "--repeat", "1", "--only", "add,exp,matmul,einsum,transpose"]) == 0
    out = capsys.readouterr().out
    assert "stand-in" in out and out.count(" ok ") >= 8 and "no cupy kernel" in out
    assert gpu_check.main(["--n", "8", "--repeat", "1", "--only", "where"]) == 1  # the stand-in has no CUDA
    assert "ERROR" in capsys.readouterr().out


def test_gpu_check_without_cupy_exits_zero(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "cupy", None)
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    assert gpu_check.main([]) == 0
    assert "cupy is not installed" in capsys.readouterr().out
