"""Where a training step's memory goes, per phase (issue 24: peak allocated, "show where the rest goes").

For one configuration of ``step_world1.py`` (same model, same optimizer settings), after
``--warmup`` steps, one measured step is split into its phases, each with its own
``max_memory_allocated`` (reset before every phase):

* ``static`` -- allocated between steps, after ``zero_grad(set_to_none=True)``: the state that lives
  for the whole run, itemized as params (FSDP2 shards plus, for dmuon, the owners' masters),
  Muon momentum, AdamW moments and the rest (NS workspace or other long-lived buffers);
* ``forward`` -- to the loss (the logits stay alive through the step, as in ``step_world1``);
* ``backward`` and ``step``.

Every phase reports its peak above ``static`` and what is allocated at its end; the gradients'
bytes are reported at the end of backward. Run one process per configuration (``--config``),
so that each starts from an empty GPU::

    python benchmarks/memory_phases.py --model hf --config dmuon --out r_dmuon.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
from torch.utils._pytree import tree_leaves

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import step_world1 as sw  # noqa: E402

GIB = 2.0 ** 30


def _bytes(tensors) -> float:
    """GiB held by ``tensors``, each storage counted once."""
    seen, total = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or not t.is_cuda:
            continue
        if hasattr(t, "_local_tensor"):
            t = t._local_tensor
        st = t.untyped_storage()
        if st.data_ptr() in seen or st.size() == 0:
            continue
        seen.add(st.data_ptr())
        total += st.size()
    return total / GIB


def static_parts(model, opt, kind: str) -> dict:
    """GiB of the long-lived state by kind."""
    params = list(model.parameters())
    if kind.startswith("dmuon"):
        from dmuon.stateful.runtime.state import get_state
        rt = get_state(model, "memory_phases")
        masters = list(rt.masters.values())
        momentum = list(tree_leaves(opt.muon_state.momentum)) if opt.muon_state else []
        adam = list(tree_leaves((opt.adamw_state.mu, opt.adamw_state.nu))) if opt.adamw_state else []
        return dict(params_gib=_bytes(params + masters), muon_momentum_gib=_bytes(momentum),
                    adamw_moments_gib=_bytes(adam))
    adam = [v for st in opt.state.values() for v in st.values()]
    return dict(params_gib=_bytes(params), muon_momentum_gib=0.0, adamw_moments_gib=_bytes(adam))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="dmuon")
    ap.add_argument("--model", choices=sorted(sw.MODEL), default="hf")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    cfg = sw.Cfg()
    device = torch.device("cuda", 0)
    mesh = sw.init_world1(device)
    model, opt = sw.build(cfg, a.config, device, mesh, a.model)
    batches = sw.make_batches(cfg, device)
    for i in range(a.warmup):
        opt.zero_grad(set_to_none=True)
        loss, logits = sw.lm_loss(model, batches[i % len(batches)], cfg.vocab)
        loss.backward()
        opt.step()
        del loss, logits
    phases = {}

    def mark(name: str) -> None:
        torch.cuda.synchronize()
        phases[name] = dict(peak_gib=torch.cuda.max_memory_allocated() / GIB,
                            end_gib=torch.cuda.memory_allocated() / GIB)
        torch.cuda.reset_peak_memory_stats()

    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    static = torch.cuda.memory_allocated() / GIB
    parts = static_parts(model, opt, a.config)
    parts["other_gib"] = static - sum(parts.values())
    torch.cuda.reset_peak_memory_stats()
    loss, logits = sw.lm_loss(model, batches[0], cfg.vocab)
    mark("forward")
    logits_gib = _bytes([logits])
    loss.backward()
    mark("backward")
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if a.config.startswith("dmuon"):
        from dmuon.stateful.runtime.state import get_state
        rt = get_state(model, "memory_phases")
        grads += list(rt.pool.buffers.values())
    grads_gib = _bytes(grads)
    opt.step()
    mark("step")
    del loss, logits
    out = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               gpu=torch.cuda.get_device_name(0), torch=torch.__version__, config=a.config,
               model=a.model, static_gib=static, static_parts=parts, logits_gib=logits_gib,
               grads_at_end_of_backward_gib=grads_gib,
               phases={k: dict(v, peak_above_static_gib=v["peak_gib"] - static)
                       for k, v in phases.items()},
               peak_gib=max(v["peak_gib"] for v in phases.values()))
    print(json.dumps(out, indent=1))
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
