"""``python -m dmuon.demo`` (console script ``dmuon-demo``): dmuon vs FSDP2 + AdamW on a known task.

Spawns N ranks (CPU + gloo by default, N = 2; with CUDA: NCCL, one rank per GPU), trains a small
Llama-shaped model on sequences from a fixed random Markov source whose entropy rate is the best
possible loss, once with ``dmuon`` (Muon on the projection matrices, AdamW on the rest) and once with
FSDP2 + ``torch.optim.AdamW``, then prints the owner plan, the bytes each rank moved per step and the
final losses against the floor, and writes ``loss.png`` and ``summary.json`` to ``--out-dir``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from typing import Any, Optional, Sequence

from dmuon.tools.plan_report import format_bytes

__all__ = ["main", "build_parser", "FAST"]

# the tiny configuration of --fast (tests, smoke runs)
FAST = dict(steps=40, layers=1, hidden=32, heads=2, vocab=16, order=1, seq_len=16, batch=16,
            eval_batch=32)
_LABELS = {"dmuon": "dmuon (Muon + AdamW)", "normuon": "dmuon NorMuon + AdamW",
           "muonh": "dmuon MuonH + AdamW", "normuonh": "dmuon NorMuonH + AdamW",
           "dmuon_bf16": "dmuon, bf16 momentum", "dmuon_fp8": "dmuon, fp8 momentum",
           "adamw": "FSDP2 + AdamW"}


def build_parser() -> argparse.ArgumentParser:
    """The ``dmuon-demo`` argument parser."""
    p = argparse.ArgumentParser(
        prog="dmuon-demo",
        description="Train a small Llama-shaped model with dmuon and with FSDP2 + AdamW on a Markov "
                    "source with a known loss floor; write a loss plot and a JSON summary.")
    a = p.add_argument
    a("--steps", type=int, default=500, help="training steps per optimizer (default 500)")
    a("--ranks", type=int, default=None,
      help="number of ranks (default: 2 on CPU, one per GPU on CUDA)")
    a("--device", choices=("auto", "cpu", "cuda"), default="auto",
      help="auto: CUDA + NCCL if a GPU is present, else CPU + gloo (default auto)")
    a("--layers", type=int, default=2, help="transformer blocks (default 2)")
    a("--hidden", type=int, default=64, help="model width (default 64)")
    a("--heads", type=int, default=4, help="attention heads (default 4)")
    a("--vocab", type=int, default=32, help="tokens of the Markov source (default 32)")
    a("--order", type=int, choices=(1, 2), default=2, help="Markov order (default 2)")
    a("--seq-len", type=int, default=64, help="tokens per sequence (default 64)")
    a("--batch", type=int, default=32,
      help="global batch in sequences, split over the ranks (default 32)")
    a("--lr", type=float, default=0.02, help="Muon (and NorMuon) learning rate (default 0.02)")
    a("--hyperball-lr", type=float, default=0.02,
      help="MuonH / NorMuonH relative step (each update moves a matrix by this fraction of its "
           "norm; default 0.02)")
    a("--hyperball-radius", type=float, default=None,
      help="MuonH / NorMuonH: the Frobenius norm every matrix is kept at (default: its norm at "
           "the first step)")
    a("--adamw-lr", type=float, default=0.01,
      help="AdamW learning rate, for dmuon's non-matrix params and the baseline (default 0.01)")
    a("--seed", type=int, default=0, help="seed of the source, the init and the data (default 0)")
    a("--optimizers", default="dmuon,adamw",
      help="comma list of optimizers to run: dmuon (Muon), normuon, muonh, normuonh (Muon's "
           "variants through dmuon.Muon(transform=...)), dmuon_bf16, dmuon_fp8 (Muon with its "
           "momentum stored in bf16 / fp8: variants.muon(momentum_dtype=)), adamw (default dmuon,adamw)")
    a("--out-dir", default=None,
      help="output folder (default ./dmuon-demo-out, with --fast ./dmuon-demo-out-fast, so a "
           "smoke run never overwrites a full run's outputs)")
    a("--plot-backend", choices=("auto", "matplotlib", "builtin"), default="auto",
      help="PNG writer: matplotlib if importable, else built-in (default auto)")
    a("--no-progress", action="store_true", help="no progress bar")
    a("--fast", action="store_true",
      help="tiny configuration for smoke tests (overrides the size options)")
    return p


def _config(args: argparse.Namespace) -> Any:
    import torch

    from dmuon.demo.worker import RunConfig

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but torch.cuda.is_available() is False")
    ranks = args.ranks
    if ranks is None:
        ranks = torch.cuda.device_count() if device == "cuda" else 2
    if ranks < 1:
        raise ValueError(f"--ranks must be >= 1, got {ranks}")
    if device == "cuda" and ranks > torch.cuda.device_count():
        raise ValueError(f"--ranks {ranks} > {torch.cuda.device_count()} visible GPUs (NCCL needs "
                         "one GPU per rank); use fewer ranks or --device cpu")
    opts = tuple(o.strip() for o in args.optimizers.split(",") if o.strip())
    bad = [o for o in opts if o not in _LABELS]
    if bad or not opts:
        raise ValueError(f"--optimizers: unknown {bad}; choose from {sorted(_LABELS)}")
    kw = dict(steps=args.steps, layers=args.layers, hidden=args.hidden, heads=args.heads,
              vocab=args.vocab, order=args.order, seq_len=args.seq_len, batch=args.batch,
              eval_batch=max(64, args.batch))
    if args.fast:
        kw.update(FAST)
        kw["batch"] = -(-kw["batch"] // ranks) * ranks
    kw["eval_batch"] = -(-kw["eval_batch"] // ranks) * ranks
    if kw["batch"] % ranks:
        raise ValueError(f"--batch {kw['batch']} must be divisible by the number of ranks {ranks}")
    if kw["steps"] < 1:
        raise ValueError(f"--steps must be >= 1, got {kw['steps']}")
    if kw["seq_len"] <= kw["order"]:
        raise ValueError(f"--seq-len {kw['seq_len']} must exceed --order {kw['order']} (the first "
                         "`order` tokens of a sequence are context only)")
    if kw["hidden"] % kw["heads"] or (kw["hidden"] // kw["heads"]) % 2:
        raise ValueError(f"--hidden {kw['hidden']} must split into {kw['heads']} heads of even size")
    return RunConfig(ranks=ranks, lr=args.lr, hyperball_lr=args.hyperball_lr,
                     hyperball_radius=args.hyperball_radius,
                     adamw_lr=args.adamw_lr, seed=args.seed,
                     device=device, optimizers=opts, progress=not args.no_progress, **kw)


def _summarize(kind: str, per_rank: list[dict], cfg: Any, floor: float) -> dict:
    r0 = per_rank[0]
    losses = r0["losses"]
    tail = max(1, len(losses) // 20)
    times = [max(r["step_times"][i] for r in per_rank) for i in range(len(losses))]
    steady = times[1:] if len(times) > 1 else times  # the first step pays one-time setup
    out: dict[str, Any] = {
        "label": _LABELS[kind],
        "initial_loss": losses[0],
        "final_train_loss": sum(losses[-tail:]) / tail,
        "final_eval_loss": r0["eval_loss"],
        "gap_to_floor": r0["eval_loss"] - floor,
        "time_per_step_s": statistics.median(steady),
        "time_per_step_mean_s": sum(steady) / len(steady),
        "train_time_s": sum(times),
        "losses": losses,
        "held_out": [list(p) for p in r0["held_out"]],  # [step, loss] on the held-out set
    }
    if kind == "dmuon":
        steps = len(losses)
        by_rank = []
        for rank, r in enumerate(per_rank):
            c = r["counters"]
            by_rank.append({
                "rank": rank,
                "sent": sum(v["sent_bytes"] for v in c.values()) / steps,
                "received": sum(v["received_bytes"] for v in c.values()) / steps,
                "by_lane": {lane: {"sent": v["sent_bytes"] / steps,
                                   "received": v["received_bytes"] / steps,
                                   "collectives": v["collectives"] / steps}
                            for lane, v in c.items()},
                "owned": r["owned"],
            })
        n, P = cfg.ranks, r0["dedicated_bytes"]
        out["bytes_per_rank_per_step"] = by_rank
        out["dedicated_bytes"] = P
        out["num_dedicated"] = r0["num_dedicated"]
        F = r0["presence_bytes"]
        out["presence_bytes"] = F
        out["expected_mean_sent_per_rank_z3"] = (n - 1) / n * (3 * P + F)
        out["plan"] = r0["plan_summary"]
        out["plan_table"] = r0["plan_table"]
    return out


def _print_report(cfg: Any, res: dict, floor: float, uniform: float) -> None:
    if "dmuon" in res:
        d = res["dmuon"]
        print("\nOwner plan (which rank runs Muon on which matrix):")
        print(d["plan_table"])
        print(f"\nBytes each rank moved per step for the {d['num_dedicated']} dedicated matrices "
              f"({format_bytes(d['dedicated_bytes'])}), from the executor's payload counters:")
        for b in d["bytes_per_rank_per_step"]:
            lanes = ", ".join(f"{lane} {format_bytes(v['sent'])}/{format_bytes(v['received'])}"
                              for lane, v in b["by_lane"].items() if v["collectives"])
            lanes = f"sent/received by lane: {lanes}" if lanes else "one rank: no collectives"
            print(f"  rank {b['rank']}: sent {format_bytes(b['sent'])}, received "
                  f"{format_bytes(b['received'])}  ({lanes}; owns {len(b['owned'])} matrices)")
        print(f"  expected mean sent per rank (Z3: broadcast in forward and backward, reduce to "
              f"owner) = (N-1)/N * (3P + F) = {format_bytes(d['expected_mean_sent_per_rank_z3'])}"
              f" (F = {d['presence_bytes']} B: the reduces' presence element per matrix)")
    print(f"\nResults after {cfg.steps} steps (loss in nats/token; floor = entropy rate "
          f"{floor:.4f}, uniform guess {uniform:.4f}):")
    print(f"  {'optimizer':<22} {'initial':>8} {'final train':>12} {'final eval':>11} "
          f"{'gap':>8} {'s/step':>8}")
    for r in res.values():
        print(f"  {r['label']:<22} {r['initial_loss']:8.4f} {r['final_train_loss']:12.4f} "
              f"{r['final_eval_loss']:11.4f} {r['gap_to_floor']:+8.4f} {r['time_per_step_s']:8.4f}")


def run(args: argparse.Namespace) -> int:
    """Run the demo for parsed ``args``; returns the exit code."""
    import torch

    import dmuon
    from dmuon.demo.markov import entropy_rate, make_source, uniform_loss
    from dmuon.demo.model import DemoLM, is_muon_param
    from dmuon.demo.plot import write_loss_plot
    from dmuon.demo.worker import launch, train_rank

    cfg = _config(args)
    t_start = time.perf_counter()
    src = make_source(cfg.vocab, cfg.order, branching=cfg.branching, seed=cfg.seed)
    floor, uniform = entropy_rate(src), uniform_loss(cfg.vocab)
    mcfg = cfg.model_config()
    with torch.device("meta"):
        shapes = DemoLM(mcfg)
    n_params = sum(p.numel() for p in shapes.parameters())
    n_muon = sum(p.numel() for n, p in shapes.named_parameters() if is_muon_param(n, p))
    print(f"dmuon demo: order-{cfg.order} Markov source over {cfg.vocab} tokens, entropy floor "
          f"{floor:.4f} nats/token (uniform guess {uniform:.4f})")
    print(f"model: {cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads} heads, ffn {mcfg.ffn}; "
          f"{n_params:,} params ({n_muon:,} in Muon matrices)")
    print(f"{cfg.ranks} ranks on {cfg.device} ({cfg.backend}); global batch {cfg.batch} x "
          f"{cfg.seq_len} tokens; {cfg.steps} steps per optimizer: {', '.join(cfg.optimizers)}",
          flush=True)

    per_rank = launch(train_rank, cfg.ranks, cfg, backend=cfg.backend, timeout_s=cfg.timeout_s)
    res = {k: _summarize(k, [r[k] for r in per_rank], cfg, floor) for k in cfg.optimizers}
    _print_report(cfg, res, floor, uniform)

    if args.out_dir is None:
        args.out_dir = "./dmuon-demo-out-fast" if args.fast else "./dmuon-demo-out"
    os.makedirs(args.out_dir, exist_ok=True)
    png = os.path.join(args.out_dir, "loss.png")
    backend = write_loss_plot(png, {r["label"]: r["losses"] for r in res.values()}, floor,
                              held_out={r["label"]: r["held_out"] for r in res.values()},
                              eval_sequences=cfg.eval_batch,
                              title=f"dmuon demo: order-{cfg.order} Markov, V={cfg.vocab}, "
                                    f"{cfg.ranks} ranks", backend=args.plot_backend)
    summary = {
        "config": {**cfg.as_dict(), "model": mcfg.as_dict(), "num_params": n_params,
                   "num_muon_params": n_muon, "markov_smoothing": 0.02},
        "floor": floor,
        "uniform_loss": uniform,
        "results": res,
        "final_losses": {k: r["final_eval_loss"] for k, r in res.items()},
        "time_per_step_s": {k: r["time_per_step_s"] for k, r in res.items()},
        "bytes_per_rank_per_step": (
            [{"rank": b["rank"], "sent": b["sent"], "received": b["received"]}
             for b in res["dmuon"]["bytes_per_rank_per_step"]] if "dmuon" in res else None),
        "plot": {"path": "loss.png", "backend": backend},
        "wall_time_s": time.perf_counter() - t_start,
        "torch_version": torch.__version__,
        "dmuon_version": getattr(dmuon, "__version__", None),
        "python_version": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    js = os.path.join(args.out_dir, "summary.json")
    with open(js, "w") as f:
        json.dump(summary, f, indent=2, allow_nan=True)
    print(f"\nwrote {png} ({backend} PNG writer) and {js}; total {summary['wall_time_s']:.1f} s")
    bad = [k for k, v in summary["final_losses"].items() if not math.isfinite(v)]
    return 1 if bad else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``dmuon-demo``; returns the exit code (2: bad options, 1: a rank failed)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from dmuon.demo.worker import DemoWorkerError
    try:
        return run(args)
    except ValueError as e:
        parser.exit(2, f"dmuon-demo: error: {e}\n")
    except DemoWorkerError as e:
        sys.stderr.write(f"dmuon-demo: a training rank failed.\n{e}\n")
        return 1
    return 2  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
