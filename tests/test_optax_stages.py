"""Stages written in the optax form only (``init`` / ``update``, no in-place ``update_``) run
wherever dmuon runs a chain (issue 48): in the pure distributed step (``world_step``,
``owner_step``), in ``transforms.update_params``, and through ``dmuon.Muon(transform=...)``
(slow tier: tests/test_variants_distributed.py), equal to one process running the chain in the
optax form (``chain.update`` + ``apply_updates``, the example's loop), fp64.

Before: a chain with such a stage had no in-place form and every one of those refused it
(``TypeError: ... has no in-place form``), among them the clip of
``examples/research_transforms.py``."""
from __future__ import annotations

import pytest
import torch

import optax_stages as ox
from dmuon.functional import muon as fmuon
from dmuon.functional import transforms as T
from dmuon.functional.buckets import hook_groups
from dmuon.functional.owner_step import owner_step
from dmuon.functional.program import step_program
from dmuon.functional.step import world_step

HP = fmuon.MuonHParams(lr=0.05, momentum=0.9, weight_decay=0.1, ns_steps=5,
                       ns_dtype=torch.float64)
SHAPES = {"model.layers.0.q_proj.weight": (6, 4), "model.layers.0.o_proj.weight": (4, 6),
          "model.layers.1.up_proj.weight": (8, 4), "model.layers.1.down_proj.weight": (4, 8)}
OWNERS = {"model.layers.0.q_proj.weight": (0, 0), "model.layers.0.o_proj.weight": (1, 0),
          "model.layers.1.up_proj.weight": (1, 0), "model.layers.1.down_proj.weight": (0, 0)}
UNUSED = "model.layers.1.down_proj.weight"  # no gradient at the first step


def _grads(world: int, steps: int) -> list[list[dict]]:
    """Per step, per rank: local gradients (none for ``UNUSED`` at the first step)."""
    g = torch.Generator().manual_seed(7)
    return [[{n: torch.randn(*s, generator=g, dtype=torch.float64) for n, s in SHAPES.items()
              if not (n == UNUSED and step == 0)} for _ in range(world)] for step in range(steps)]


def _full() -> dict:
    g = torch.Generator().manual_seed(1)
    return {n: torch.randn(*s, generator=g, dtype=torch.float64) for n, s in SHAPES.items()}


def _averaged(per_rank: list[dict]) -> dict:
    return {n: (sum(r[n] for r in per_rank) / len(per_rank) if n in per_rank[0] else None)
            for n in SHAPES}


def _tensors(tree) -> list:
    import optree
    return [t for t in optree.tree_leaves(tree, none_is_leaf=True) if isinstance(t, torch.Tensor)]


def _close(got: dict, want: dict) -> None:
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=1e-12, msg=n)


def test_the_examples_clip_in_the_distributed_step_equals_one_process():
    G, steps = 2, 3
    program = step_program(OWNERS, SHAPES, {n: "torch.float64" for n in SHAPES}, shard_size=G,
                           replicate_size=1, groups=hook_groups(list(SHAPES)))
    full, grads = _full(), _grads(G, steps)
    params = [{n: full[n].clone() for n in SHAPES if OWNERS[n][0] == s} for s in range(G)]
    states = None
    for per_rank in grads:
        params, states, _ = world_step(params, per_rank, program, states, HP,
                                       transform=ox.clipped)
    want, _ = ox.optax_run(ox.clipped(HP), [_averaged(r) for r in grads], full)
    for s in range(G):
        _close(params[s], {n: want[n] for n in params[s]})
    # the clip binds: without it the weights are elsewhere
    other, _ = ox.optax_run(ox.unclipped(HP), [_averaged(r) for r in grads], full)
    assert max(float((want[n] - other[n]).abs().max()) for n in SHAPES) > 1e-3


@pytest.mark.parametrize("donate", [False, True])
def test_a_stateful_optax_stage_on_an_owner_equals_one_process(donate):
    """Per-param state (declared ``per_param``), a matrix without a gradient at the first step,
    dmuon's applying stage after it; the owner's update in place, donated or not."""
    full, grads = _full(), [_averaged(r) for r in _grads(1, 3)]
    want, want_state = ox.optax_run(ox.second_moment(HP), grads, full)
    params, state = {n: t.clone() for n, t in full.items()}, None
    for g in grads:
        params, state = owner_step({n: None if t is None else t.clone() for n, t in g.items()},
                                   state, params, HP, transform=ox.second_moment, donate=donate)
    _close(params, want)
    nu, want_nu = state.states[2].nu, want_state.states[2].nu
    _close(nu, want_nu)
    # one process, in place
    chain, got = ox.second_moment(HP), {n: t.clone() for n, t in full.items()}
    st = chain.init(got)
    for g in grads:
        got, st = T.update_params(chain, g, st, got)
    _close(got, want)


def test_an_optax_stage_after_the_applying_stage_raises_with_advice():
    """In place, ``decoupled_apply`` has written the weights: an optax-form stage after it cannot
    be run out of place; the error says where to put it (and the optax form itself still runs)."""
    def late(hp):
        return T.chain(T.trace_momentum(hp.momentum, hp.nesterov), T.orthogonalize(),
                       T.decoupled_apply(hp.lr, hp.weight_decay),
                       ox.research_example().clip_update_rms(ox.CLIP_RMS))
    full, grads = _full(), [_averaged(r) for r in _grads(1, 1)]
    with pytest.raises(ValueError, match="Put it before that stage"):
        owner_step(grads[0], None, full, HP, transform=late)
    ox.optax_run(late(HP), grads, full)


def test_an_optax_stage_after_the_applying_stage_is_refused_before_anything_moves():
    """The same chain, refused when ``dmuon.Muon`` is built (``check_chain``, the check it runs)
    and, run anyway, before any stage writes: a donated step leaves the momentum and the weights
    as they were (before, the momentum stage had already run in place), nested chains too."""
    from dmuon.functional.owner_checks import check_chain

    def late(hp):
        return T.chain(T.trace_momentum(hp.momentum, hp.nesterov), T.orthogonalize(),
                       T.decoupled_apply(hp.lr, hp.weight_decay),
                       ox.research_example().clip_update_rms(ox.CLIP_RMS))

    def nested(hp):  # the applying stage and the optax one inside an inner chain
        return T.chain(T.trace_momentum(hp.momentum, hp.nesterov), T.orthogonalize(),
                       T.chain(T.decoupled_apply(hp.lr, hp.weight_decay),
                               ox.research_example().clip_update_rms(ox.CLIP_RMS)))

    for build in (late, nested):
        with pytest.raises(ValueError, match="Put it before that stage"):
            check_chain(build(HP), False, {}, {})
        full, grads = _full(), [_averaged(r) for r in _grads(1, 1)]
        state = build(HP).init(full)
        before = [t.clone() for t in _tensors((full, state))]
        with pytest.raises(ValueError, match="Put it before that stage"):
            owner_step(grads[0], state, full, HP, transform=build, donate=True)
        for was, now in zip(before, _tensors((full, state))):
            assert torch.equal(was, now), "a stage wrote before the refusal"
    check_chain(ox.clipped(HP), False, {}, {})  # the clip before the applying stage: fine


def test_an_optax_stage_is_refused_on_tensor_parallel_slices():
    """It sees each matrix whole, which a TP slice's owner does not hold: refused when
    ``dmuon.Muon`` is built (the check it runs), saying how to run such a stage on slices."""
    from types import SimpleNamespace

    from dmuon.functional.owner_checks import check_chain
    tp = {"model.layers.0.q_proj.weight": SimpleNamespace(dim=0)}
    check_chain(ox.unclipped(HP), False, {}, tp)  # in-place stages only: fine
    for chain in (ox.clipped(HP), ox.research_example().clip_update_rms(ox.CLIP_RMS)):
        with pytest.raises(ValueError, match="optax form only .* in-place form"):
            check_chain(chain, False, {}, tp)


def test_an_optax_stage_under_vmap_over_an_lr_sweep_equals_the_loop():
    """``update_params`` of a chain with the example's clip, vmapped over lrs (params and state
    batched), equals a loop over the lrs (the out-of-place run meets batched tensors, which have
    no storage to compare)."""
    import optree
    lrs = torch.tensor([0.01, 0.05], dtype=torch.float64)
    full, grads = _full(), _averaged(_grads(1, 2)[1])
    chain0 = ox.clipped(HP)
    batched = lambda t: t.expand(len(lrs), *t.shape).clone() if t.ndim else t  # noqa: E731

    def step(lr, p, s):
        return T.update_params(ox.clipped(HP._replace(lr=lr)), grads, s, p)

    got, _ = torch.vmap(step)(lrs, optree.tree_map(batched, full),
                              optree.tree_map(batched, chain0.init(full)))
    for i, lr in enumerate(lrs.tolist()):
        chain = ox.clipped(HP._replace(lr=lr))
        want, _ = T.update_params(chain, grads, chain.init(full), full)
        _close({n: t[i] for n, t in got.items()}, want)


def test_a_count_kept_as_a_python_number_is_refused_pure():
    """A stage's count in a Python int cannot be checkpointed (a resume restarted it, silently:
    issue 48's review); dmuon.Muon refuses such a chain when built (tests below)."""
    from dmuon.functional.state_fields import check_counts, number_leaves

    assert number_leaves({"count": 0, "mu": {"w": torch.zeros(2)}, "flag": True}) == [".count"]
    assert number_leaves((torch.zeros(()), {"a": 1.5})) == [".1.a"]
    check_counts({"count": torch.zeros((), dtype=torch.int64)}, "x")
    with pytest.raises(TypeError, match=r"Python numbers at \['.count'\].*0-d tensors"):
        check_counts({"count": 0}, "dmuon.Muon(transform=...)")


def _count_worker(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon
    from dist_utils import catch
    from models import make_batches, make_model, muon_predicate

    out = {}
    for as_tensor in (False, True):
        model = make_model()
        mesh = init_device_mesh("cpu", (world_size,))
        dmuon.dedicate_params(model, mesh, muon_predicate)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        made = catch(lambda: dmuon.Muon(model, 0.02, transform=ox.counting(as_tensor)))
        out[as_tensor] = made
        if as_tensor:
            opt = dmuon.Muon(model, 0.02, transform=ox.counting(True))
            for batch in make_batches(3, 2):
                model(batch).backward()
                opt.step()
                opt.zero_grad()
            sd = opt.state_dict()
            opt2 = dmuon.Muon(model, 0.02, transform=ox.counting(True))
            opt2.load_state_dict(sd)
            out["counts"] = (opt._owner.scalars(), opt2._owner.scalars())
    dist.barrier()
    return out


@pytest.mark.slow  # one spawned rank (~5 s)
def test_a_python_number_count_is_refused_when_built_and_a_tensor_count_resumes():
    from dist_utils import run_ranks

    (res,) = run_ranks(_count_worker, 1)
    kind, msg = res[False]
    assert kind == "TypeError" and "Python numbers at ['.states.1.count']" in msg, res[False]
    assert res[True] == (None, None)
    assert res["counts"][0] == res["counts"][1] == [3.0], res["counts"]


def test_an_optax_stage_returning_another_shape_names_the_leaf():
    """A stage returning a (1, n) update for an (m, n) matrix broadcast silently (every row moved
    alike) and a transposed one failed in torch's arithmetic without naming the stage (issue 48's
    review); now both raise a ValueError naming the leaf."""
    def bad(shape_of):
        def update(updates, state, params):
            return {n: u.new_ones(shape_of(u)) for n, u in updates.items()}, state
        return T.Transform(lambda params: (), update)

    params = {"w": torch.randn(4, 3, dtype=torch.float64)}
    grads = {"w": torch.randn(4, 3, dtype=torch.float64)}
    for shape_of in (lambda u: (1, u.shape[1]), lambda u: tuple(reversed(u.shape))):
        chain = T.chain(bad(shape_of), T.scale_by_learning_rate(0.1))
        with pytest.raises(ValueError, match=r"update for 'w' has shape .* its update's is \(4, 3\)"):
            T.update_params(chain, grads, chain.init(params), params)
