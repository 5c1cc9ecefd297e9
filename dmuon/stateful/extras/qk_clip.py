"""QK-clip (MuonClip) on a dedicated model: after ``optimizer.step()``, cap every head's max
attention logit by rescaling the owners' W_q / W_k masters (math: :mod:`dmuon.functional.qk_clip`).

The caller measures each layer's per-query-head max logit of the step on its own micro-batches
(e.g. :func:`dmuon.functional.qk_clip.max_logits` on q and k inside its attention); one MAX
all-reduce over all ranks makes it the global max; each owner then rescales its masters, which the
next forward broadcasts. Collective: every rank calls it with the same layers, after the same step.
"""
from __future__ import annotations

from typing import Mapping

import torch
import torch.nn as nn

from dmuon.functional.qk_clip import (QKClipConfig, check_layers, pack_max_logits,
                                      scale_head_rows, unpack_max_logits, weight_factors)
from dmuon.stateful.runtime.agree import max_over_ranks
from dmuon.stateful.runtime.state import get_state
from dmuon.stateful.modes.tensor_parallel import refuse_tp

__all__ = ["qk_clip_"]


@torch.no_grad()
def qk_clip_(model: nn.Module, max_logit: Mapping[str, torch.Tensor],
             layers: Mapping[str, tuple[str, str, int]],
             config: QKClipConfig = QKClipConfig()) -> dict[str, torch.Tensor]:
    """Rescale W_q / W_k per head where the step's global max logit exceeds ``config.tau``.

    Args:
      model: a model prepared by ``dedicate_params``, W_q and W_k of every layer dedicated.
      max_logit: ``{layer: (H_q,) this rank's max logit}`` (every rank the same keys).
      layers: ``{layer: (q weight name, k weight name, number of kv heads)}``.
      config: ``τ`` and ``α`` (defaults: Kimi K2's).

    Returns:
      ``{layer: (H_q,) global max logit}`` (the same on every rank).

    Raises:
      ValueError: keys of ``max_logit`` and ``layers`` differ, or a weight is not dedicated.
      NotImplementedError: HSDP (R > 1): the replicas' publish of this step has left already.
    """
    config.validate()
    rt = get_state(model)
    refuse_tp(rt, "dmuon qk_clip_ (per-head rows of TP-sliced q / k matrices)")
    check_layers(max_logit, layers, rt.params)
    if rt.R > 1:
        raise NotImplementedError("qk_clip_ on HSDP (replicate_mesh) is not supported yet: the "
                                  "step's replica publish is already in flight when it runs")
    flat = max_over_ranks(pack_max_logits(max_logit, rt.device),
                          what="QK-clip max-logit all-reduce", via=rt.mesh_groups)
    out = unpack_max_logits(flat, max_logit)
    owned = set(rt.owned_names)
    for n, f in weight_factors(out, layers, config).items():
        if n in owned:
            m = rt.masters[n]
            m.copy_(scale_head_rows(m, f))
    return out
