"""Per-rank training loop of the demo and the launcher that spawns the ranks.

:func:`launch` starts ``world`` processes through :func:`dmuon.launch.run_local_ranks` (``spawn``,
rendezvous through a ``TCPStore`` the parent creates on port 0: no port collisions), runs
:func:`train_rank` on each and returns the per-rank result dicts. A failing rank makes :func:`launch` raise :class:`DemoWorkerError` with that rank's
traceback; the other ranks are stopped (they would otherwise wait in a collective until the
process-group timeout).

:func:`train_rank` trains the same :class:`~dmuon.demo.model.DemoLM` (same seed, same data) once per
optimizer in ``cfg.optimizers``:

* ``"dmuon"``: ``dedicate_params`` (every ``*proj`` matrix) -> ``fully_shard`` per block and root ->
  ``dmuon.Muon`` (Muon on the matrices, AdamW on embeddings, norms, head);
* ``"adamw"``: ``fully_shard`` per block and root -> ``torch.optim.AdamW`` on every param.

Both use the same LR schedule (linear warm-up, then cosine decay to 10%). Each step draws a fresh
global batch from the Markov source (seeded by the step, identical on every rank) and each rank
trains on its slice; the logged loss is the global mean (one extra ``all_reduce``).
"""
from __future__ import annotations

import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

__all__ = ["RunConfig", "launch", "train_rank", "DemoWorkerError", "ProgressBar", "MUON_KINDS"]

#: the demo's dmuon optimizers: Muon, its variants run through dmuon.Muon(transform=...), and
#: Muon with its momentum stored in bf16 / fp8 (variants.muon(momentum_dtype=...), issue 38)
MUON_KINDS = ("dmuon", "normuon", "muonh", "normuonh", "dmuon_bf16", "dmuon_fp8")
_MOMENTUM_DTYPE = {"dmuon_bf16": torch.bfloat16, "dmuon_fp8": torch.float8_e4m3fn}


@dataclass(frozen=True)
class RunConfig:
    """Everything a rank needs (picklable)."""

    steps: int = 300
    ranks: int = 2
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    vocab: int = 64
    order: int = 1
    branching: int = 4
    seq_len: int = 64
    batch: int = 32                 # global batch (sequences per step, split over ranks)
    lr: float = 0.02                # Muon lr (and NorMuon's)
    hyperball_lr: float = 0.02      # MuonH / NorMuonH: the relative step (no weight decay)
    hyperball_radius: Optional[float] = None  # their fixed norm (None: each matrix's initial)
    adamw_lr: float = 3e-3          # AdamW lr (dmuon's AdamW group and the baseline)
    warmup: float = 0.05            # fraction of steps with linear warm-up
    seed: int = 0
    eval_batch: int = 64            # sequences of the held-out evaluations
    eval_points: int = 10           # held-out evaluations during training (plus the final one)
    device: str = "cpu"             # "cpu" (gloo) or "cuda" (nccl, one rank per GPU)
    optimizers: tuple[str, ...] = ("dmuon", "adamw")
    timeout_s: float = 60.0
    progress: bool = True

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"

    def model_config(self) -> Any:
        """The :class:`~dmuon.demo.model.DemoConfig` of the model every optimizer trains."""
        from dmuon.demo.model import DemoConfig

        return DemoConfig(vocab=self.vocab, hidden=self.hidden, layers=self.layers,
                          heads=self.heads, max_seq_len=self.seq_len)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["optimizers"] = list(self.optimizers)
        d["backend"] = self.backend
        return d


# ----------------------------------------------------------------------------------- progress
class ProgressBar:
    """A dependency-free progress bar on a text stream (stderr by default).

    On a terminal it redraws one line with ``\\r``; otherwise it prints a line at every 10%.
    """

    def __init__(self, total: int, label: str, stream: Any = None, width: int = 28):
        self.total, self.label, self.width = max(1, total), label, width
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.perf_counter()
        self._last_decile = -1

    def update(self, done: int, info: str = "") -> None:
        frac = min(1.0, done / self.total)
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / frac * (1 - frac) if frac > 0 else float("nan")
        fill = int(round(frac * self.width))
        bar = "#" * fill + "." * (self.width - fill)
        count = f"{done:>{len(str(self.total))}}/{self.total}"
        line = f"{self.label:<6} [{bar}] {count} {info}  {elapsed:5.1f}s, eta {eta:4.0f}s"
        if self.tty:
            self.stream.write("\r" + line + "\x1b[K")
            if done >= self.total:
                self.stream.write("\n")
        else:
            decile = int(frac * 10)
            if decile == self._last_decile:
                return
            self._last_decile = decile
            self.stream.write(line + "\n")
        self.stream.flush()


# ----------------------------------------------------------------------------------- training
def _lr_factor(step: int, total: int, warmup_frac: float) -> float:
    """Linear warm-up over ``warmup_frac * total`` steps, then cosine from 1 to 0.1."""
    w = max(1, int(round(warmup_frac * total)))
    if step < w:
        return (step + 1) / w
    t = (step - w) / max(1, total - w)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


def _global_batch(src: Any, cfg: RunConfig, step: int, batch: int, stream: int) -> torch.Tensor:
    g = torch.Generator().manual_seed((cfg.seed * 1_000_003 + stream) * 1_000_003 + step)
    return src.sample(batch, cfg.seq_len + 1, g)


def _loss(model: torch.nn.Module, tokens: torch.Tensor, order: int) -> torch.Tensor:
    """Mean cross-entropy of predicting ``tokens[:, t]`` for ``t >= order`` (full contexts only)."""
    logits = model(tokens[:, :-1])
    scored = logits[:, order - 1:]
    return torch.nn.functional.cross_entropy(scored.reshape(-1, scored.shape[-1]).float(),
                                             tokens[:, order:].reshape(-1))


def _build(kind: str, cfg: RunConfig, mesh: Any, device: torch.device) -> tuple[Any, Any, Any]:
    from torch.distributed.fsdp import fully_shard

    from dmuon.demo.model import DemoLM, is_muon_param

    torch.manual_seed(cfg.seed)
    model = DemoLM(cfg.model_config()).to(device)
    runtime = None
    if kind in MUON_KINDS:
        import dmuon
        from dmuon.functional import variants

        # The three lines a user adds to an FSDP2 script:
        dmuon.dedicate_params(model, mesh, predicate=is_muon_param)  # 2-D "*proj*" matrices
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        # a variant (NorMuon, Muon-Hyperball, their chain) runs the same way, on the owners
        radius = cfg.hyperball_radius
        # bf16 / fp8 momentum: the momentum stage's option (variants.muon(momentum_dtype=...))
        mu = _MOMENTUM_DTYPE.get(kind)
        transform = {"dmuon": None, "dmuon_bf16": variants.muon(momentum_dtype=mu),
                     "dmuon_fp8": variants.muon(momentum_dtype=mu),
                     "normuon": variants.normuon(),
                     "muonh": variants.muon_hyperball(radius=radius),
                     "normuonh": variants.normuon_hyperball(radius=radius)}[kind]
        lr = cfg.hyperball_lr if kind in ("muonh", "normuonh") else cfg.lr
        opt = dmuon.Muon(model, lr=lr, adamw_lr=cfg.adamw_lr, transform=transform)
        runtime = opt.dedicated_state
    elif kind == "adamw":
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.adamw_lr, weight_decay=0.01)
    else:
        raise ValueError(f"unknown optimizer {kind!r}; choose one of {MUON_KINDS + ('adamw',)}")
    return model, opt, runtime


def _all_mean(x: float, device: torch.device) -> float:
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item()) / dist.get_world_size()


def _held_out_loss(model: Any, src: Any, cfg: RunConfig, device: torch.device, rank: int,
                   world: int) -> float:
    """Mean loss (nats/token) on the fixed held-out set (stream 1), split over ranks."""
    model.eval()
    with torch.no_grad():
        per_eval = cfg.eval_batch // world
        ev = _global_batch(src, cfg, 0, cfg.eval_batch, 1)[rank * per_eval:(rank + 1) * per_eval]
        loss = _all_mean(float(_loss(model, ev.to(device), cfg.order)), device)
    model.train()
    return loss


def _add_delta(acc: dict, after: dict, before: dict) -> None:
    for lane, c in after.items():
        a = acc.setdefault(lane, {})
        for k, v in c.items():
            a[k] = a.get(k, 0) + v - before.get(lane, {}).get(k, 0)


def _minus(counters: dict, sub: dict) -> dict:
    return {lane: {k: v - sub.get(lane, {}).get(k, 0) for k, v in c.items()}
            for lane, c in counters.items()}


def _train_one(kind: str, cfg: RunConfig, src: Any, mesh: Any, device: torch.device,
               rank: int, world: int) -> dict:
    import torch.distributed as dist

    model, opt, rt = _build(kind, cfg, mesh, device)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: _lr_factor(s, cfg.steps, cfg.warmup))
    per = cfg.batch // world
    lo, hi = rank * per, (rank + 1) * per
    bar = ProgressBar(cfg.steps, kind) if (rank == 0 and cfg.progress) else None
    losses: list[float] = []
    times: list[float] = []
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if rt is not None:
        rt.executor.reset_counters()
    every = max(1, cfg.steps // max(1, cfg.eval_points))
    held_out: list[tuple[int, float]] = []
    eval_traffic: dict[str, dict[str, int]] = {}  # the evaluations' forward gathers, not counted
    for step in range(cfg.steps):
        tokens = _global_batch(src, cfg, step, cfg.batch, 0)[lo:hi].to(device)
        sync()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = _loss(model, tokens, cfg.order)
        loss.backward()
        opt.step()
        sched.step()
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(_all_mean(float(loss.detach()), device))
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"{kind}: loss became {losses[-1]} at step {step}")
        if bar is not None:
            bar.update(step + 1, f"loss {losses[-1]:.3f}")
        if (step + 1) % every == 0 or step + 1 == cfg.steps:
            before = rt.executor.counters() if rt is not None else None
            held_out.append((step + 1, _held_out_loss(model, src, cfg, device, rank, world)))
            if rt is not None:
                _add_delta(eval_traffic, rt.executor.counters(), before)
    counters = _minus(rt.executor.counters(), eval_traffic) if rt is not None else None
    eval_loss = held_out[-1][1]  # the final held-out loss
    out: dict[str, Any] = {"losses": losses, "step_times": times, "eval_loss": eval_loss,
                           "held_out": held_out}
    if rt is not None:
        out["counters"] = counters
        out["owned"] = list(rt.owned_names)
        if rank == 0:
            from dmuon.tools.plan_report import plan_summary, plan_table
            from dmuon.tools.step_bytes import step_bytes_per_rank

            comm = step_bytes_per_rank(rt.owners, rt.shape, {n: str(d) for n, d in rt.orig_dtype.items()},
                                       rt.G, rt.R)
            out["plan_table"] = plan_table(rt.plan, comm_bytes_per_rank=comm)
            out["plan_summary"] = plan_summary(rt.plan, comm_bytes_per_rank=comm)
            out["dedicated_bytes"] = sum(
                math.prod(rt.shape[n]) * rt.orig_dtype[n].itemsize
                for n in rt.names)
            out["num_dedicated"] = len(rt.names)
            # each gradient reduce also carries one presence element per matrix (reduce dtype)
            out["presence_bytes"] = sum(rt.groups[rt.group_of[n]].reduce_dtype.itemsize
                                        for n in rt.names)
    dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
    del opt, model
    return out


def train_rank(rank: int, world: int, cfg: RunConfig) -> dict:
    """Train every optimizer of ``cfg`` on this rank; returns ``{optimizer: result dict}``."""
    from torch.distributed.device_mesh import init_device_mesh

    from dmuon.demo.markov import make_source

    if cfg.batch % world or cfg.eval_batch % world:
        raise ValueError(f"batch={cfg.batch} and eval_batch={cfg.eval_batch} must be divisible "
                         f"by the number of ranks {world}")
    if cfg.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,))
    src = make_source(cfg.vocab, cfg.order, branching=cfg.branching, seed=cfg.seed)
    results = {}
    for kind in cfg.optimizers:
        results[kind] = _train_one(kind, cfg, src, mesh, device, rank, world)
    return results


# ----------------------------------------------------------------------------------- launcher
class DemoWorkerError(RuntimeError):
    """A demo rank failed; the message carries its traceback."""


# error texts of ranks that failed only because another rank went away
_SECONDARY = ("Connection closed by peer", "Connection reset by peer", "stopped after another rank",
              "communicator was aborted")


def launch(fn: Callable, world: int, *args: Any, backend: str = "gloo",
           timeout_s: float = 60.0, grace_s: float = 5.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned ranks; return the results by rank.

    Args:
      fn: module-level function (pickled by reference).
      world: number of ranks.
      backend: ``"gloo"`` or ``"nccl"``.
      timeout_s: process-group (collective) timeout; a rank stuck longer fails.
      grace_s: after one rank fails, how long the others get to report before they are killed.

    Raises:
      DemoWorkerError: a rank raised or died; the message names the rank(s) and has the traceback.
    """
    from dmuon.launch import run_local_ranks

    results, errors = run_local_ranks(fn, world, args, backend=backend, timeout_s=timeout_s,
                                      grace_s=grace_s)
    if errors:
        # the rank whose error arrived first is the cause; the others usually fail in a collective
        # because it went away
        order = sorted(errors, key=lambda r: any(t in errors[r] for t in _SECONDARY))
        first = order[0]
        msg = "\n".join(f"--- rank {r} ---\n{errors[r]}" for r in order)
        others = f" (then also rank(s) {sorted(order[1:])})" if len(order) > 1 else ""
        raise DemoWorkerError(f"demo rank {first} failed first{others}:\n{msg}")
    return [results[r] for r in range(world)]
