"""The per-matrix settings ``dedicate_params`` hands the model's state (pure): from the policy's
decisions and the dedicated matrices' specs (:mod:`dmuon.stateful.setup.dedicate`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from dmuon.functional.policy import Decision, dtype_overrides
from dmuon.functional.specs import ParamSpec

__all__ = ["MatrixSettings", "matrix_settings"]


@dataclass(frozen=True)
class MatrixSettings:
    """What the policy decided per dedicated matrix (``{name: ...}``), for the state
    (:class:`~dmuon.stateful.runtime.state.DedicatedState`): ``views`` (what NS / the lr scale
    see), the rule-set ``param_dtypes`` / ``reduce_dtypes`` / ``master_dtypes`` and ``hp_mults``
    (``(lr_mult, wd_mult)``)."""

    views: Mapping[str, Any] = field(default_factory=dict)
    param_dtypes: Mapping[str, Any] = field(default_factory=dict)
    reduce_dtypes: Mapping[str, Any] = field(default_factory=dict)
    master_dtypes: Mapping[str, Any] = field(default_factory=dict)
    hp_mults: Mapping[str, tuple[float, float]] = field(default_factory=dict)


def matrix_settings(decisions: Mapping[str, Decision], specs: Sequence[ParamSpec],
                    names: Iterable[str]) -> MatrixSettings:
    """The :class:`MatrixSettings` of the dedicated ``names``: their specs' views, the rest from
    the decisions."""
    spec = {s.name: s for s in specs}
    names = list(names)
    return MatrixSettings(
        param_dtypes=dtype_overrides(decisions, "param_dtype"),
        reduce_dtypes=dtype_overrides(decisions, "reduce_dtype"),
        master_dtypes=dtype_overrides(decisions, "master_dtype"),
        views={n: spec[n].matrix_view for n in names},
        hp_mults={n: (d.lr_mult, d.wd_mult) for n, d in decisions.items()})
