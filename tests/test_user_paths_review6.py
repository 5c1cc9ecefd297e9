"""Users' paths, sixth round (2 gloo ranks, fp64, 3 steps; slow tier: two spawns): each equal to
the same loop on one process with ``RefMuon`` to <= 1e-10, or a clear error on every rank within
a bounded time.

Paths: activation checkpointing through torch's ``apply_activation_checkpointing`` /
``checkpoint_wrapper`` (non-reentrant; the wrapper renames every param ``..._checkpoint_wrapped_
module...``), applied before ``dedicate_params`` or between it and ``fully_shard`` (the seeds'
torchtitan order: ``dedicate_params`` then ``parallelize_model``, which applies it); a block
called twice in one forward (ALBERT-style sharing), plainly or each call in its own
non-reentrant checkpoint, in Z3 and Z2; a tied embedding / head that the predicate dedicates
(``p.ndim == 2``); a warmup
scheduler whose first lr is 0 (``LambdaLR``), and a Muon lr of 0 beside a non-zero AdamW lr;
``model.eval()`` + ``torch.no_grad()`` forwards after each step and between a training forward
and its backward (Z3, Z2); a block's MLP skipped on one rank only (its matrices get a gradient on
the other rank only); an exception raised inside the forward on every rank (a bad batch), caught,
the loop going on (at the first forward ever, and later); the same exception on one rank only,
and an evaluation forward on rank 0 only (``if rank == 0: evaluate(model)``).

Before the fix (measured): ``checkpoint_wrapper``'s state-dict hooks drop
``_checkpoint_wrapped_module.`` from every key, and dmuon's own state-dict functions found the
dedicated entries by their ``named_parameters()`` names. Wrapped before ``dedicate_params``,
``dmuon.get_model_state_dict`` raised ``StateDictError`` (a "rewritten" entry); wrapped after it
(the seeds' torchtitan order), it returned meta tensors for the 14 matrices, silently (the seeds'
``torch.save`` recipe would have written them; loading that dict raised), and
``dmuon.set_model_state_dict`` loaded nothing of the wrapped blocks, matrices and FSDP2 norms
alike (0.61 from the dict), silently; ``dmuon.save_sharded`` raised in both orders. Now dmuon's
raw state-dict pass finds each placeholder's
stand-in under the key it has after any renaming hook, and the dedicated names, tied groups and
load targets follow ``model.state_dict()``'s keys: both orders save, load and resume exactly
(0.0), through the full dicts and through ``save_sharded`` / ``load_sharded``. torch's own ``model.state_dict()`` / ``load_state_dict`` (DCP's route) worked before too.
The other paths measured 0.0 (bitwise) from one process. The exception on one rank only, and
the rank-0-only evaluation in Z3, fail at the next mismatched collective (gloo's own size check
aborts one process, the other raises) within a second; the rank-0-only evaluation in Z2 is exact
(its gathers pair with the other rank's next training gathers of the same weights, and the next
training forward on rank 0 finds everything still gathered).
"""
from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.nn as nn
from dist_utils import START_METHOD, catch, run_each, run_ranks
from models import Block, TinyLlama, make_batches, make_model
from stateful_harness import build_dmuon
from user_paths_harness import TOL, RefMuon, check_path, max_abs_diff

pytestmark = pytest.mark.slow

STEPS, BATCH, WORLD = 3, 4, 2


# ----------------------------------------------------------------------- helpers
def _full_sd(model, env):
    import dmuon
    if env["dist"]:
        return dmuon.get_model_state_dict(model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _torch_full_sd(model):
    """torch's own ``model.state_dict()`` (every rank calls it), DTensors made full."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def _ranks(env):
    return [env["rank"]] if env["dist"] else range(WORLD)


def _backward(model, ids, env, scale=1.0):
    """This rank's micro-batch (distributed) or every rank's in turn (reference)."""
    for r in _ranks(env):
        (scale * model(ids.chunk(WORLD)[r]) / (1 if env["dist"] else WORLD)).backward()


def _build(model, env, cfg=None, blocks=None, **kw):
    if env["dist"]:
        return build_dmuon(env["rank"], env["world"], model,
                           model.layers if blocks is None else blocks, cfg or {}, **kw)
    return model, RefMuon(model)


def _train(model, opt, env, batches=None):
    for ids in batches or make_batches(STEPS, BATCH):
        opt.zero_grad()
        _backward(model, ids, env)
        opt.step()


# ----------------------------------------------------------------------- activation checkpointing
def _wrap_blocks(model):
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=partial(checkpoint_wrapper,
                                             checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, Block))


def _dmuon_sd_diff(model, want):
    """Max abs difference of ``dmuon.get_model_state_dict`` from ``want`` (same keys)."""
    import dmuon
    return max_abs_diff(dmuon.get_model_state_dict(model), want)


def _dmuon_load_diff(model, sd):
    """``dmuon.set_model_state_dict(model, sd)``, then the max abs difference of torch's
    ``model.state_dict()`` from ``sd``."""
    import dmuon
    dmuon.set_model_state_dict(model, sd)
    return max_abs_diff(_torch_full_sd(model), sd)


def _ac_build(env, cfg, order):
    """A model whose blocks ``apply_activation_checkpointing`` wrapped, ``order`` ``"before"`` or
    ``"after"`` ``dedicate_params`` (then ``fully_shard`` on the wrapped blocks, as torchtitan
    does), and its optimizer."""
    model = make_model()
    if order == "before" or not env["dist"]:
        _wrap_blocks(model)
        return _build(model, env, cfg)
    import dmuon
    from models import muon_predicate
    from stateful_harness import HP
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (env["world"],))
    z3 = cfg.get("z3", True)
    dmuon.dedicate_params(model, mesh, muon_predicate, reshard_after_forward=z3)
    _wrap_blocks(model)
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=z3)
    fully_shard(model, mesh=mesh)
    hp = {k: v for k, v in HP.items() if k != "lr"}
    return model, dmuon.Muon(model, lr=HP["lr"], ns_dtype=torch.float64, **hp)


def _ac_wrapper(cfg, order):
    """Train on the wrapped blocks. The distributed run also saves with dmuon's two state-dict
    functions before the last step and resumes in a model and optimizer built anew (the seeds'
    checkpoint recipe), then checks dmuon's ``get`` / ``set`` and torch's ``load_state_dict``
    against torch's ``model.state_dict()``."""
    def path(env):
        import dmuon
        model, opt = _ac_build(env, cfg, order)
        batches = make_batches(STEPS, BATCH)
        _train(model, opt, env, batches[:-1])
        out, saved = {"extra": []}, {}
        if env["dist"]:
            out["save"] = catch(lambda: saved.update(
                model=dmuon.get_model_state_dict(model),
                optim=dmuon.get_optimizer_state_dict(model, opt)))
            again, opt2 = _ac_build(env, cfg, order)
            out["load"] = catch(lambda: (dmuon.set_model_state_dict(again, saved["model"]),
                                         dmuon.set_optimizer_state_dict(again, opt2,
                                                                        saved["optim"])))
            _train(again, opt2, env, batches[-1:])
            # and through dmuon's sharded checkpoint (DCP), into a third build
            ckpt = f"{env['tmp']}/{order}_{cfg.get('z3', True)}"
            out["save_sharded"] = catch(lambda: dmuon.save_sharded(ckpt, model, opt))
            third, opt3 = _ac_build(env, cfg, order)
            out["load_sharded"] = catch(lambda: dmuon.load_sharded(ckpt, third, opt3))
            _train(third, opt3, env, batches[-1:])
        _train(model, opt, env, batches[-1:])
        out["sd"] = _torch_full_sd(model)
        if env["dist"]:
            out["resumed"] = max_abs_diff(_torch_full_sd(again), out["sd"])
            out["resumed_sharded"] = max_abs_diff(_torch_full_sd(third), out["sd"])
            out["get"] = catch(lambda: out.update(got=_dmuon_sd_diff(model, out["sd"])))
            half = {k: 0.5 * v for k, v in out["sd"].items()}
            out["set"] = catch(lambda: out.update(put=_dmuon_load_diff(again, half)))
            again.load_state_dict(model.state_dict())  # torch's own route (what DCP uses)
            out["torch_load"] = max_abs_diff(_torch_full_sd(again), out["sd"])
        return out
    return path


# ----------------------------------------------------------------------- a block used twice
def _twice(cfg, checkpointing=False):
    def path(env):
        # layers.0 runs twice per forward (ALBERT-style sharing); checkpointing: each call in its
        # own non-reentrant torch.utils.checkpoint
        model = TinyLlama(checkpointing=checkpointing, reuse_first=True)
        model.load_state_dict(make_model().state_dict())
        model = model.double()
        # as in review 1: the reused block is not fully_shard-ed (FSDP2's own reuse limits)
        model, opt = _build(model, env, cfg, blocks=list(model.layers)[1:])
        _train(model, opt, env)
        return {"sd": _full_sd(model, env), "extra": []}
    return path


# ----------------------------------------------------------------------- tied and dedicated
def _tied_dedicated(cfg):
    """``lm_head.weight`` is ``embed_tokens.weight`` and the predicate takes every 2-D param
    (``p.ndim == 2``, as many users write it): the tied matrix is dedicated, used at the start
    and the end of the forward (the root group)."""
    def path(env):
        def pred(n, p):
            return p.ndim == 2
        model = make_model(tie=True)
        if env["dist"]:
            model, opt = build_dmuon(env["rank"], env["world"], model, model.layers,
                                     {**cfg, "predicate": pred})
        else:
            opt = RefMuon(model, pred)
        _train(model, opt, env)
        return {"sd": _full_sd(model, env), "extra": []}
    return path


# ----------------------------------------------------------------------- lr = 0
def _warmup_zero(env):
    """``LambdaLR`` warmup whose first factor is 0 (both groups' lr 0 at step 0), then a step
    with Muon's lr set to 0 and AdamW's not: momentum and moments still advance, weights do not
    move (weight decay is multiplied by lr)."""
    model, opt = _build(make_model(), env)
    sch = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 2))
    lrs = []
    for i, ids in enumerate(make_batches(STEPS + 1, BATCH)):
        if i == STEPS:
            opt.param_groups[0]["lr"] = 0.0
        lrs.append([g["lr"] for g in opt.param_groups])
        opt.zero_grad()
        _backward(model, ids, env)
        opt.step()
        if i < STEPS - 1:
            sch.step()
    return {"sd": _full_sd(model, env), "extra": [x for lr in lrs for x in lr]}


# ----------------------------------------------------------------------- evaluation forwards
def _eval_no_grad(cfg, before_step=False):
    """After each step ``model.eval()`` + a ``torch.no_grad()`` forward on a held-out batch, then
    ``model.train()``; and inside each step a ``no_grad`` forward between the training forward and
    its backward (a teacher / logging pass of the same model). ``before_step``: also one between
    the backward and ``step()`` (its loss not kept). FSDP2 frees a module's unsharded params in a
    backward, so after that pass its root (and Z2 blocks) held them through the step: stale in the
    next forward (measured before dmuon.Muon.step resharded them: 7.0e-3 Z3 / 2.0e-3 Z2 here;
    plain FSDP2 + torch's AdamW gives the same, 1.4e-2 / 3.0e-2, a user review found)."""
    def path(env):
        model, opt = _build(make_model(), env, cfg)
        val = make_batches(1, 2, seed=5)[0]
        losses = []
        for ids in make_batches(STEPS, BATCH):
            opt.zero_grad()
            for r in _ranks(env):
                loss = model(ids.chunk(WORLD)[r]) / (1 if env["dist"] else WORLD)
                with torch.no_grad():
                    losses.append(float(model(val)))
                loss.backward()
            if before_step:
                with torch.no_grad():
                    model(val)
            opt.step()
            model.eval()
            with torch.no_grad():
                losses.append(float(model(val)))
            model.train()
        if env["dist"]:  # the reference runs the mid-step pass once per simulated rank
            losses = [x for i, x in enumerate(losses) for _ in range(WORLD if i % 2 == 0 else 1)]
        return {"sd": _full_sd(model, env), "extra": losses}
    return path


# ----------------------------------------------------------------------- a branch on one rank
class BranchBlock(Block):
    """A block whose MLP is skipped while ``skip_mlp`` is set."""

    skip_mlp = False

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x if self.skip_mlp else x + self.mlp(self.post_attention_layernorm(x))


def _branch_one_rank(cfg):
    """Step 1: rank 1 (alone) skips ``layers.0.mlp``: its three matrices get a gradient from rank
    0's micro-batch only (averaged with rank 1's zero), and so does the FSDP2 norm before it."""
    def path(env):
        model = make_model()
        model.layers[0].__class__ = BranchBlock
        model, opt = _build(model, env, cfg)
        for i, ids in enumerate(make_batches(STEPS, BATCH)):
            opt.zero_grad()
            for r in _ranks(env):
                model.layers[0].skip_mlp = i == 1 and r == 1
                (model(ids.chunk(WORLD)[r]) / (1 if env["dist"] else WORLD)).backward()
            opt.step()
        return {"sd": _full_sd(model, env), "extra": []}
    return path


# ----------------------------------------------------------------------- exceptions in forward
class BadBatch(ValueError):
    pass


def _raising(model, when):
    """A forward pre-hook on ``layers.1`` that raises ``BadBatch`` while ``when()`` is true (a
    user's data check inside the model)."""
    def hook(module, args):
        if when():
            raise BadBatch("bad batch")
    return model.layers[1].register_forward_pre_hook(hook)


def _train_catching(model, opt, env, step, skip=lambda i: False, after=lambda i: None,
                    caught=None):
    """``STEPS + 1`` steps (``step[0]``: the current one; ``skip(i)``: leave batch ``i`` out)
    whose batches raising ``BadBatch`` are caught and skipped; returns (and fills ``caught``
    with) their indices; ``after(i)`` runs after each step."""
    caught = [] if caught is None else caught
    for i, ids in enumerate(make_batches(STEPS + 1, BATCH)):
        step[0] = i
        if skip(i):
            continue
        opt.zero_grad()
        try:
            _backward(model, ids, env)
        except BadBatch:
            caught.append(i)
            continue
        opt.step()
        after(i)
    return caught


def _raise_everywhere(cfg, at):
    """The forward of step ``at`` raises on every rank (inside ``layers.1``, after dmuon gathered
    ``layers.0`` and prefetched ``layers.1``); the loop catches it, skips that batch and goes
    on: equal to one process that never saw the batch."""
    def path(env):
        model, opt = _build(make_model(), env, cfg)
        step = [0]
        _raising(model, lambda: step[0] == at)
        caught = _train_catching(model, opt, env, step,
                                 skip=lambda i: not env["dist"] and i == at)
        return {"sd": _full_sd(model, env), "extra": [], "caught": caught}
    return path


PATHS = {
    "ac_wrapper_before": _ac_wrapper({}, "before"),
    "ac_wrapper_before_z2": _ac_wrapper({"z3": False}, "before"),
    "ac_wrapper_after": _ac_wrapper({}, "after"),
    "ac_wrapper_after_z2": _ac_wrapper({"z3": False}, "after"),
    "twice": _twice({}),
    "twice_z2": _twice({"z3": False}),
    "twice_ckpt": _twice({}, checkpointing=True),
    "twice_ckpt_z2": _twice({"z3": False}, checkpointing=True),
    "tied_dedicated": _tied_dedicated({}),
    "tied_dedicated_z2": _tied_dedicated({"z3": False}),
    "warmup_zero": _warmup_zero,
    "eval_no_grad": _eval_no_grad({}),
    "eval_no_grad_z2": _eval_no_grad({"z3": False}),
    "eval_before_step": _eval_no_grad({}, before_step=True),
    "eval_before_step_z2": _eval_no_grad({"z3": False}, before_step=True),
    "branch_one_rank": _branch_one_rank({}),
    "branch_one_rank_z2": _branch_one_rank({"z3": False}),
    "raise_first": _raise_everywhere({}, 0),
    "raise_mid": _raise_everywhere({}, 1),
    "raise_mid_z2": _raise_everywhere({"z3": False}, 1),
}


def _worker(rank, world, tmp):
    torch.set_num_threads(1)
    return run_each(PATHS, dict(rank=rank, world=world, dist=True, tmp=tmp))


def _one_rank_alone(rank, world, z3, what):
    """One rank leaves the ranks' common order at step 1 and goes on: ``"raise"``: rank 1 alone
    raises inside ``layers.1``'s forward, catches it and goes on to the next batch (rank 0 never
    raised); ``"eval"``: rank 0 alone runs a ``no_grad`` evaluation forward after the step (the
    classic ``if rank == 0: evaluate(model)``). The ranks' collectives now disagree: every rank
    must fail within a bounded time (dmuon's timeout: 5 s here), never train on or hang."""
    import dmuon
    torch.set_num_threads(1)
    model = make_model()
    model, opt = build_dmuon(rank, world, model, model.layers, {"z3": z3},
                             options=dmuon.DedicateOptions(timeout=datetime.timedelta(seconds=5)))
    step = [0]
    _raising(model, lambda: what == "raise" and rank == 1 and step[0] == 1)
    caught, t0 = [], time.monotonic()
    env = dict(rank=rank, world=world, dist=True)

    def evaluate(i):  # after the step
        if what == "eval" and rank == 0 and i == 1:
            model.eval()
            with torch.no_grad():
                model(make_batches(1, 2, seed=5)[0])
            model.train()
    try:
        _train_catching(model, opt, env, step, after=evaluate, caught=caught)
        out = {"error": None, "sd": _full_sd(model, env)}
    except Exception as e:  # noqa: BLE001 - the parent inspects it
        out = {"error": (type(e).__name__, str(e))}
    out.update(caught=caught, seconds=time.monotonic() - t0, step=step[0])
    return out


# ----------------------------------------------------------------------- checks
@pytest.fixture(scope="module")
def results(tmp_path_factory):
    t = time.perf_counter()
    out = run_ranks(_worker, WORLD, str(tmp_path_factory.mktemp("review6")), timeout=120)
    print(f"review6 spawn: {time.perf_counter() - t:.1f} s")
    return out


def _check(results, key):
    return check_path(results, PATHS, key)


@pytest.mark.parametrize("key", ["ac_wrapper_before", "ac_wrapper_before_z2",
                                 "ac_wrapper_after", "ac_wrapper_after_z2"])
def test_checkpoint_wrapper_blocks_equal_one_process(results, key):
    _check(results, key)  # read through torch's model.state_dict()
    for rank, r in enumerate(results):  # and torch's own load (DCP's route) loads them
        assert r[key]["torch_load"] == 0.0, (rank, r[key]["torch_load"])


@pytest.mark.parametrize("key", ["ac_wrapper_before", "ac_wrapper_after", "ac_wrapper_after_z2"])
def test_checkpoint_wrapper_blocks_work_with_dmuon_state_dicts(results, key):
    _check_dmuon_state_dicts(results, key)


def _check_dmuon_state_dicts(results, key):
    for rank, r in enumerate(results):
        r = r[key]
        for part in ("save", "load", "get", "set", "save_sharded", "load_sharded"):
            assert r[part] == (None, None), (rank, part, r[part])
        assert r["got"] == 0.0 and r["put"] == 0.0, (rank, r["got"], r["put"])
        assert r["resumed"] <= TOL and r["resumed_sharded"] <= TOL, (
            rank, r["resumed"], r["resumed_sharded"])


@pytest.mark.parametrize("key", ["twice", "twice_z2", "twice_ckpt", "twice_ckpt_z2"])
def test_block_called_twice_in_one_forward_equals_one_process(results, key):
    _check(results, key)


@pytest.mark.parametrize("key", ["tied_dedicated", "tied_dedicated_z2"])
def test_tied_embedding_and_head_dedicated_equal_one_process(results, key):
    _check(results, key)


def test_warmup_lr_zero_equals_one_process(results):
    ref = _check(results, "warmup_zero")
    assert ref["extra"][:2] == [0.0, 0.0]


@pytest.mark.parametrize("key", ["eval_no_grad", "eval_no_grad_z2", "eval_before_step",
                                 "eval_before_step_z2"])
def test_no_grad_eval_forwards_between_steps_equal_one_process(results, key):
    _check(results, key)


@pytest.mark.parametrize("key", ["branch_one_rank", "branch_one_rank_z2"])
def test_branch_skipped_on_one_rank_equals_one_process(results, key):
    _check(results, key)


@pytest.mark.parametrize("key", ["raise_first", "raise_mid", "raise_mid_z2"])
def test_exception_in_forward_on_every_rank_then_next_batch_equals_one_process(results, key):
    _check(results, key)
    for r in results:
        assert r[key]["caught"] == [0 if key == "raise_first" else 1], r[key]["caught"]


@pytest.mark.parametrize("what", ["raise", "eval"])
@pytest.mark.parametrize("z3", [True, False], ids=["z3", "z2"])
def test_one_rank_leaving_the_common_order_fails_every_rank_at_once(z3, what):
    """An exception in forward on one rank only (caught, that rank going on), or an evaluation
    forward on rank 0 only. Not silent and bounded: measured, gloo's own size check aborts one
    process (SIGABRT) at the first mismatched collective, within a second, and the other raises
    "Connection closed by peer"; no rank trains on. (dmuon carries no step counter in its
    collectives, as FSDP2 carries none: a mismatch whose sizes agree is not caught by that
    check.)"""
    from dmuon.launch import run_local_ranks
    t = time.perf_counter()
    results, errors = run_local_ranks(_one_rank_alone, WORLD, (z3, what), {}, backend="gloo",
                                      timeout_s=30, env=None, grace_s=5.0, deadline_s=60,
                                      start_method=START_METHOD)
    print(f"one rank alone ({what}, z3={z3}): {time.perf_counter() - t:.1f} s", results, errors)
    assert time.perf_counter() - t < 60
    assert set(results) | set(errors) == set(range(WORLD)), (results, errors)
    if not errors and all(r["error"] is None for r in results.values()):
        # no rank failed: then the run must be the uninterrupted one (measured: Z2's eval)
        model = make_model()
        _train(model, RefMuon(model), dict(rank=0, world=1, dist=False),
               make_batches(STEPS + 1, BATCH))
        want = {k: v.detach() for k, v in model.state_dict().items()}
        for rank, r in results.items():
            worst = max_abs_diff(r["sd"], want)
            assert worst <= TOL, f"{what} z3={z3} rank {rank}: max abs diff {worst:.3g}"
        return
    for rank, r in results.items():  # a rank that reported: it raised, within seconds
        assert r["error"] is not None and r["seconds"] < 30, (rank, r)
    for rank, e in errors.items():  # a rank that did not: its process died (gloo's abort)
        assert "exited with code" in e, (rank, e)
