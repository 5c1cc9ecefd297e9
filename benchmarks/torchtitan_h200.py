"""torchtitan's llama3 debug model on one GPU: dmuon vs torchtitan's own AdamW (issue 21).

torchtitan 0.2.2 (the release whose torch pin matches the H200's torch 2.11; 0.3.0 imports
``torch.distributed.fsdp.DataParallelMeshDims``, which torch 2.11 lacks). Per optimizer, in one
process (world size 1, NCCL on CUDA, gloo on CPU):

- the model: torchtitan's ``Transformer`` with its ``debugmodel`` args (dim 256, 6 layers, 16 heads,
  vocab 2048), built on meta; for dmuon ``dmuon.dedicate_params(model, mesh, predicate)`` with
  every in-layer matrix (wq, wk, wv, wo, w1, w2, w3: 42); then torchtitan's own ``apply_fsdp``
  (its ``parallelize_llama`` skips FSDP at world size 1, so it is called directly: FSDP2 over the
  1-GPU mesh, ``param_dtype=bfloat16`` / ``reduce_dtype=float32`` as the debug config trains;
  TP 1, no activation checkpointing, no compile); ``to_empty`` + its ``init_weights`` (seed 0);
- the optimizers: torchtitan's ``build_optimizers`` (AdamW, lr 8e-4, betas (0.9, 0.95), eps 1e-8,
  weight decay 0.1, fused on CUDA) vs ``dmuon.Muon`` (Muon lr 0.02 on the 42 matrices, AdamW with
  torchtitan's hyperparameters on the rest); both under torchtitan's ``build_lr_schedulers`` (the
  debug config's warmup 2, linear decay over the last 80 %) and grad-norm clipping at 1.0
  (torchtitan's ``clip_grad_norm_`` / ``dmuon.clip_grad_norm_``);
- the data: no tokenizer or dataset (the GPU machine has no internet, and torchtitan's wheel ships
  neither its test tokenizer nor ``c4_test``): a fixed order-1 Markov source over the 2048 tokens
  (:mod:`dmuon.demo.markov`, entropy rate reported as the loss floor), batch 8 x 2048 as the debug
  config, the same batches for both optimizers; loss = torchtitan's ``cross_entropy_loss`` / tokens.

Step time: wall clock around zero_grad + forward + backward + clip + step + lr step, ended by the
loss's ``.item()`` (a host sync every step); the median over the steps after ``--warmup``.

    python benchmarks/torchtitan_h200.py --out $OUT/torchtitan_h200.json          # H200
    python benchmarks/torchtitan_h200.py --device cpu --tiny --steps 3 --warmup 1 --out /tmp/t.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import statistics
import tempfile
import time
from importlib.metadata import version
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger("torchtitan_h200")

#: torchtitan's llama3 ``debugmodel`` (0.2.2 ``llama3_args["debugmodel"]``) and a CPU smoke size
_TINY = dict(dim=64, n_layers=2, n_heads=4, vocab_size=256)


def muon_predicate(name: str, p: torch.Tensor) -> bool:
    """Every in-layer matrix (attention wq/wk/wv/wo, feed-forward w1/w2/w3)."""
    return p.ndim == 2 and name.startswith("layers.")


def job_config(args: argparse.Namespace, device: torch.device) -> Any:
    """torchtitan's ``JobConfig`` with the debug config's training values."""
    from torchtitan.config import JobConfig
    jc = JobConfig()
    jc.training.seq_len = args.seq_len
    jc.training.local_batch_size = args.batch
    jc.training.steps = args.steps
    jc.training.max_norm = 1.0
    jc.training.mixed_precision_param = "bfloat16" if device.type == "cuda" else "float32"
    jc.lr_scheduler.warmup_steps = 2
    jc.lr_scheduler.decay_ratio = 0.8
    jc.lr_scheduler.decay_type = "linear"
    jc.lr_scheduler.min_lr_factor = 0.0
    jc.optimizer.name = "AdamW"
    jc.optimizer.lr = 8e-4
    jc.optimizer.eps = 1e-8
    jc.optimizer.weight_decay = 0.1
    jc.optimizer.implementation = "fused" if device.type == "cuda" else "foreach"
    jc.activation_checkpoint.mode = "none"
    return jc


def make_batches(args: argparse.Namespace, vocab: int) -> tuple[torch.Tensor, float]:
    """``(steps, batch, seq + 1)`` token ids from a fixed Markov source, and its entropy rate."""
    from dmuon.demo.markov import entropy_rate, make_source
    src = make_source(vocab=vocab, order=1, branching=8, seed=0)
    g = torch.Generator().manual_seed(1)
    ids = src.sample(args.steps * args.batch, args.seq_len + 1, g)
    return ids.view(args.steps, args.batch, args.seq_len + 1), entropy_rate(src)


def build(kind: str, args: argparse.Namespace, jc: Any, mesh: Any, device: torch.device):
    """The model, an ``optimizer`` (``zero_grad`` / ``step``), a clip function, the lr scheduler."""
    import dmuon
    from torchtitan.components.lr_scheduler import build_lr_schedulers
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as tt_dist_utils
    from torchtitan.models.llama3 import Transformer, llama3_args
    from torchtitan.models.llama3.infra.parallelize import apply_fsdp

    margs = llama3_args["debugmodel"]
    if args.tiny:
        import dataclasses
        margs = dataclasses.replace(margs, **_TINY)
    margs.update_from_config(jc)
    with torch.device("meta"):
        model = Transformer(margs)
    if kind == "dmuon":
        dmuon.dedicate_params(model, mesh, muon_predicate)
    apply_fsdp(model, mesh, param_dtype=getattr(torch, jc.training.mixed_precision_param),
               reduce_dtype=torch.float32, pp_enabled=False)
    model.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    model.train()
    if kind == "dmuon":
        o = jc.optimizer
        opt = dmuon.Muon(model, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.0,
                         adamw_lr=o.lr, adamw_betas=(0.9, 0.95), adamw_eps=o.eps,
                         adamw_weight_decay=o.weight_decay)
        sched = build_lr_schedulers([opt], jc.lr_scheduler, args.steps)
        clip = lambda: dmuon.clip_grad_norm_(model, jc.training.max_norm)  # noqa: E731
        n_muon = sum(1 for p in model.parameters() if hasattr(p, "_dedicated_owner_rank"))
    else:
        pd = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1,
                          world_size=1)
        opt = build_optimizers([model], jc.optimizer, pd)
        sched = build_lr_schedulers(opt, jc.lr_scheduler, args.steps)
        params = [p for p in model.parameters() if p.requires_grad]
        clip = lambda: tt_dist_utils.clip_grad_norm_(  # noqa: E731
            params, jc.training.max_norm, foreach=True)
        n_muon = 0
    return model, opt, clip, sched, margs, n_muon


def _report_host_syncs(kind: str) -> None:
    """From this step on, log every host sync the CUDA stream sees, with the Python stack that
    caused it (``torch.cuda.set_sync_debug_mode``), for one step."""
    import traceback
    import warnings

    seen: set = set()

    def show(message, category, filename, lineno, file=None, line=None):
        stack = "".join(traceback.format_stack(limit=12)[:-2])
        if stack not in seen:
            seen.add(stack)
            logger.info("%s host sync: %s\n%s", kind, message, stack)
    warnings.showwarning = show
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")


def train(kind: str, args, jc, mesh, device, batches: torch.Tensor) -> dict[str, Any]:
    """``--steps`` training steps; per-step loss and wall time."""
    from torchtitan.components.loss import cross_entropy_loss

    model, opt, clip, sched, margs, n_muon = build(kind, args, jc, mesh, device)
    losses, times, phases, ns_ms = [], [], [], []

    def mark() -> float:  # with --phases: a device sync, so each phase's time is its own
        if args.phases and device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()
    for step in range(args.steps):
        ids = batches[step].to(device, non_blocking=True)
        inputs, labels = ids[:, :-1], ids[:, 1:]
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if args.sync_debug and device.type == "cuda" and step == args.warmup:
            _report_host_syncs(kind)
        opt.zero_grad()
        pred = model(inputs)
        loss = cross_entropy_loss(pred, labels) / labels.numel()
        loss.backward()
        t1 = mark()
        clip()
        t2 = mark()
        opt.step()
        sched.step()
        val = float(loss.item())
        t3 = time.perf_counter()
        times.append((t3 - t0) * 1e3)
        if args.sync_debug and device.type == "cuda" and step == args.warmup:
            torch.cuda.set_sync_debug_mode("default")
        phases.append({"fwd_bwd_ms": (t1 - t0) * 1e3, "clip_ms": (t2 - t1) * 1e3,
                       "step_ms": (t3 - t2) * 1e3})
        stats = getattr(opt, "last_step_stats", None) if args.phases else None
        stats = stats() if callable(stats) else stats  # dmuon.Muon's (reading it waits for NS)
        if stats is not None and stats.ns_ms is not None:
            ns_ms.append(stats.ns_ms)
        losses.append(val)
        logger.info("%s step %d loss %.4f  %.1f ms", kind, step + 1, val, times[-1])
    timed = times[args.warmup:] or times
    out = {"optimizer": kind, "dedicated_matrices": n_muon, "loss": losses, "step_ms": times,
           "median_step_ms_after_warmup": statistics.median(timed),
           "median_phase_ms_after_warmup": {
               k: statistics.median(p[k] for p in (phases[args.warmup:] or phases))
               for k in phases[0]} if args.phases else None,
           "median_ns_ms_after_warmup": (statistics.median(ns_ms[args.warmup:] or ns_ms)
                                         if ns_ms else None),
           "final_loss_mean_last10": statistics.mean(losses[-10:])}
    if device.type == "cuda":
        out["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    del model, opt
    return out


def init_world1(device: torch.device):
    """Single-rank process group (file rendezvous) and its 1-D ``fsdp`` mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rdzv = tempfile.mkdtemp()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"file://{rdzv}/rdzv", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    return init_device_mesh(device.type, (1,), mesh_dim_names=("fsdp",))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10, help="steps left out of the median")
    ap.add_argument("--batch", type=int, default=None, help="default: 8 (debug config); tiny 2")
    ap.add_argument("--seq-len", type=int, default=None, help="default: 2048; tiny 64")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke test)")
    ap.add_argument("--optimizers", default="adamw,dmuon")
    ap.add_argument("--sync-debug", action="store_true",
                    help="log the host syncs of the first timed step with their stacks")
    ap.add_argument("--phases", action="store_true",
                    help="also time fwd+bwd / clip / step apart (device syncs between them) and "
                         "dmuon's NS (its telemetry)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    args.batch = args.batch or (2 if args.tiny else 8)
    args.seq_len = args.seq_len or (64 if args.tiny else 2048)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.device == "cpu":
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    mesh = init_world1(device)
    jc = job_config(args, device)
    vocab = _TINY["vocab_size"] if args.tiny else 2048
    batches, floor = make_batches(args, vocab)
    runs = [train(k, args, jc, mesh, device, batches) for k in args.optimizers.split(",")]
    res = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": (torch.cuda.get_device_name(device) if device.type == "cuda"
                    else platform.processor() or platform.machine()),
        "torch": torch.__version__, "torchtitan": version("torchtitan"),
        "python": platform.python_version(),
        "config": {"model": "llama3 debugmodel" + (" (tiny)" if args.tiny else ""),
                   "batch": args.batch, "seq_len": args.seq_len, "steps": args.steps,
                   "warmup_steps_excluded": args.warmup,
                   "param_dtype": jc.training.mixed_precision_param, "reduce_dtype": "float32",
                   "world_size": 1, "tp": 1, "lr_adamw": 8e-4, "lr_muon": 0.02,
                   "data": "order-1 Markov source (dmuon.demo.markov), seed 0",
                   "loss_floor_entropy_rate": floor},
        "runs": runs,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    for r in runs:
        logger.info("%s: median step %.2f ms, mean loss of last 10 steps %.4f (floor %.4f)",
                    r["optimizer"], r["median_step_ms_after_warmup"],
                    r["final_loss_mean_last10"], floor)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
