"""Training on the grid (issue 18): ``Trainer(model, loss_fn, optimizer, micro_batches=4)``.

Each optimizer step is one verified round: the joint forward+backward graph of the model and its
loss (torch's own backward, lowered to core ATen and mapped to catalog operations) runs per
micro-batch on volunteers, every result checked; the gradients are summed and the optimizer steps
at the lab worker.  torch is imported only when a Trainer traces a model.
"""

from __future__ import annotations

from goblin_dask.training.trainer import Plan, Stage, Trainer

__all__ = ["Plan", "Stage", "Trainer"]
