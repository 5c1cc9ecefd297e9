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
* :mod:`.batched` — ``orthogonalize_batched`` (one call per matrix shape) and ``BatchedNS``, the
  same as an orthogonalizer object; :mod:`.timing` — ``NSTimer``, where an orthogonalizer records
  how long its calls took when its caller asks.

The route of a step: ``dmuon.Muon.step`` (stateful) → ``dmuon.functional.muon.update`` with an
``orthogonalize`` object (``BatchedNS``, or the CUDA engine :class:`dmuon.kernels.ns_engine.NSEngine`,
both running :mod:`.iteration`, each timing itself into the step's ``NSTimer``) → the
``orthogonalize`` stage of :mod:`dmuon.functional.stages` calls it; nothing here calls back.
"""
from dmuon.newton_schulz.coefficients import NAMED_SCHEDULES, CoefficientSpec, ns_coefficient_table
from dmuon.newton_schulz.cost import NSCost, choose_ns_variant, ns_cost
from dmuon.newton_schulz.iteration import (SymOp, default_ns_dtype, frobenius_normalize,
                                           newton_schulz, ns_iterate, sym_product)
from dmuon.newton_schulz.config import NSConfig

__all__ = ["NAMED_SCHEDULES", "CoefficientSpec", "ns_coefficient_table", "NSCost",
           "choose_ns_variant", "ns_cost", "SymOp", "default_ns_dtype", "frobenius_normalize",
           "newton_schulz", "ns_iterate", "sym_product", "NSConfig"]
