"""End-to-end training step at world size 1: FSDP2 + fused AdamW vs FSDP2 + dmuon, same process.

A Llama-shaped model (vocab 32k, 16 layers, hidden 2048, intermediate 8192, 32 heads, 8 kv heads;
untied embeddings), batch 4 x 2048 tokens, fp32 params with ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``. Per configuration: step time (CUDA events around zero_grad + forward +
backward + step, steps queued back to back, median), forward+backward and optimizer parts, peak
memory (allocated and reserved, over the timed steps), and for dmuon its own NS time inside the
step (``optimizer.last_step_stats().ns_ms``, CUDA events; read only in extra, untimed steps so the
timed ones have no host sync).

    python benchmarks/step_world1.py --out benchmarks/results/step_world1_h200.json
    python benchmarks/step_world1.py --tiny --out /tmp/s.json      # CPU smoke test (gloo)

Target (issue 9): dmuon step - AdamW step - dmuon NS <= 3 % of the AdamW step; peak memory <=
AdamW's (issue 24: <= 1 %). ``adamw_heat`` (AdamW plus 43 ms of dense fp16 matmuls per step) and
``dmuon_ns1`` (one NS iteration) measure how the NS's power draw slows the other phases of a
power-capped card (NOTES_step.md, run 11).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_util import release, write_json  # noqa: E402


@dataclass
class Cfg:
    vocab: int = 32000
    layers: int = 16
    hidden: int = 2048
    inter: int = 8192
    heads: int = 32
    kv_heads: int = 8
    batch: int = 4
    seq: int = 2048


TINY = Cfg(vocab=128, layers=2, hidden=64, inter=128, heads=4, kv_heads=2, batch=2, seq=16)


class Attention(nn.Module):
    def __init__(self, c: Cfg):
        super().__init__()
        self.h, self.kv, self.d = c.heads, c.kv_heads, c.hidden // c.heads
        self.q_proj = nn.Linear(c.hidden, c.hidden, bias=False)
        self.k_proj = nn.Linear(c.hidden, self.kv * self.d, bias=False)
        self.v_proj = nn.Linear(c.hidden, self.kv * self.d, bias=False)
        self.o_proj = nn.Linear(c.hidden, c.hidden, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.h, self.d).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv, self.d).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        rep = self.h // self.kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


def _rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Block(nn.Module):
    def __init__(self, c: Cfg):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(c.hidden, eps=1e-5)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden, eps=1e-5)
        self.gate_proj = nn.Linear(c.hidden, c.inter, bias=False)
        self.up_proj = nn.Linear(c.hidden, c.inter, bias=False)
        self.down_proj = nn.Linear(c.inter, c.hidden, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    def __init__(self, c: Cfg):
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Embedding(c.vocab, c.hidden)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = nn.RMSNorm(c.hidden, eps=1e-5)
        self.lm_head = nn.Linear(c.hidden, c.vocab, bias=False)
        for p in self.parameters():
            if p.ndim == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids):
        d = self.c.hidden // self.c.heads
        t = ids.shape[1]
        inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=ids.device, dtype=torch.float32) / d))
        ang = torch.outer(torch.arange(t, device=ids.device, dtype=torch.float32), inv)
        ang = torch.cat((ang, ang), dim=-1)
        x = self.embed_tokens(ids)
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def muon_predicate(name: str, p: torch.Tensor) -> bool:
    """Every matrix inside the blocks (embeddings and the head stay on AdamW)."""
    return p.ndim == 2 and ".layers." in f".{name}"


def init_world1(device: torch.device):
    """Single-rank process group (NCCL on CUDA, gloo on CPU; file rendezvous) and its 1-D mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rdzv = tempfile.mkdtemp()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"file://{rdzv}/rdzv", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    return init_device_mesh(device.type, (1,))


def make_batches(cfg: Cfg, device: torch.device, n: int = 4) -> list[torch.Tensor]:
    """``n`` batches of token ids, ``(batch, seq + 1)`` each (fixed seed: the same in every run)."""
    g = torch.Generator(device="cpu").manual_seed(1)
    return [torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g).to(device)
            for _ in range(n)]


def lm_loss(model: nn.Module, ids: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy of ``model`` on ``ids`` (no host sync); returns ``(loss, logits)``
    so that the caller decides how long the logits live."""
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.float().view(-1, vocab), ids[:, 1:].reshape(-1)), logits


class HFLlama(nn.Module):
    """HF ``LlamaForCausalLM`` with the same shapes as :class:`Llama` (SDPA attention), returning
    logits like :class:`Llama` does (issue 24's "HF-model variant")."""

    def __init__(self, c: Cfg):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM
        conf = LlamaConfig(vocab_size=c.vocab, hidden_size=c.hidden, intermediate_size=c.inter,
                           num_hidden_layers=c.layers, num_attention_heads=c.heads,
                           num_key_value_heads=c.kv_heads, max_position_embeddings=c.seq,
                           tie_word_embeddings=False, attn_implementation="sdpa")
        self.inner = LlamaForCausalLM(conf)

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder blocks (each gets its own ``fully_shard``)."""
        return self.inner.model.layers

    def forward(self, ids):
        return self.inner(input_ids=ids, use_cache=False).logits


def device_alloc_counts() -> tuple[int, int]:
    """``(cudaMalloc, cudaFree)`` calls the caching allocator made so far (``memory_stats``)."""
    st = torch.cuda.memory_stats()
    return st.get("num_device_alloc", 0), st.get("num_device_free", 0)


MODEL = {"llama": Llama, "hf": HFLlama}


def build(cfg: Cfg, kind: str, device: torch.device, mesh, model_kind: str = "llama",
          muon_kw: dict | None = None):
    """The model (FSDP2, bf16 mixed precision) and optimizer of config ``kind``; ``muon_kw``:
    further ``dmuon.Muon`` options (e.g. ``momentum_dtype``, ``offload_state``)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    torch.manual_seed(0)
    with torch.device(device):
        model = MODEL[model_kind](cfg)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if kind.startswith("dmuon"):
        from dmuon.stateful.setup.dedicate import dedicate_params
        dedicate_params(model, mesh, muon_predicate)
    elif kind == "reference":  # the reference implementation (whichever ``dmuon`` is importable:
        import dmuon as reference  # state_memory.py puts its source first on the path)
        reference.dedicate_params(model, mesh, predicate=muon_predicate,
                                  compute_dtype=torch.bfloat16)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    if kind == "reference":  # its public API, with the dmuon config's hyperparameters
        opt = reference.Muon(model, lr=0.02, momentum=0.95, weight_decay=0.01, adamw_lr=1e-4,
                             adamw_weight_decay=0.01)
    elif kind.startswith("adamw"):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01,
                                fused=device.type == "cuda")
        if kind.startswith("adamw_heat") and device.type == "cuda":
            opt = Heated(opt, device)
    else:
        from dmuon.newton_schulz.config import NSConfig
        from dmuon.kernels.ns_engine import NSEngine
        from dmuon.stateful.optimizer.muon import Muon
        engine = "auto"
        if kind == "dmuon_chunk1g":
            engine = NSEngine(NSConfig(ns_dtype=None), max_chunk_bytes=1 << 30)
        # dmuon_lr0: Muon's matrices keep their initial values (lr 0; AdamW's part as usual), so
        # forward + backward multiply the same kind of numbers as the AdamW run (whose lr 1e-4
        # barely moves them): separates dmuon's machinery from data-dependent kernel speed
        # dmuon_ns1: one NS iteration instead of five (not Muon's math: a diagnostic of how the
        # forward after NS depends on the NS work before it)
        opt = Muon(model, lr=0.0 if kind == "dmuon_lr0" else 0.02, weight_decay=0.01,
                   ns_steps=1 if kind == "dmuon_ns1" else 5,
                   adamw_lr=1e-4, adamw_weight_decay=0.01,
                   check_finite=(kind == "dmuon_check"), ns_engine=engine,
                   # persistent grad buckets: NS graph replay (default: freed after each step)
                   persistent_grad_buffers=(kind == "dmuon_persistent"),
                   # Muon's elementwise stages as foreach ops (the reference)
                   elementwise="foreach" if kind == "dmuon_foreach" else "auto",
                   **(muon_kw or {}))
    return model, opt


class Heated:
    """An optimizer followed, every step, by ``count`` dense fp16 8192^3 matmuls (about 43 ms on an
    H200, dmuon's NS time on this model): the ``adamw_heat*`` configs, which ask whether a forward
    that follows 43 ms of dense tensor-core work runs slower (clocks) whatever computed it."""

    def __init__(self, opt, device: torch.device, count: int = 28):
        self.opt, self.count = opt, count
        self.a = torch.randn(8192, 8192, device=device, dtype=torch.float16)
        self.c = torch.empty_like(self.a)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.opt.step()
        for _ in range(self.count):
            torch.mm(self.a, self.a, out=self.c)


def run_config(cfg: Cfg, kind: str, device: torch.device, mesh, warmup: int, steps: int,
               stat_steps: int, model_kind: str = "llama", muon_kw: dict | None = None) -> dict:
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t_build = time.perf_counter()
    model, opt = build(cfg, kind, device, mesh, model_kind, muon_kw)
    build_s = time.perf_counter() - t_build
    batches = make_batches(cfg, device)

    host_fb = []   # host time of zero_grad + forward + backward (no sync): host-bound if ~ fwd+bwd

    def step(i, evs=None):
        ids = batches[i % len(batches)]
        if evs:
            evs[0].record()
        h0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss, logits = lm_loss(model, ids, cfg.vocab)  # logits live until the step returns
        loss.backward()
        if evs:
            host_fb.append((time.perf_counter() - h0) * 1e3)
            evs[1].record()
        opt.step()
        if evs:
            evs[2].record()
        return loss

    t0 = time.perf_counter()
    for i in range(warmup):
        loss = step(i)
    first_loss = float(loss.detach())
    warm_s = time.perf_counter() - t0
    peak_warm = torch.cuda.max_memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    evs = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(steps)] \
        if cuda else None
    times = []
    counts, reserved = [], []   # per timed step: (cudaMalloc, cudaFree) so far; reserved bytes
    t0 = time.perf_counter()
    for i in range(steps):
        if cuda:
            counts.append(device_alloc_counts())   # host-side counters: no device sync
            step(i, evs[i])
            reserved.append(torch.cuda.memory_reserved() / 2**30)
        else:
            s = time.perf_counter()
            step(i)
            times.append((time.perf_counter() - s) * 1e3)
    if cuda:
        torch.cuda.synchronize()
        counts.append(device_alloc_counts())
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    out = {"kind": kind, "build_s": build_s, "warmup_s": warm_s, "first_loss": first_loss}
    if cuda:
        step_ms = [e[0].elapsed_time(e[2]) for e in evs]
        fb_ms = [e[0].elapsed_time(e[1]) for e in evs]
        opt_ms = [e[1].elapsed_time(e[2]) for e in evs]
        out.update(step_ms=statistics.median(step_ms), step_times=step_ms,
                   fwd_bwd_times=fb_ms, opt_times=opt_ms, fwd_bwd_host_times=host_fb,
                   fwd_bwd_ms=statistics.median(fb_ms), opt_ms=statistics.median(opt_ms),
                   peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30,
                   peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30,
                   peak_allocated_warmup_gib=peak_warm / 2**30,
                   device_mallocs_per_step=(counts[-1][0] - counts[0][0]) / steps,
                   device_frees_per_step=(counts[-1][1] - counts[0][1]) / steps,
                   device_mallocs_each_step=[b[0] - a[0] for a, b in zip(counts, counts[1:])],
                   device_frees_each_step=[b[1] - a[1] for a, b in zip(counts, counts[1:])],
                   reserved_after_each_step_gib=reserved)
    else:
        out.update(step_ms=statistics.median(times), step_times=times)
    out["wall_ms_per_step"] = wall_ms
    out["last_loss"] = float(loss.detach())
    ns = []
    if kind.startswith("dmuon"):
        ns.append(opt.last_step_stats().ns_ms)  # the last timed step (reading waits for its NS)
    fb_peak, opt_peak = [], []
    for i in range(stat_steps):  # untimed steps: stats and per-phase peak memory
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        opt.zero_grad(set_to_none=True)
        loss, logits = lm_loss(model, batches[i % len(batches)], cfg.vocab)
        del logits
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
            fb_peak.append(torch.cuda.max_memory_allocated() / 2**30)
            torch.cuda.reset_peak_memory_stats()
            before_opt = torch.cuda.memory_allocated() / 2**30
        opt.step()
        if cuda:
            torch.cuda.synchronize()
            opt_peak.append(torch.cuda.max_memory_allocated() / 2**30)
        if kind.startswith("dmuon"):
            ns.append(opt.last_step_stats().ns_ms)
    if cuda and fb_peak:
        out.update(fwd_bwd_peak_gib=max(fb_peak), opt_peak_gib=max(opt_peak),
                   allocated_before_opt_gib=before_opt,
                   allocated_after_step_gib=torch.cuda.memory_allocated() / 2**30)
    if kind.startswith("dmuon"):
        st = opt.last_step_stats()
        out.update(ns_ms=statistics.median(ns), ns_times=ns, stats=st.as_dict(),
                   elementwise=opt.elementwise_mode)
    loss = step(0)
    out["final_loss"] = float(loss.detach())
    del model, opt, batches
    release(device)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/step_world1_h200.json")
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU (smoke test)")
    ap.add_argument("--configs", default="adamw,dmuon,dmuon_foreach,adamw_again",
                    help="also: dmuon_persistent, dmuon_release, dmuon_check, dmuon_chunk1g, "
                    "dmuon_lr0, dmuon_ns1, adamw_heat (AdamW + 43 ms of fp16 matmuls per step)")
    ap.add_argument("--model", choices=sorted(MODEL), default="llama",
                    help="llama: this file's model; hf: transformers' LlamaForCausalLM, same shapes")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--stat-steps", type=int, default=4)
    ap.add_argument("--child", action="store_true",
                    help="run the configs in this process (default: one subprocess per config, "
                    "so that each starts from an empty GPU and peak memory is its own)")
    a = ap.parse_args()
    if not a.child:
        return spawn_children(a)
    cfg = TINY if a.tiny else Cfg()
    device = torch.device("cuda", 0) if (torch.cuda.is_available() and not a.tiny) \
        else torch.device("cpu")
    mesh = init_world1(device)
    n_params = sum(p.numel() for p in Llama(Cfg(**{**asdict(cfg), "layers": 0})).parameters()) \
        if a.tiny else None
    results = []
    for kind in a.configs.split(","):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            left = torch.cuda.memory_allocated()
        r = run_config(cfg, kind, device, mesh, a.warmup, a.steps, a.stat_steps, a.model)
        if device.type == "cuda":
            r["allocated_at_start_gib"] = left / 2**30
        results.append(r)
        print(f"{kind:14s} step {r['step_ms']:8.2f} ms  fwd+bwd {r.get('fwd_bwd_ms', 0):8.2f}  "
              f"opt {r.get('opt_ms', 0):7.2f}  NS {r.get('ns_ms') or 0:7.2f}  "
              f"peak alloc {r.get('peak_allocated_gib', 0):6.2f} GiB  "
              f"reserved {r.get('peak_reserved_gib', 0):6.2f} GiB  fb/opt peaks "
              f"{r.get('fwd_bwd_peak_gib', 0):6.2f}/{r.get('opt_peak_gib', 0):6.2f}  "
              f"left {r.get('allocated_at_start_gib', 0):5.2f}  mallocs/frees per step "
              f"{r.get('device_mallocs_per_step', 0):.1f}/{r.get('device_frees_per_step', 0):.1f}",
              flush=True)
    finish(a, cfg, device, n_params, results)
    dist.destroy_process_group()


def spawn_children(a) -> None:
    """One subprocess per config; merge their JSON into ``a.out``."""
    import subprocess
    results, meta = [], None
    for kind in a.configs.split(","):
        tmp = tempfile.mktemp(suffix=".json")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--configs", kind, "--out", tmp,
               "--warmup", str(a.warmup), "--steps", str(a.steps), "--stat-steps",
               str(a.stat_steps), "--model", a.model] + (["--tiny"] if a.tiny else [])
        subprocess.run(cmd, check=True)
        with open(tmp) as f:
            doc = json.load(f)
        meta = doc
        results += doc["results"]
        # written after every config, so a run cut short keeps what it measured
        cfg = Cfg(**meta["config"])
        device = torch.device("cpu" if meta["gpu"] == "cpu" else "cuda")
        finish(a, cfg, device, meta["tiny_params"], results, gpu=meta["gpu"])


def finish(a, cfg: Cfg, device: torch.device, n_params, results, gpu=None) -> None:
    by = {r["kind"]: r for r in results}
    summary = {}
    base = [by[k]["step_ms"] for k in ("adamw", "adamw_again") if k in by]
    if base and "dmuon" in by:
        a_ms = statistics.mean(base)
        d = by["dmuon"]
        over = d["step_ms"] - a_ms - d["ns_ms"]
        summary = {
            "adamw_step_ms": a_ms, "adamw_step_ms_runs": base,
            "dmuon_step_ms": d["step_ms"], "dmuon_ns_ms": d["ns_ms"],
            "overhead_ms": over, "overhead_pct_of_adamw": 100 * over / a_ms,
            "target_overhead_pct": 3.0, "overhead_met": 100 * over / a_ms <= 3.0,
        }
        if device.type == "cuda":
            summary.update(
                adamw_peak_allocated_gib=by["adamw"]["peak_allocated_gib"],
                dmuon_peak_allocated_gib=d["peak_allocated_gib"],
                adamw_peak_reserved_gib=by["adamw"]["peak_reserved_gib"],
                dmuon_peak_reserved_gib=d["peak_reserved_gib"],
                memory_met_allocated=d["peak_allocated_gib"] <= by["adamw"]["peak_allocated_gib"],
                memory_met_reserved=d["peak_reserved_gib"] <= by["adamw"]["peak_reserved_gib"])
        ref = by.get("dmuon_foreach")
        if ref is not None:
            over_ref = ref["step_ms"] - a_ms - ref["ns_ms"]
            summary.update(dmuon_foreach_step_ms=ref["step_ms"], dmuon_foreach_ns_ms=ref["ns_ms"],
                           dmuon_foreach_opt_ms=ref["opt_ms"] if "opt_ms" in ref else None,
                           dmuon_opt_ms=d.get("opt_ms"),
                           foreach_overhead_ms=over_ref,
                           foreach_overhead_pct_of_adamw=100 * over_ref / a_ms)
        print(json.dumps(summary, indent=1))
    doc = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "gpu": gpu or (torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"),
        "torch": torch.__version__, "config": asdict(cfg), "tiny_params": n_params,
        "warmup": a.warmup, "steps": a.steps, "subprocess_per_config": not a.child,
        "model": a.model,
        "results": results, "summary": summary,
    }
    write_json(a.out, doc)


if __name__ == "__main__":
    main()
