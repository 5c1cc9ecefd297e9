"""Bytes per rank per step of dedicated matrices in DDP mode, against DDP's all-reduce of them.

DDP mode (``dedicate_params(..., data_parallel="ddp")``) is the grid ``G = 1, R = world``: one
step moves, per hook group, the gradient reduce (stage 2 of :func:`~dmuon.functional.schedule.
reduce_schedule`: one replicate-axis Reduce per owner range, average to the owner, with one
presence element per matrix) and the post-step publish (one replicate-axis Broadcast per owner
range from the owner); the forward "unshard" is over groups of one rank and moves nothing. The
numbers are the step program's count (:func:`~dmuon.tools.step_bytes.plan_program`), which the
executor's counters equal.

Plain DDP all-reduces the same gradients. Its ring all-reduce (NCCL's and gloo's algorithm for
large buckets) sends and receives ``2 (N - 1) / N * P`` per rank for ``P`` bytes. dmuon's
reduce + publish: rank ``i`` sends ``P - P_i`` (its part of the others' matrices) plus
``(N - 1) P_i`` (its own matrices, to everyone), on average ``2 (N - 1) / N * P`` as well; received
the same on average. The plan balances the NS cost, so ``P_i`` is near ``P / N`` and the maximum
over ranks stays close to the mean.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

from dmuon.functional.plan import plan_owners
from dmuon.functional.specs import ParamSpec
from dmuon.tools.step_bytes import plan_program

__all__ = ["DDPTraffic", "ddp_step_traffic", "ring_allreduce_bytes"]


class DDPTraffic(NamedTuple):
    """Per-rank bytes of one step for the dedicated matrices.

    Attributes:
      world: N.  matrix_bytes: P (the dedicated matrices, in ``dtype``).
      sent, received: dmuon DDP mode, bytes per global rank (reduce + publish, presence included).
      ring: plain DDP's ring all-reduce of the same P, bytes sent (= received) per rank.
      owned_bytes: P_i, the bytes of the matrices each rank owns (steps with Newton–Schulz).
    """

    world: int
    matrix_bytes: int
    sent: tuple[int, ...]
    received: tuple[int, ...]
    ring: float
    owned_bytes: tuple[int, ...]

    @property
    def mean_sent(self) -> float:
        return sum(self.sent) / self.world

    @property
    def max_sent(self) -> int:
        return max(self.sent)


def ring_allreduce_bytes(payload: int, world: int) -> float:
    """Bytes a ring all-reduce of ``payload`` bytes sends (and receives) per rank:
    ``2 (N - 1) / N * payload`` (reduce-scatter + all-gather)."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    return 2.0 * (world - 1) / world * payload


def ddp_step_traffic(specs: Sequence[ParamSpec], world: int, *,
                     dtype: str = "torch.float32") -> DDPTraffic:
    """Bytes per rank of one DDP-mode step for the ``route == "muon"`` specs, and DDP's ring
    all-reduce of the same matrices (module docstring).

    Args:
      specs: every param's spec (AdamW ones are ignored here: DDP all-reduces them either way).
      world: N, the DDP ranks.
      dtype: gradient (reduce) and param dtype, ``str(torch dtype)``.
    """
    from dmuon.functional.buckets import dtype_itemsize

    plan = plan_owners(specs, 1, world)
    traffic = plan_program(plan, specs, reshard_after_forward=False, compute_dtype=dtype).traffic()
    item = dtype_itemsize(dtype)
    numel: dict[str, int] = {}
    for s in specs:
        if s.route == "muon":
            n = 1
            for d in s.shape:
                n *= int(d)
            numel[s.name] = n
    P = sum(numel.values()) * item
    owned = [0] * world
    for name, (s, r) in plan.owners.items():
        owned[r * 1 + s] += numel[name] * item
    return DDPTraffic(world, P, tuple(traffic.rank_sent(i) for i in range(world)),
                      tuple(traffic.rank_received(i) for i in range(world)),
                      ring_allreduce_bytes(P, world), tuple(owned))
