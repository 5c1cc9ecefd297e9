"""A research loop on dmuon's functional API alone, at shard size G = 2: ``torch.func.grad``
gradients, an optimizer chain composed by hand from :mod:`dmuon.functional.transforms`, and the
step program run through the runtime's own phases on 2 gloo ranks. Each rank holds only the masters
of its shard column (each matrix is owned by one rank, which alone runs the chain on it: momentum,
Newton–Schulz, shape scale, learning rate); the forward gathers the full matrices
(:func:`dmuon.functional.step.forward_gather`, the gather phase the runtime's hooks run), the step
averages the gradients to the owners and updates them (:func:`~dmuon.functional.step.rank_step`).
The vector param (a bias) takes the replicated path: its gradient averaged over the ranks by a
schedule of the same ops and runner, the same AdamW on every rank
(:func:`dmuon.functional.replicated.replicated_step`). Equal to one process.

    torchrun --nproc_per_node 2 examples/functional_research.py     # or
    python examples/functional_research.py                           # spawns 2 local ranks itself
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.func import functional_call, grad

import dmuon
from dmuon.functional import (adamw, forward_gather, plan_owners, rank_step, replicated_program,
                              replicated_step, specs_from_named_shapes, step_program)
from dmuon.functional import transforms as T
from dmuon.launch import run

STEPS, BATCH = 6, 16
#: AdamW of the vector params (every rank runs it on the same averaged gradients)
VECTOR_HP = adamw.AdamWHParams(lr=0.01, weight_decay=0.01)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32, bias=False), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4, bias=False)).double()


def loss(model: nn.Module, params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(functional_call(model, params, (x,)), y)


def make_chain() -> T.Transform:
    return T.chain(T.trace_momentum(0.9), T.orthogonalize(), T.scale_by_shape("moonlight"),
                   T.scale_by_learning_rate(0.05))


def batches(steps: int = STEPS) -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 16, generator=g, dtype=torch.float64),
             torch.randn(BATCH, 4, generator=g, dtype=torch.float64)) for _ in range(steps)]


def train(model: nn.Module) -> dict[str, torch.Tensor]:
    """The distributed research loop; returns what this rank holds: its column's matrices and the
    vector params."""
    # --- glue: plan, program, executor, the loop (the functional API end to end) ---
    rank, world = dist.get_rank(), dist.get_world_size()
    full = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    # Muon: the default predicate's matrices (2-D, not embeddings, lm_head or gates); the rest of
    # the trainable params take the replicated AdamW path (frozen ones stay the model's own)
    plan = plan_owners(specs_from_named_shapes(model.named_parameters()), world)
    program = step_program(plan.owners, {n: t.shape for n, t in full.items()},
                           {n: str(t.dtype) for n, t in full.items()}, shard_size=world)
    params = {n: full[n] for n in program.column(rank)}  # G = world: this rank's column only
    vectors = {n: t for n, t in full.items() if n not in plan.owners}
    vec, runner = replicated_program(vectors, shard_size=world), dmuon.mesh_executor(world).run
    chain, state, vstate = make_chain(), None, None
    for x, y in batches():
        mats, _ = forward_gather(program, (rank, 0), params, runner)  # the full matrices
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        gm, gv = grad(lambda m, v: loss(model, {**m, **v}, x, y), argnums=(0, 1))(mats, vectors)
        params, state, _ = rank_step((rank, 0), params, gm, state, program, chain, runner)
        vectors, vstate, _ = replicated_step(vectors, gv, vstate, vec, VECTOR_HP, runner)
    # --- end of glue ---
    return {**params, **vectors}


def train_one_process(model: nn.Module) -> dict[str, torch.Tensor]:
    """The same training in one process on the full batches: the chain on every matrix, AdamW on
    the vector params."""
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    mats = {n: p for n, p in params.items() if p.ndim == 2}
    vectors = {n: p for n, p in params.items() if p.ndim < 2}
    chain = make_chain()
    state, vstate = chain.init(mats), adamw.init(vectors)
    for x, y in batches():
        grads = grad(lambda p: loss(model, p, x, y))(params)
        updates, state = chain.update({n: grads[n] for n in mats}, state, mats)
        mats = T.apply_updates(mats, updates)
        vectors, vstate = adamw.update({n: grads[n] for n in vectors}, vstate, vectors, VECTOR_HP)
        params = {**mats, **vectors}
    return params


def main() -> None:
    got = train(make_model())  # this rank's column and the vector params
    ref = train_one_process(make_model())
    err = torch.tensor(max(float((got[n] - ref[n]).abs().max() / ref[n].abs().max()) for n in got))
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        print(f"max relative difference from one process after {STEPS} steps: {err:.2e}")


if __name__ == "__main__":
    run(main, world_size=2, backend="gloo")
