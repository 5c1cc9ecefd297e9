"""Tensor parallelism's decisions at ``dedicate_params`` (pure): the modes TP-sliced dedicated
matrices combine with, and their decided matrix views
(:mod:`dmuon.stateful.setup.dedicate`; the layouts: :mod:`dmuon.functional.tp_plan`)."""
from __future__ import annotations

from typing import Callable, Mapping

from dmuon.functional.matrix_view import Sliced
from dmuon.functional.policy import Decision
from dmuon.functional.tp_plan import with_tp_views

__all__ = ["tp_decisions"]


def tp_decisions(decisions: Mapping[str, Decision], views: Mapping[str, Sliced], *,
                 data_parallel: str, on_meta: bool, fix: str,
                 error: Callable[[str], Exception]) -> dict[str, Decision]:
    """The policy's ``decisions`` with the :class:`~dmuon.functional.matrix_view.Sliced` view
    (``views``) of each TP-sliced matrix (:func:`~dmuon.functional.tp_plan.with_tp_views`).

    Raises:
      ``error``: TP-sliced matrices (``views`` not empty) with ``data_parallel="ddp"`` or on the
        meta device, which TP does not support yet (the message ends with ``fix``); a view
        :func:`~dmuon.functional.tp_plan.with_tp_views` refuses.
    """
    if views and (data_parallel != "fsdp" or on_meta):
        raise error(
            "dedicate_params: tensor-parallel dedicated matrices "
            + ("with data_parallel='ddp'" if data_parallel != "fsdp" else
               "on the meta device (meta-device init)")
            + " are not supported yet. Use data_parallel='fsdp' with a materialized model "
            f"(TP, then dedicate_params, then fully_shard). {fix}.")
    return with_tp_views(decisions, views, error=error)
