"""``torch.optim.functional.muon``'s call, answered by dmuon's functional Muon (an adapter).

PyTorch 2.15 makes the functional optimizers public, Muon among them: ``muon(params, grads,
muon_momentum_bufs, *, foreach, lr, weight_decay, momentum, nesterov, ns_coefficients, ns_steps,
eps, adjust_lr_fn, has_complex)`` updates ``params`` and the caller-owned momentum buffers in place
and returns ``None``. :func:`muon` here takes the same call (the same names, the same in-place
contract, the same buffer convention) and runs :func:`dmuon.functional.muon.update` with
``donate=True``; a training loop written against torch's function runs on dmuon's by swapping
the import. What differs is named:

* momentum buffers: torch keeps the EMA ``buf ← lerp(buf, g, 1 − μ)``, dmuon the sum form
  ``b ← μ·b + g``; ``buf = (1 − μ)·b`` exactly in real arithmetic, so the adapter reads
  ``b = buf / (1 − μ)`` and writes back ``(1 − μ)·b`` (the NS input differs only by that factor,
  which NS removes);
* Newton–Schulz: torch's runs in bf16 with ``X / max(‖X‖, eps)``; dmuon's in ``ns_dtype`` (an
  extra keyword, default ``torch.bfloat16`` as torch) with ``X / (‖X‖ + eps)``, batched per shape,
  Gram variant where the aspect ratio makes it cheaper (``dmuon.newton_schulz``);
* ``adjust_lr_fn``: torch's values map to dmuon's ``lr_scale`` rules
  (:data:`dmuon.functional.muon_options.ADJUST_LR_FN`; any other value: no scale, as torch).

``tests/test_torch_functional.py`` (torch >= 2.15): the two agree to bf16 noise as shipped, and to
1e-12 with both Newton–Schulz iterations in fp64.

References:
    PyTorch 2.15 ``torch.optim.functional`` (the functional-optimizer contract), ``torch.optim.Muon``.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from dmuon.functional import muon as fmuon
from dmuon.functional.muon_options import ADJUST_LR_FN

__all__ = ["muon"]


@torch.no_grad()
def muon(params: list[Tensor], grads: list[Tensor], muon_momentum_bufs: list[Tensor], *,
         foreach: Optional[bool] = None, lr: float, weight_decay: float, momentum: float,
         nesterov: bool, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float,
         adjust_lr_fn: Optional[str], has_complex: bool,
         ns_dtype: Optional[torch.dtype] = torch.bfloat16) -> None:
    """``torch.optim.functional.muon``'s call on dmuon's Muon (module docstring): updates
    ``params`` and ``muon_momentum_bufs`` (torch's EMA convention) in place.

    Args:
      params, grads, muon_momentum_bufs: lists of 2-D tensors (torch's).
      foreach: must not be True (torch: "not supported for Muon yet").
      lr, weight_decay, momentum, nesterov, ns_coefficients, ns_steps, eps, adjust_lr_fn,
        has_complex: torch's.
      ns_dtype: dmuon's Newton–Schulz compute dtype (default bf16, as torch's).

    Raises:
      RuntimeError / ValueError: where torch's function raises (foreach, complex params, a
        gradient that is not a matrix).
    """
    if foreach:
        raise RuntimeError("Foreach is not supported for Muon yet")
    if has_complex:
        raise ValueError("Complex parameters are not supported")
    if not (len(params) == len(grads) == len(muon_momentum_bufs)):
        raise ValueError("params, grads and muon_momentum_bufs must have the same length")
    for g in grads:
        if g.ndim != 2:
            raise ValueError("Param gradient must be a 2D matrix")
    if not params:
        return
    lr = float(lr) if not isinstance(lr, Tensor) or lr.numel() == 1 else lr
    hp = fmuon.MuonHParams(lr=lr, momentum=float(momentum), nesterov=bool(nesterov),
                           weight_decay=float(weight_decay), ns_steps=int(ns_steps),
                           ns_coefficients=tuple(float(c) for c in ns_coefficients),
                           ns_eps=float(eps), ns_dtype=ns_dtype,
                           lr_scale=ADJUST_LR_FN.get(adjust_lr_fn, "none"))
    keep = 1.0 - hp.momentum
    names = [str(i) for i in range(len(params))]
    state = fmuon.MuonState(step=0, momentum={n: b / keep for n, b in zip(names,
                                                                           muon_momentum_bufs)})
    _, state = fmuon.update(dict(zip(names, grads)), state, dict(zip(names, params)), hp,
                            donate=True)
    for n, b in zip(names, muon_momentum_bufs):
        b.copy_(state.momentum[n] * keep)
