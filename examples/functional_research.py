"""A research loop on dmuon's functional API alone: ``torch.func.grad`` gradients, an optimizer
chain composed by hand from :mod:`dmuon.functional.transforms`, and the step program run by
:func:`dmuon.functional.step.rank_step` on 2 gloo ranks. Each matrix is owned by one rank, which
alone runs the chain (momentum, Newton–Schulz, shape scale, learning rate) on it; the step program
averages the gradients to the owners and publishes the new matrices. Equal to one process.

    torchrun --nproc_per_node 2 examples/functional_research.py     # or
    python examples/functional_research.py                           # spawns 2 local ranks itself
"""
from __future__ import annotations


import torch
import torch.distributed as dist
import torch.nn as nn
from torch.func import functional_call, grad

from dmuon.functional import transforms as T
from dmuon.functional.plan import plan_owners
from dmuon.functional.program import step_program
from dmuon.functional.specs import specs_from_named_shapes
from dmuon.functional.step import rank_step
from dmuon.launch import run
from dmuon.stateful.runtime.executor import mesh_executor

STEPS, BATCH = 6, 16


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32, bias=False), nn.Tanh(), nn.Linear(32, 32, bias=False),
                         nn.Tanh(), nn.Linear(32, 4, bias=False)).double()


def make_chain() -> T.Transform:
    return T.chain(T.trace_momentum(0.9), T.orthogonalize(), T.scale_by_shape("moonlight"),
                   T.scale_by_learning_rate(0.05))


def batches(steps: int = STEPS) -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 16, generator=g, dtype=torch.float64),
             torch.randn(BATCH, 4, generator=g, dtype=torch.float64)) for _ in range(steps)]


def train(model: nn.Module) -> dict[str, torch.Tensor]:
    """The distributed research loop (every rank holds the params; each matrix has one owner)."""
    # --- glue: plan, program, executor, loss (the functional API end to end) ---
    rank, world = dist.get_rank(), dist.get_world_size()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    specs = specs_from_named_shapes(model.named_parameters(), lambda n, p: p.ndim == 2)
    plan = plan_owners(specs, 1, world)  # G = 1, R = world: DDP-style, every rank holds params
    program = step_program(plan.owners, {n: p.shape for n, p in params.items()},
                           {n: str(p.dtype) for n, p in params.items()},
                           shard_size=1, replicate_size=world)
    runner = mesh_executor(1, world).run
    chain, state = make_chain(), None

    def loss(p, x, y):
        return nn.functional.mse_loss(functional_call(model, p, (x,)), y)

    for x, y in batches():
        mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        grads = grad(loss)(params, x[mine], y[mine])
        params, state, _ = rank_step((0, rank), params, grads, state, program, chain, runner)
    # --- end of glue ---
    return params


def train_one_process(model: nn.Module) -> dict[str, torch.Tensor]:
    """The same training in one process on the full batches: the chain on every matrix."""
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    chain = make_chain()
    state = chain.init(params)
    for x, y in batches():
        grads = grad(lambda p: nn.functional.mse_loss(functional_call(model, p, (x,)), y))(params)
        updates, state = chain.update(grads, state, params)
        params = T.apply_updates(params, updates)
    return params


def main() -> None:
    got = train(make_model())
    ref = train_one_process(make_model())
    err = max(float((got[n] - ref[n]).abs().max() / ref[n].abs().max()) for n in ref)
    if dist.get_rank() == 0:
        print(f"max relative difference from one process after {STEPS} steps: {err:.2e}")


if __name__ == "__main__":
    run(main, world_size=2, backend="gloo")
