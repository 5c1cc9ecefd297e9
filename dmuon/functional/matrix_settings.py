"""The per-matrix settings ``dedicate_params`` hands the model's state (pure): from the policy's
decisions and the dedicated matrices' specs (:mod:`dmuon.stateful.setup.dedicate`)."""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from dmuon.functional.policy import Decision, dtype_overrides
from dmuon.functional.specs import ParamSpec

__all__ = ["matrix_settings"]


def matrix_settings(decisions: Mapping[str, Decision], specs: Sequence[ParamSpec],
                    names: Iterable[str]) -> dict[str, Any]:
    """The per-matrix keyword arguments of the state
    (:class:`~dmuon.stateful.runtime.state.DedicatedState`) of the dedicated ``names``:
    ``views`` (their specs'), and from the decisions the rule-set ``param_dtypes`` /
    ``reduce_dtypes`` / ``master_dtypes`` and ``hp_mults`` (``(lr_mult, wd_mult)``)."""
    spec = {s.name: s for s in specs}
    names = list(names)
    return dict(
        param_dtypes=dtype_overrides(decisions, "param_dtype"),
        reduce_dtypes=dtype_overrides(decisions, "reduce_dtype"),
        master_dtypes=dtype_overrides(decisions, "master_dtype"),
        views={n: spec[n].matrix_view for n in names},
        hp_mults={n: (d.lr_mult, d.wd_mult) for n, d in decisions.items()})
