"""Memory and step time of the owners' Muon state options (issue 38): AdamW / dmuon fp32 / bf16 /
fp8 momentum / offloaded momentum, on ``step_world1``'s model and step (HF Llama 1.1B by default:
vocab 32k, 16 layers, hidden 2048, B4 x T2048, fp32 params, bf16 mixed precision, world size 1).

Per config, in its own subprocess (each starts from an empty GPU): ``step_world1.run_config``'s
step time (median of CUDA-event-timed steps) and peak allocated memory, the state held between
steps (``memory_phases.static_parts``: params, Muon momentum, AdamW moments, on the device), the
owners' Muon state bytes as the optimizer holds them (device / host) next to the plan's number
(:func:`dmuon.functional.memory_model.rank_memory`), and (``--largest``) the largest Llama-shaped
model the config trains at B1 x T2048: the most layers of the 1.1B's width that run without
running out of memory (two shallow probes predict it, tries around the prediction find the
boundary; one subprocess per try).

    python benchmarks/state_memory.py --out benchmarks/results/state_memory_h200.json
    python benchmarks/state_memory.py --tiny --out /tmp/sm.json       # CPU smoke test (gloo)

Targets (issue 38): bf16 momentum's peak allocated <= 23.83 GiB (the reference implementation's
on this model); offloaded step time within 3 % of on-device.

The chunked step (``state_storage.StepIO``): ``dmuon_bf16`` decodes its momentum in chunks of
``CHUNK_BYTES`` (256 MiB), ``dmuon_bf16_one_chunk`` all at once (compare their ``opt_peak_gib``,
the step's own peak, and ``peak_allocated_gib``). Offload copies each hook group's momentum in
during the backward (``dmuon_offload``); ``dmuon_offload_cap512m`` copies at most 512 MiB ahead
(compare ``fwd_bwd_peak_gib`` and ``step_ms``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, replace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import memory_phases as mp  # noqa: E402
import step_world1 as sw  # noqa: E402

#: config name -> (step_world1 kind, dmuon.Muon options[, state_storage module settings])
CONFIGS = {
    "adamw": ("adamw", {}),
    "dmuon_fp32": ("dmuon", {}),
    "dmuon_bf16": ("dmuon", {"momentum_dtype": "bf16"}),
    "dmuon_fp8": ("dmuon", {"momentum_dtype": "fp8"}),
    "dmuon_offload": ("dmuon", {"offload_state": True}),
    "dmuon_bf16_offload": ("dmuon", {"momentum_dtype": "bf16", "offload_state": True}),
    # the step's momentum decoded in one chunk (the chunking's baseline: all owned momentum in
    # fp32 at once, as before the chunked step, though freed before Newton-Schulz)
    "dmuon_bf16_one_chunk": ("dmuon", {"momentum_dtype": "bf16"}, {"CHUNK_BYTES": 1 << 62}),
    # offload with the backward's copies capped at 512 MiB (the step copies the rest a chunk
    # ahead): the backward's peak without the momentum, at the cost of copies inside the step
    "dmuon_offload_cap512m": ("dmuon", {"offload_state": True}, {"PREFETCH_BYTES": 512 << 20}),
    # the reference implementation (X-Square-Robot/dmuon 0.2.0; its source tree given by
    # --reference-src): dedicate_params(compute_dtype=bf16), so its momentum is bf16
    "reference": ("reference", {}),
}


def apply_config(name: str) -> tuple[str, dict, dict]:
    """Config ``name`` in this process: ``(step_world1 kind, dmuon.Muon options, state_storage
    settings)``, the settings applied (read by each ``MomentumStorage`` when it is built)."""
    kind, kw, *settings = CONFIGS[name]
    kw = dict(kw)
    if "momentum_dtype" in kw:
        from dmuon.functional.state_dtype import check_state_dtype
        kw["momentum_dtype"] = check_state_dtype(kw["momentum_dtype"])
    settings = settings[0] if settings else {}
    if settings:
        from dmuon.stateful.optimizer import state_storage
        for key, value in settings.items():
            setattr(state_storage, key, value)
    return kind, kw, settings


def state_report(model, opt, kind: str, kw: dict) -> dict:
    """Between-steps state (GiB on the device) and the owners' Muon state bytes: held vs planned."""
    # (the reference's own structures are not what static_parts reads: left out)
    out = {} if kind == "reference" else dict(static_parts=mp.static_parts(model, opt, kind))
    if kind.startswith("dmuon"):
        from dmuon.functional.memory_model import rank_memory
        from dmuon.stateful.optimizer.state_storage import state_nbytes
        rt = opt.dedicated_state
        m = rank_memory(rt.program, rt.coord, momentum_dtype=kw.get("momentum_dtype"),
                        offload_state=kw.get("offload_state", False))
        out.update(muon_state_held_bytes=state_nbytes(opt),
                   muon_state_planned_bytes={"device": m.state, "host": m.host_state})
    return out


def child(a) -> dict:
    """One config in this process: step time, peak memory, state (or one ``--largest`` try)."""
    kind, kw, settings = apply_config(a.config)
    cfg = sw.TINY if a.tiny else sw.Cfg()
    if a.layers is not None:  # a --largest try: B1 x T2048 (tiny: its own batch) at this depth
        cfg = replace(cfg, layers=a.layers, batch=1 if not a.tiny else cfg.batch)
    device = torch.device("cuda", 0) if (torch.cuda.is_available() and not a.tiny) \
        else torch.device("cpu")
    mesh = sw.init_world1(device)
    if a.layers is not None:
        try:
            r = sw.run_config(cfg, kind, device, mesh, 1, 1, 0, a.model, kw)
            if device.type == "cuda":
                total, peak = torch.cuda.mem_get_info(device)[1], r["peak_allocated_gib"]
                reserved = r["peak_reserved_gib"]
            else:  # CPU smoke test: parameter bytes stand in for the peak (no allocator counter)
                model, _ = sw.build(cfg, kind, device, mesh, a.model, kw)
                total = a.tiny_capacity_gib * 2**30
                peak = reserved = sum(p.numel() * p.element_size()
                                      for p in model.parameters()) / 2**30
            return {"fits": True, "peak_allocated_gib": peak, "peak_reserved_gib": reserved,
                    "device_total_gib": total / 2**30}
        except torch.OutOfMemoryError as e:
            return {"fits": False, "error": str(e).splitlines()[0]}
    r = sw.run_config(cfg, kind, device, mesh, a.warmup, a.steps, a.stat_steps, a.model, kw)
    if kind.startswith("dmuon"):
        r["state_settings"] = settings
    model, opt = sw.build(cfg, kind, device, mesh, a.model, kw)  # untimed: what it holds
    ids = sw.make_batches(cfg, device, 1)[0]
    opt.zero_grad(set_to_none=True)
    loss, logits = sw.lm_loss(model, ids, cfg.vocab)
    logits_gib = logits.nbytes / 2**30
    del logits
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    r.update(config=a.config, muon_kw={k: str(v) for k, v in kw.items()},
             **state_report(model, opt, kind, kw))
    if "fwd_bwd_peak_gib" in r:
        # the timed steps hold the logits through backward and step (a loop that keeps the
        # model's output); the untimed ones free them before backward: their peak is the whole
        # step's with the logits freed (the convention of the planning round's 23.83 / 28.97 /
        # 25.38 GiB, which equal the AdamW and fp32 rows' fwd_bwd_peak_gib)
        r.update(logits_gib=logits_gib,
                 peak_logits_freed_gib=max(r["fwd_bwd_peak_gib"], r["opt_peak_gib"]))
    r.pop("step_times", None)
    return r


def _spawn(a, config: str, layers: int | None = None) -> dict:
    tmp = tempfile.mktemp(suffix=".json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--config", config, "--out", tmp,
           "--warmup", str(a.warmup), "--steps", str(a.steps), "--model", a.model,
           "--stat-steps", str(a.stat_steps)] \
        + (["--tiny"] if a.tiny else []) + ([] if layers is None else ["--layers", str(layers)])
    env = None
    if CONFIGS[config][0] == "reference":  # its ``dmuon`` on the path instead of ours
        if not a.reference_src:
            raise SystemExit("--configs reference needs --reference-src (a source tree of "
                             "X-Square-Robot/dmuon holding its dmuon/ package)")
        keep = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                if p and not os.path.isdir(os.path.join(p, "dmuon"))]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(a.reference_src)]
                                                          + keep))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tempfile.gettempdir()
                          if env is not None else None)
    if proc.returncode != 0 or not os.path.exists(tmp):
        if layers is not None and "OutOfMemoryError" in proc.stderr:
            return {"fits": False, "error": "out of memory"}
        raise RuntimeError(f"{config} (layers {layers}) failed:\n{proc.stderr[-3000:]}")
    with open(tmp) as f:
        return json.load(f)


def next_depth(tries: dict, cap_gib: float, max_layers: int, bracket: int = 1) -> int | None:
    """The next depth to try in the search for the deepest model that fits (pure), or ``None``
    when the boundary is found (a failing depth at most ``bracket`` above the deepest fit; 1: the
    exact boundary) or the cap is reached.

    ``tries``: ``{layers: (fits, peak memory in GiB or None)}`` (the search passes the peak
    reserved memory: what must fit in the device's ``cap_gib``). While no failing depth lies above
    the deepest fit, extrapolate ``peak = a + b * layers`` from the two deepest fitting tries to the
    device's memory ``cap_gib`` (every layer is the same, but a shallow model's peak is not yet
    linear in its depth, so the slope is refitted from the deepest tries at every step); once one
    does, bisect between them."""
    fitting = sorted(k for k, (ok, _) in tries.items() if ok)
    if not fitting:
        return None
    best = fitting[-1]
    above = [k for k, (ok, _) in tries.items() if not ok and k > best]
    if best >= max_layers or (above and min(above) - best <= max(1, bracket)):
        return None
    if above:
        return (best + min(above)) // 2 if min(above) - best > 2 else best + 1
    if len(fitting) < 2:
        return min(2 * best, max_layers)
    k1 = fitting[-2]
    p1, p2 = tries[k1][1], tries[best][1]
    slope = (p2 - p1) / (best - k1)
    n = best + int((cap_gib - p2) / slope) if slope > 0 else 2 * best
    return max(best + 1, min(n, max_layers))


def largest(a, config: str) -> dict:
    """The most layers (of the model's width) that train at B1 x T2048, in few tries: two shallow
    probes (``--probe-layers``), then :func:`next_depth` (extrapolation from the deepest fitting
    tries, bisection once a failing depth is known), at most ``--max-tries`` more tries."""
    lo_l, hi_l = a.probe_layers
    tries = {n: _spawn(a, config, n) for n in (lo_l, hi_l)}
    if not all(t["fits"] for t in tries.values()):
        raise RuntimeError(f"{config}: a probe depth does not fit: {tries}")
    cap = tries[hi_l]["device_total_gib"]
    p0, p1 = tries[lo_l]["peak_allocated_gib"], tries[hi_l]["peak_allocated_gib"]
    slope = (p1 - p0) / (hi_l - lo_l)
    first_prediction = None
    for _ in range(a.max_tries):
        n = next_depth({k: (t["fits"], t.get("peak_reserved_gib")) for k, t in tries.items()},
                       cap, a.max_layers, a.bracket)
        if n is None or n in tries:
            break
        first_prediction = n if first_prediction is None else first_prediction
        tries[n] = _spawn(a, config, n)
    best = max(k for k, t in tries.items() if t["fits"])
    failing = [k for k, t in tries.items() if not t["fits"] and k > best]
    c = sw.TINY if a.tiny else sw.Cfg()
    h, kv = c.hidden, c.hidden * c.kv_heads // c.heads
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * c.inter + 2 * h  # q, o; k, v; MLP; norms
    return {"layers": best, "boundary_seen": bool(failing) and min(failing) == best + 1,
            "first_failing": min(failing) if failing else None,
            "capped": best >= a.max_layers, "predicted_layers": first_prediction,
            "peak_per_layer_gib": slope, "peak_at_zero_layers_gib": p0 - slope * lo_l,
            "params_billion": (best * per_layer + 2 * c.vocab * h + h) / 1e9,
            "tries": {str(k): v for k, v in sorted(tries.items())}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/state_memory_h200.json")
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU (smoke test)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"of {sorted(CONFIGS)}")
    ap.add_argument("--model", choices=sorted(sw.MODEL), default="hf")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--stat-steps", type=int, default=2,
                    help="untimed steps measuring the peak of forward+backward and of the step "
                         "apart (fwd_bwd_peak_gib, opt_peak_gib)")
    ap.add_argument("--largest", action="store_true",
                    help="also search the largest model each config trains at B1 x T2048")
    ap.add_argument("--reference-src", default=None,
                    help="config 'reference': the reference implementation's source tree")
    ap.add_argument("--only-largest", action="store_true",
                    help="--largest (implied) without the timed run of each config")
    ap.add_argument("--max-layers", type=int, default=256)
    ap.add_argument("--bracket", type=int, default=1,
                    help="--largest: stop once a failing depth is at most this many layers above "
                         "the deepest fit (1: the exact boundary)")
    ap.add_argument("--probe-layers", type=int, nargs=2, default=(2, 6),
                    help="--largest: the two shallow depths whose peaks predict the largest")
    ap.add_argument("--max-tries", type=int, default=8,
                    help="--largest: tries after the two probes")
    ap.add_argument("--tiny-capacity-gib", type=float, default=1.0, help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        with open(a.out, "w") as f:
            json.dump(child(a), f)
        return
    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        raise SystemExit(f"--configs: unknown {bad}; choose from {sorted(CONFIGS)}")
    cuda = torch.cuda.is_available() and not a.tiny
    doc = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "machine": torch.cuda.get_device_name(0) if cuda else "cpu",
           "torch": torch.__version__, "model": a.model,
           "config": asdict(sw.TINY if a.tiny else sw.Cfg()), "results": {}, "largest": {}}
    for c in configs:
        r = {} if a.only_largest else _spawn(a, c)
        doc["results"][c] = r
        print(f"{c:22s} step {r.get('step_ms', 0):8.2f} ms (opt {r.get('opt_ms', 0):6.2f})  peak alloc "
              f"{r.get('peak_allocated_gib', 0):6.2f} GiB (fwd+bwd "
              f"{r.get('fwd_bwd_peak_gib', 0):6.2f}, step {r.get('opt_peak_gib', 0):6.2f})  "
              f"state {r.get('muon_state_held_bytes')}", flush=True)
        if a.largest or a.only_largest:
            doc["largest"][c] = largest(a, c)
            print(f"{c:20s} largest at B1: {doc['largest'][c]['layers']} layers", flush=True)
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:  # after every config: a run cut short keeps what it measured
            json.dump(doc, f, indent=1)
    res = {} if a.only_largest else doc["results"]
    summary = {}
    if cuda and "dmuon_bf16" in res:
        summary["bf16_peak_allocated_gib"] = res["dmuon_bf16"]["peak_allocated_gib"]
        summary["bf16_target_gib"] = 23.83
        summary["bf16_met"] = summary["bf16_peak_allocated_gib"] <= 23.83
        summary["bf16_peak_logits_freed_gib"] = res["dmuon_bf16"].get("peak_logits_freed_gib")
    if cuda and "dmuon_bf16" in res and "reference" in res:  # the same run, both conventions
        for key in ("peak_allocated_gib", "peak_logits_freed_gib"):
            summary[f"bf16_vs_reference_{key}"] = (res["dmuon_bf16"].get(key),
                                                   res["reference"].get(key))
    if "dmuon_offload" in res and "dmuon_fp32" in res:
        ratio = res["dmuon_offload"]["step_ms"] / res["dmuon_fp32"]["step_ms"]
        summary.update(offload_step_ratio=ratio, offload_met=ratio <= 1.03)
    if cuda and "dmuon_bf16" in res and "dmuon_bf16_one_chunk" in res:
        # the chunked decode: the step's own peak, chunked vs one chunk (same run otherwise)
        summary.update(bf16_step_peak_gib=res["dmuon_bf16"].get("opt_peak_gib"),
                       bf16_one_chunk_step_peak_gib=res["dmuon_bf16_one_chunk"].get("opt_peak_gib"))
    if "dmuon_offload_cap512m" in res and "dmuon_fp32" in res:
        summary["offload_cap512m_step_ratio"] = (res["dmuon_offload_cap512m"]["step_ms"]
                                                 / res["dmuon_fp32"]["step_ms"])
    doc["summary"] = summary
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
