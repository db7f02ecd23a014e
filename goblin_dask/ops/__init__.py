"""The catalog: every operation the grid computes, one declaration each.

``catalog()`` returns the registry (name -> OpSpec); volunteers run nothing else.
How to add an operation: ``goblin_dask/ops/README.md``.
"""

from goblin_dask.ops.registry import (
    CatalogError,
    aliases,
    by_operator,
    catalog,
    get,
    is_registered,
    op_by_name,
    register,
    task_violation,
)
from goblin_dask.ops.spec import (
    Aval,
    CatalogTask,
    Cost,
    Elementwise,
    Exact,
    Freivalds,
    OpSpec,
    ProductForm,
    Recompute,
    Replica,
    Verification,
    get_backend,
    set_backend,
)

# Importing an op module registers its declarations.
from goblin_dask.ops import (  # noqa: E402,F401  isort: skip
    creation,
    elementwise,
    formula,
    layout,
    linalg,
    nn,
    order,
    program,
    random,
    reductions,
    rolling,
    scan,
)
from goblin_dask.ops.kernels import warm_up  # noqa: E402

__all__ = [
    "Aval",
    "CatalogError",
    "CatalogTask",
    "Cost",
    "Elementwise",
    "Exact",
    "Freivalds",
    "OpSpec",
    "ProductForm",
    "Recompute",
    "Replica",
    "Verification",
    "aliases",
    "by_operator",
    "catalog",
    "get",
    "get_backend",
    "is_registered",
    "op_by_name",
    "register",
    "set_backend",
    "task_violation",
    "warm_up",
]
