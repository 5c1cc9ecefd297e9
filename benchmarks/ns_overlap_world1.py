"""Owner NS overlapped with the backward (``Muon.set_ns_overlap``) at world size 1: step time with
the overlap off and on, in the same process on the same model, alternating blocks.

The model and loop are ``step_world1.py``'s (HF ``LlamaForCausalLM`` by default, ~1.1B: 16 layers,
hidden 2048, intermediate 8192; FSDP2 with bf16 params / fp32 reduces; ``dmuon.Muon`` with its
defaults). Per batch shape (``--shapes``, default B4xT2048 and B1xT2048): a bitwise check (two
fresh models from the same seed, ``--check-steps`` steps each, off then on: the masters and the
owner state equal bit for bit; and on vs on with every speculation discarded), then one model timed in alternating blocks (``--blocks`` of
``--block-steps`` steps each way, the first step of each block untimed: the mode just changed),
step time = CUDA events around zero_grad + forward + backward + step, no host sync inside a block;
median per mode; peak allocated memory and device mallocs per step per mode; the overlap's
counters. Writes JSON (date, machine, torch version).

    python benchmarks/ns_overlap_world1.py --out benchmarks/results/ns_overlap_world1_h100.json
    python benchmarks/ns_overlap_world1.py --tiny --out /tmp/o.json     # CPU smoke test (gloo)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_util import release, run_header, write_json  # noqa: E402
from step_world1 import TINY, Cfg, build, device_alloc_counts, init_world1, lm_loss, make_batches  # noqa: E402

MODES = ("off", "on")


def _state_leaves(opt) -> list[torch.Tensor]:
    import optree
    leaves = list(opt.dedicated_state.owned_masters().values())
    leaves += [t for t in optree.tree_leaves(opt._owner.state) if isinstance(t, torch.Tensor)]
    return [t.detach().to("cpu", copy=True) for t in leaves]


def _train_step(model, opt, ids, cfg: Cfg, discard: bool = False) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    loss, logits = lm_loss(model, ids, cfg.vocab)
    loss.backward()
    del logits
    if discard:  # every gradient multiplied by 1.0 in place: each speculation is discarded
        import dmuon
        dmuon.clip_grad_norm_(model, float("inf"))
    opt.step()
    return loss


def bitwise_check(cfg: Cfg, device, mesh, model_kind: str, steps: int) -> dict:
    """Fresh models from the same seed, ``steps`` steps each: overlap off (twice: is the training
    itself reproducible?), on, and on with every speculation discarded (recomputed in
    ``step()``), under ``torch.use_deterministic_algorithms`` with the math attention kernel (the
    fused attention and embedding backwards add with atomics: two runs of the same model differ
    otherwise). ``on_vs_recomputed``: the speculation is invisible; ``on_vs_off``: equal where the
    batched NS rounds alike whatever the batch."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    got = {}
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            for name, mode, discard in (("off", "off", False), ("off_again", "off", False),
                                        ("on", "on", False), ("recomputed", "on", True)):
                model, opt = build(cfg, "dmuon", device, mesh, model_kind)
                opt.set_ns_overlap(mode)
                for ids in make_batches(cfg, device, steps):
                    _train_step(model, opt, ids, cfg, discard)
                got[name] = (_state_leaves(opt), dict(opt.ns_overlap_stats))
                del model, opt
                release(device)
    finally:
        torch.use_deterministic_algorithms(False)

    def same(a, b):
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))

    def max_rel(a, b):
        return max(float((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-30))
                   for x, y in zip(a, b))

    off, again, on, rec = (got[k][0] for k in ("off", "off_again", "on", "recomputed"))
    return {"off_reproducible": same(off, again), "on_vs_recomputed": same(on, rec),
            "on_vs_off": same(on, off), "on_vs_off_max_rel": max_rel(on, off),
            "off_vs_off_max_rel": max_rel(again, off), "tensors": len(off),
            "stats_on": got["on"][1], "stats_recomputed": got["recomputed"][1]}


def timed_blocks(cfg: Cfg, device, mesh, model_kind: str, blocks: int, block_steps: int,
                 warmup: int) -> dict:
    cuda = device.type == "cuda"
    model, opt = build(cfg, "dmuon", device, mesh, model_kind)
    batches = make_batches(cfg, device)
    for i in range(warmup):  # both modes warm (NS graphs, speculation buffers)
        opt.set_ns_overlap(MODES[i % 2])
        _train_step(model, opt, batches[i % len(batches)], cfg)
    res = {m: dict(step_times=[], peak_allocated_gib=0.0, mallocs=0, timed=0) for m in MODES}
    k = 0
    for b in range(blocks):
        for mode in (MODES if b % 2 == 0 else MODES[::-1]):  # alternate which goes first
            r = res[mode]
            opt.set_ns_overlap(mode)
            _train_step(model, opt, batches[k % len(batches)], cfg)  # untimed: mode changed
            k += 1
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                       for _ in range(block_steps)]
                m0 = device_alloc_counts()[0]
            import time
            t_host = []
            for i in range(block_steps):
                ids = batches[k % len(batches)]
                k += 1
                if cuda:
                    evs[i][0].record()
                t0 = time.perf_counter()
                _train_step(model, opt, ids, cfg)
                if cuda:
                    evs[i][1].record()
                else:
                    t_host.append((time.perf_counter() - t0) * 1e3)
            if cuda:
                torch.cuda.synchronize()
                r["step_times"] += [a.elapsed_time(c) for a, c in evs]
                r["mallocs"] += device_alloc_counts()[0] - m0
                r["peak_allocated_gib"] = max(r["peak_allocated_gib"],
                                              torch.cuda.max_memory_allocated() / 2**30)
            else:
                r["step_times"] += t_host
            r["timed"] += block_steps
    out = {}
    for mode, r in res.items():
        out[mode] = dict(step_ms=statistics.median(r["step_times"]), step_times=r["step_times"],
                         peak_allocated_gib=r["peak_allocated_gib"],
                         device_mallocs_per_step=r["mallocs"] / max(r["timed"], 1))
    out["stats"] = dict(opt.ns_overlap_stats)
    out["saved_pct"] = 100 * (out["off"]["step_ms"] - out["on"]["step_ms"]) / out["off"]["step_ms"]
    del model, opt
    release(device)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/ns_overlap_world1.json")
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU (smoke test)")
    ap.add_argument("--model", choices=("hf", "llama"), default="hf")
    ap.add_argument("--shapes", default="4x2048,1x2048", help="BxT, comma separated")
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--block-steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--check-steps", type=int, default=3, help="0: no bitwise check")
    ap.add_argument("--width", choices=("1b", "8b"), default="1b",
                    help="1b: the 1.1B model (hidden 2048, 16 layers); 8b: Llama-3.1-8B's layer "
                         "shapes (hidden 4096, intermediate 14336), 8 layers")
    ap.add_argument("--check-batch", type=int, default=1,
                    help="batch of the bitwise check (math attention: B4xT2048 does not fit 80 GB)")
    a = ap.parse_args()
    device = torch.device("cuda", 0) if (torch.cuda.is_available() and not a.tiny) \
        else torch.device("cpu")
    mesh = init_world1(device)
    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    if a.tiny:
        shapes = [(TINY.batch, TINY.seq), (1, TINY.seq)]
    results = []
    for batch, seq in shapes:
        base = TINY if a.tiny else Cfg() if a.width == "1b" else \
            Cfg(hidden=4096, inter=14336, heads=32, kv_heads=8, layers=8)
        cfg = Cfg(**{**base.__dict__, "batch": batch, "seq": seq})
        r = dict(batch=batch, seq=seq)
        check_cfg = Cfg(**{**cfg.__dict__, "batch": min(batch, a.check_batch)})
        r["check"] = bitwise_check(check_cfg, device, mesh, a.model, a.check_steps) \
            if a.check_steps > 0 else {}
        r["check"]["batch"] = check_cfg.batch
        r.update(timed_blocks(cfg, device, mesh, a.model, a.blocks, a.block_steps, a.warmup))
        results.append(r)
        print(f"B{batch}xT{seq}: off {r['off']['step_ms']:.2f} ms, on {r['on']['step_ms']:.2f} ms "
              f"({r['saved_pct']:+.2f} % saved), peak {r['off']['peak_allocated_gib']:.2f} / "
              f"{r['on']['peak_allocated_gib']:.2f} GiB, mallocs/step "
              f"{r['off']['device_mallocs_per_step']:.1f} / {r['on']['device_mallocs_per_step']:.1f}"
              f", check {r['check']}, stats {r['stats']}", flush=True)
    doc = {**run_header(), "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None,
           "model": a.model, "width": a.width, "tiny": a.tiny, "blocks": a.blocks,
           "block_steps": a.block_steps,
           "results": results}
    write_json(a.out, doc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
