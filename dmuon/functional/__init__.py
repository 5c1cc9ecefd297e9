"""The pure functional core of dmuon: no ``torch.distributed``, no globals, explicit state.

Modules:
  ``newton_schulz`` / ``coefficients`` / ``ns_cost`` / ``matrix_shape`` — the orthogonalization family;
  ``muon`` / ``adamw`` — optax-style ``init`` / ``update`` transformations with NamedTuple states.
"""
from dmuon.functional import adamw, muon
from dmuon.functional.coefficients import NAMED_SCHEDULES, CoefficientSpec, ns_coefficient_table
from dmuon.functional.matrix_shape import as_matrix_shape
from dmuon.functional.newton_schulz import (SymOp, default_ns_dtype, frobenius_normalize, newton_schulz,
                                            sym_product)
from dmuon.functional.ns_cost import NSCost, choose_ns_variant, ns_cost

__all__ = [
    "adamw", "muon", "NAMED_SCHEDULES", "CoefficientSpec", "ns_coefficient_table", "as_matrix_shape",
    "default_ns_dtype", "newton_schulz", "SymOp", "sym_product", "frobenius_normalize", "NSCost", "choose_ns_variant", "ns_cost",
]
