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

from dmuon.functional.qk_clip import QKClipConfig, clip_factors, scale_head_rows
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
    if set(max_logit) != set(layers):
        raise ValueError(f"qk_clip_: max_logit has layers {sorted(max_logit)} but layers has "
                         f"{sorted(layers)}; give both for the same layers")
    for lay, (qn, kn, _) in layers.items():
        for n in (qn, kn):
            if n not in rt.params:
                raise ValueError(f"qk_clip_: {n!r} (layer {lay!r}) is not a dedicated param; "
                                 "route W_q and W_k to Muon (dedicate them)")
    if rt.R > 1:
        raise NotImplementedError("qk_clip_ on HSDP (replicate_mesh) is not supported yet: the "
                                  "step's replica publish is already in flight when it runs")
    keys = sorted(layers)
    flat = torch.cat([max_logit[k].detach().reshape(-1).to(torch.float64) for k in keys]).to(rt.device)
    # a non-finite flag travels beside the logits (NaN-safe MAX), so one rank's NaN or Inf
    # (even a -Inf that other ranks' maxima would hide) is seen on every rank
    flat = torch.cat([flat, (~torch.isfinite(flat)).any().to(flat.dtype).reshape(1)])
    flat = max_over_ranks(flat, what="QK-clip max-logit all-reduce", via=rt.mesh_groups)
    if flat[-1].item() > 0:
        raise ValueError(
            "qk_clip_: a max logit is NaN or Inf on some rank (this step's attention overflowed "
            "or its loss is non-finite); nothing was rescaled. Check the loss and inputs "
            "(Muon(check_finite=True) stops the step itself on non-finite gradients).")
    flat = flat[:-1]
    out, at = {}, 0
    owned = set(rt.owned_names)
    for k in keys:
        qn, kn, nkv = layers[k]
        h = max_logit[k].numel()
        out[k] = flat[at:at + h].cpu()
        at += h
        q_f, k_f = clip_factors(out[k], nkv, config)
        if bool((q_f == 1).all()) and bool((k_f == 1).all()):
            continue
        for n, f in ((qn, q_f), (kn, k_f)):
            if n in owned:
                m = rt.masters[n]
                m.copy_(scale_head_rows(m, f))
    return out
