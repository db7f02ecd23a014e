"""numba kernel of one Adam / AdamW step: torch's single-tensor Adam, every operation in the parameter's dtype
and in torch's order, in one pass over the arrays.

Why: NumPy makes about ten passes over four parameter-sized arrays per step; on the lab worker that was the
optimizer's whole cost (a 3.2 M-parameter GPT: ~26 ms a step, ~7 ms here).  The constants are rounded to the
parameter's dtype first, as NumPy does with a Python float beside a float32 array, so the result is the NumPy
version's bit for bit (``tests/test_training.py`` compares them).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

import numpy as np


@lru_cache(maxsize=1)
def _kernel() -> Callable:
    import numba

    # error_model "numpy": a division by zero gives inf or NaN as NumPy's does (no test, so the loop vectorizes)
    @numba.njit(cache=True, nogil=True, error_model="numpy")
    def step(p, g, ea, eas, mx, out_p, out_ea, out_eas, out_mx, c, maximize, decay, lerp_small, amsgrad):
        # c: 1 - lr*wd, wd, w, 1 - w, beta2, 1 - beta2, -step_size, sqrt(bias_correction2), eps (p's dtype)
        # decay: 0 none, 1 decoupled (AdamW), 2 L2 (added to the gradient)
        if decay == 1 and lerp_small and not maximize and not amsgrad:  # AdamW's defaults: no test per element
            for i in range(p.shape[0]):
                gi = g[i]
                e = ea[i]
                e = e + c[2] * (gi - e)
                s = eas[i] * c[4] + (gi * c[5]) * gi
                out_ea[i] = e
                out_eas[i] = s
                out_p[i] = p[i] * c[0] + (e / (np.sqrt(s) / c[7] + c[8])) * c[6]
            return
        for i in range(p.shape[0]):
            gi = g[i]
            if maximize:
                gi = -gi
            pi = p[i]
            if decay == 1:
                pi = pi * c[0]
            elif decay == 2:
                gi = gi + c[1] * pi
            e = ea[i]
            if lerp_small:
                e = e + c[2] * (gi - e)
            else:
                e = gi - (gi - e) * c[3]
            s = eas[i] * c[4] + (gi * c[5]) * gi
            out_ea[i] = e
            out_eas[i] = s
            if amsgrad:
                m = mx[i]
                if m != m or s != s:
                    s = m + s  # NaN, as np.maximum
                elif m > s:
                    s = m
                out_mx[i] = s
            d = np.sqrt(s) / c[7] + c[8]
            out_p[i] = pi + (e / d) * c[6]

    return step


def adam_step(p: np.ndarray, g: np.ndarray, ea: np.ndarray, eas: np.ndarray, mx: np.ndarray | None,
              constants: list[float], maximize: bool, decay: int, lerp_small: bool) -> tuple | None:
    """``(new p, exp_avg, exp_avg_sq, max_exp_avg_sq or None)``, or None where the kernel does not apply (mixed
    or non-float dtypes, numba missing): the caller runs NumPy's version."""
    arrays = [p, g, ea, eas] + ([mx] if mx is not None else [])
    dt = p.dtype
    if dt not in (np.float32, np.float64) or any(a.dtype != dt or a.shape != p.shape for a in arrays):
        return None
    try:
        kernel = _kernel()
    except ImportError:
        return None
    flat = [np.ascontiguousarray(a).reshape(-1) for a in arrays]
    out = [np.empty(p.size, dt) for _ in range(4 if mx is not None else 3)]
    kernel(flat[0], flat[1], flat[2], flat[3], flat[4] if mx is not None else flat[3], out[0], out[1], out[2],
           out[3] if mx is not None else out[2], np.array(constants, dtype=dt), maximize, decay, lerp_small,
           mx is not None)
    shaped = [o.reshape(p.shape) for o in out]
    return shaped[0], shaped[1], shaped[2], (shaped[3] if mx is not None else None)
