"""Newton–Schulz, in one place: the iteration, its coefficient schedules, its costs, how a batch
of matrices is chunked. NS split across ranks is a schedule of the step program
(:mod:`dmuon.functional.split_ns`); the CUDA engine that runs it batched and
graph-replayed is a kernel (:mod:`dmuon.kernels.ns_engine`).

Modules:

* :mod:`.iteration` — the math (pure): direct and Gram Newton–Schulz, Frobenius normalization,
  the fp16 range lift, the symmetric-product hook; ``newton_schulz(x, steps, coefficients, ...)``.
* :mod:`.coefficients` — named schedules (Keller Jordan's quintic, "You", Polar Express tables).
* :mod:`.cost` — flop counts, direct vs Gram choice (pure).
* :mod:`.chunks` — batching same-shape matrices into chunks (pure planning).
* :mod:`.config` — :class:`NSConfig`, the one source of truth of the NS settings, built from
  :class:`dmuon.functional.muon.MuonHParams` under the same names.
* :mod:`.matrix_shape` — how a param of any shape is seen as an ``(m, n)`` matrix.

The route of a step: ``dmuon.Muon.step`` (stateful) → ``dmuon.functional.muon.update`` with an
``orthogonalize`` hook → this package (:func:`orthogonalize_batched`, or the CUDA engine
:mod:`dmuon.kernels.ns_engine`, both running :mod:`.iteration`).
"""
from dmuon.newton_schulz.coefficients import NAMED_SCHEDULES, CoefficientSpec, ns_coefficient_table
from dmuon.newton_schulz.cost import NSCost, choose_ns_variant, ns_cost
from dmuon.newton_schulz.iteration import (SymOp, default_ns_dtype, frobenius_normalize,
                                           newton_schulz, ns_iterate, sym_product)
from dmuon.newton_schulz.config import NSConfig

__all__ = ["NAMED_SCHEDULES", "CoefficientSpec", "ns_coefficient_table", "NSCost",
           "choose_ns_variant", "ns_cost", "SymOp", "default_ns_dtype", "frobenius_normalize",
           "newton_schulz", "ns_iterate", "sym_product", "NSConfig"]
