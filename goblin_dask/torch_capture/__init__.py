"""Capture a PyTorch model as a graph of catalog operations: ``goblin_dask.capture(model, (x,))``.

``capture`` exports the model with ``torch.export`` (core ATen, a symbolic batch size where
the model allows) and maps every ATen operator through a table to ``goblin_dask.array``
calls (:mod:`goblin_dask.torch_capture.aten`); the :class:`Graph` it returns holds operator names,
shapes, dtypes and the parameters as NumPy constants (lab data), and runs on the grid when
called.  torch is imported only when ``capture`` runs; a saved graph needs no torch.
"""

from __future__ import annotations

from typing import Any

from goblin_dask.torch_capture.graph import Graph, UnsupportedOperator


def capture(module: Any, example_inputs: Any, *, dynamic_batch: bool = True) -> Graph:
    """``module`` as a :class:`Graph` (see :func:`goblin_dask.torch_capture.export.capture`)."""
    from goblin_dask.torch_capture import export

    return export.capture(module, example_inputs, dynamic_batch=dynamic_batch)


def supported() -> list[str]:
    """The ATen operators the table maps (whether ``ga`` has every function each needs yet or not)."""
    from goblin_dask.torch_capture import aten

    return sorted(aten.TABLE)


__all__ = ["Graph", "UnsupportedOperator", "capture", "supported"]
