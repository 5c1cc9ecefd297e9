"""More users' paths on a dmuon model (2 gloo ranks, fp64, 3 steps), each equal to the same loop on
one process with ``RefMuon`` (the single-device twin of ``dmuon.Muon`` from
``test_user_paths_review``) to <= 1e-10, or a clear error on every rank.

Paths: checkpoints taken (``get_model_state_dict``, ``get_optimizer_state_dict``,
``save_sharded``) and loaded back (the setters, ``load_sharded``, ``Muon.load_state_dict``) between
the two backward passes of a gradient accumulation, through ``dmuon.no_sync`` (ZeRO-3 and ZeRO-2)
and through FSDP2's ``set_requires_gradient_sync``; a rewind (load the step-0 checkpoint after
step 1, then change ``param_groups[i]["lr"]``, with an ``LambdaLR`` made before the load);
``dmuon.clip_grad_norm_`` with ``norm_type`` 2, 1 and ``inf``, with a matrix that has a gradient on
one rank only or on no rank; ``error_if_nonfinite=True`` with a NaN in one rank's gradient shard (of an FSDP2 param, or of a
dedicated matrix's reduced gradient on its owner); ``norm_type`` ``-inf`` and ``0``.

Before the fix (measured): with ``norm_type=inf`` the NaN vanished in the ``MAX`` all-reduce (gloo's max
keeps the non-NaN operand): no rank raised with ``error_if_nonfinite=True``, and the finite norm
returned scaled the gradients where torch returns NaN; ``norm_type=-inf`` was computed as ``inf``
(the largest entry, torch: the smallest) and ``0`` as a p-norm, silently. Now the inf norm's
all-reduce carries a NaN flag (every rank gets NaN and raises), and ``norm_type <= 0`` raises a
``ValueError`` on every rank.
Note: ``Muon.state_dict()`` aliases the live AdamW moments, as torch's ``Optimizer.state_dict()``
aliases its state: an in-memory rewind needs ``copy.deepcopy`` (as with torch).

The reference runs each rank's micro-batch in turn on one process (loss / world, summed
gradients), so that a matrix used on one rank only gets the distributed average exactly.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from dist_utils import catch, run_ranks
from models import TinyLlama, make_batches, make_model
from stateful_harness import build_dmuon
from user_paths_harness import TOL, assert_state_equal, reference_run

STEPS, BATCH, WORLD = 3, 4, 2


class SkipProjLlama(TinyLlama):
    """``TinyLlama(root_proj=True)`` whose root matrix ``in_proj`` is skipped on the ranks in
    ``self.skip_on`` (a set of rank ids; the reference passes the rank it simulates)."""

    skip_on: frozenset = frozenset()
    rank = 0

    def forward(self, ids):
        x = self.embed_tokens(ids[:, :-1])
        if self.rank not in self.skip_on:
            x = x + self.in_proj(x)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _skip_model():
    m = SkipProjLlama(root_proj=True)
    torch.manual_seed(3)
    with torch.no_grad():
        m.load_state_dict({**make_model().state_dict(),
                           "in_proj.weight": 0.3 * torch.randn(16, 16)}, strict=True)
    return m.double()


# ----------------------------------------------------------------------- helpers
def _backward(model, ids, env, scale=1.0, skip_on=frozenset()):
    """This rank's micro-batch (distributed) or every rank's in turn (reference)."""
    ranks = [env["rank"]] if env["dist"] else range(WORLD)
    for r in ranks:
        if isinstance(model, SkipProjLlama):
            model.rank, model.skip_on = r, skip_on
        (model(ids.chunk(WORLD)[r]) * scale / (1 if env["dist"] else WORLD)).backward()


def _ckpt_roundtrip(model, opt, env, *, sharded):
    """Take the full dicts (and a sharded checkpoint), load them straight back."""
    import dmuon
    sd = dmuon.get_model_state_dict(model)
    osd = dmuon.get_optimizer_state_dict(model, opt)
    dmuon.set_model_state_dict(model, sd)
    dmuon.set_optimizer_state_dict(model, opt, osd)
    opt.load_state_dict(opt.state_dict())
    if sharded:
        path = os.path.join(env["tmp"], "ckpt")
        dmuon.save_sharded(path, model, opt)
        dmuon.load_sharded(path, model, opt)
    return {k: v.detach().clone() for k, v in sd.items()}


# ----------------------------------------------------------------------- the users' loops
def _accum_no_sync_ckpt(model, opt, batches, env):
    """``dmuon.no_sync`` accumulation of 2 micro-batches; at step 1 the checkpoint round trip
    runs between them (pending local gradients must survive it)."""
    import contextlib
    mid = None
    for i, ids in enumerate(batches):
        opt.zero_grad()
        halves = ids.chunk(2)  # each half holds a slice for every rank
        for j, mb in enumerate(halves):
            ctx = contextlib.nullcontext()
            if env["dist"] and j == 0:
                import dmuon
                ctx = dmuon.no_sync(model)
            with ctx:
                _backward(model, mb, env, 0.5)
            if i == 1 and j == 0:
                mid = (_ckpt_roundtrip(model, opt, env, sharded=True) if env["dist"]
                       else {k: v.detach().clone() for k, v in model.state_dict().items()})
        opt.step()
    return mid


def _accum_fsdp_sync_ckpt(model, opt, batches, env):
    """FSDP2's ``set_requires_gradient_sync(False)`` accumulation, the round trip in between."""
    for i, ids in enumerate(batches):
        opt.zero_grad()
        halves = ids.chunk(2)
        for j, mb in enumerate(halves):
            if env["dist"]:
                model.set_requires_gradient_sync(j == 1)
            _backward(model, mb, env, 0.5)
            if i == 1 and j == 0 and env["dist"]:
                _ckpt_roundtrip(model, opt, env, sharded=False)
        opt.step()


def _rewind_then_lr(model, opt, batches, env):
    """Save after step 0, train step 1, load the step-0 state back (rewind), set new lrs, and
    train steps 1.. again under an ``LambdaLR`` made before the load."""
    import dmuon
    sch = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    lrs = []
    for i, ids in enumerate(batches):
        opt.zero_grad()
        _backward(model, ids, env)
        opt.step()
        sch.step()
        if i == 0 and env["dist"]:
            sd = dmuon.get_model_state_dict(model)
            osd = dmuon.get_optimizer_state_dict(model, opt)
            tsd = copy.deepcopy(opt.state_dict())  # torch's state_dict aliases live state
            sch_sd = sch.state_dict()
            opt.zero_grad()
            _backward(model, batches[1], env)  # a step that is then thrown away
            opt.step()
            sch.step()
            dmuon.set_model_state_dict(model, sd)
            dmuon.set_optimizer_state_dict(model, opt, osd)
            opt.load_state_dict(tsd)
            sch.load_state_dict(sch_sd)
        if i == 0:
            opt.param_groups[0]["lr"] = 0.05
            opt.param_groups[1]["lr"] = 1e-2
            sch.base_lrs = [0.05, 1e-2]
        lrs.append([g["lr"] for g in opt.param_groups])
    return lrs


def _clip(norm_type, skip=lambda i: frozenset(), max_norm=0.05):
    def loop(model, opt, batches, env):
        import dmuon
        norms = []
        for i, ids in enumerate(batches):
            opt.zero_grad()
            _backward(model, ids, env, skip_on=skip(i))
            if env["dist"]:
                n = dmuon.clip_grad_norm_(model, max_norm, norm_type=norm_type)
            else:
                n = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm,
                                                   norm_type=norm_type)
            norms.append(float(n))
            opt.step()
        return norms
    return loop


def _zero_between(set_to_none, skip_rank, then_backward=True):
    """A batch thrown away by ``model.zero_grad(set_to_none=...)`` after its backward, in which
    ``in_proj`` had a gradient on one rank only (``skip_rank`` skips it), then (``then_backward``)
    the real batch's backward, then the step. Without the real backward, the zeroed gradients
    reach the step: zeros (``set_to_none=False``: every param steps with a zero gradient) or none
    (skipped)."""
    def loop(model, opt, batches, env):
        for i, ids in enumerate(batches):
            opt.zero_grad()
            _backward(model, batches[(i + 1) % len(batches)], env, skip_on=frozenset({skip_rank}))
            model.zero_grad(set_to_none=set_to_none)
            if then_backward or i == 0:
                _backward(model, ids, env)
            opt.step()
    return loop


PATHS = {
    "accum_no_sync_ckpt": (make_model, _accum_no_sync_ckpt, {}),
    "accum_no_sync_ckpt_z2": (make_model, _accum_no_sync_ckpt, {"z3": False}),
    "accum_fsdp_sync_ckpt": (make_model, _accum_fsdp_sync_ckpt, {}),
    "rewind_then_lr": (make_model, _rewind_then_lr, {}),
    "clip_2": (_skip_model, _clip(2.0), {}),
    "clip_1": (_skip_model, _clip(1.0), {}),
    "clip_inf": (_skip_model, _clip(float("inf")), {}),
    # in_proj has a gradient on rank 1 only in step 0, on no rank in step 1
    "clip_2_skip": (_skip_model, _clip(2.0, lambda i: [frozenset({0}), frozenset({0, 1}),
                                                        frozenset()][i]), {}),
    "clip_inf_skip": (_skip_model, _clip(float("inf"), lambda i: [frozenset({1}),
                                                                  frozenset({0, 1}),
                                                                  frozenset()][i]), {}),
    # the owner of in_proj is one of the two ranks: each variant has a rank without its gradient
    **{f"zero_between_{z}_{k}": (_skip_model, _zero_between(z == "none", k), {})
       for z in ("none", "false") for k in (0, 1)},
    **{f"zero_before_step_{z}": (_skip_model, _zero_between(z == "none", 0, False), {})
       for z in ("none", "false")},
}


def _nonfinite_errors(rank, world):
    """``clip_grad_norm_(..., error_if_nonfinite=True)`` with a NaN in rank 1's shard of one FSDP2
    gradient only: every rank must raise (none may go on to the step)."""
    import dmuon
    out = {}
    for norm_type, bad in ((2.0, "nan"), (float("inf"), "nan"), (float("inf"), "inf")):
        for where in ("fsdp", "dedicated"):
            model = _skip_model()
            model, opt = build_dmuon(rank, world, model, model.layers, {})
            env = dict(rank=rank, dist=True)
            opt.zero_grad()
            _backward(model, make_batches(1, BATCH)[0], env)
            if rank == 1:
                with torch.no_grad():
                    if where == "fsdp":
                        model.norm.weight.grad.to_local()[0] = float(bad)
                    else:  # a dedicated matrix's reduced gradient on its owner
                        rt = opt.dedicated_state
                        g = next(g for g in rt.reduced_grads().values() if g is not None)
                        g.view(-1)[0] = float(bad)
            key = f"{where}_{norm_type}_{bad}"
            out[key] = catch(lambda: dmuon.clip_grad_norm_(model, 1.0, norm_type=norm_type,
                                                           error_if_nonfinite=True))
    # orders torch.nn.utils.clip_grad_norm_ gives another meaning (-inf: the smallest entry)
    for norm_type in (float("-inf"), 0.0):
        out[f"order_{norm_type}"] = catch(lambda: dmuon.clip_grad_norm_(model, 1.0,
                                                                         norm_type=norm_type))
    return out


def _worker(rank, world, tmp):
    import dmuon
    torch.set_num_threads(1)
    out = {}
    for key, (make, loop, cfg) in PATHS.items():
        model = make()
        model, opt = build_dmuon(rank, world, model, model.layers, cfg)
        try:
            extra = loop(model, opt, make_batches(STEPS, BATCH),
                         dict(rank=rank, world=world, dist=True, tmp=tmp))
        except Exception as e:  # noqa: BLE001 - reported per path
            out[key] = {"error": f"{type(e).__name__}: {e}"}
            continue
        out[key] = {"sd": dmuon.get_model_state_dict(model, cpu_offload=True), "extra": extra}
    out["nonfinite"] = _nonfinite_errors(rank, world)
    return out


def _reference(key):
    make, loop, _ = PATHS[key]
    return reference_run(make, loop, STEPS, BATCH)


def _diff(a, b):
    return max(float((a[k] - v).abs().max()) for k, v in b.items())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_worker, WORLD, str(tmp_path_factory.mktemp("ckpt")), timeout=180)


def _check(results, key):
    ref = _reference(key)
    assert_state_equal(results, key, ref)
    return ref


@pytest.mark.parametrize("key", ["accum_no_sync_ckpt", "accum_no_sync_ckpt_z2",
                                 "accum_fsdp_sync_ckpt"])
def test_checkpoint_between_accumulated_backwards_equals_one_process(results, key):
    ref = _check(results, key)
    if ref["extra"] is not None:  # the dict taken mid-accumulation: the weights after step 0
        for r in results:
            assert _diff(r[key]["extra"], ref["extra"]) <= TOL


def test_rewind_to_a_checkpoint_then_new_lr_equals_one_process(results):
    ref = _check(results, "rewind_then_lr")
    assert all(r["rewind_then_lr"]["extra"] == ref["extra"] for r in results)


@pytest.mark.parametrize("key", ["clip_2", "clip_1", "clip_inf", "clip_2_skip", "clip_inf_skip"])
def test_clip_grad_norm_equals_torch_one_process(results, key):
    ref = _check(results, key)
    for r in results:
        assert max(abs(a - b) for a, b in zip(r[key]["extra"], ref["extra"])) <= TOL


@pytest.mark.parametrize("where", ["fsdp", "dedicated"])
@pytest.mark.parametrize("norm_type,bad", [(2.0, "nan"), (float("inf"), "nan"),
                                           (float("inf"), "inf")])
def test_clip_nonfinite_on_one_rank_raises_on_every_rank(results, where, norm_type, bad):
    for rank, r in enumerate(results):
        kind, msg = r["nonfinite"][f"{where}_{norm_type}_{bad}"]
        assert kind == "RuntimeError" and "non-finite" in msg, (rank, kind, msg)


@pytest.mark.parametrize("norm_type", [float("-inf"), 0.0])
def test_clip_refuses_orders_it_does_not_compute(results, norm_type):
    for rank, r in enumerate(results):
        kind, msg = r["nonfinite"][f"order_{norm_type}"]
        assert kind == "ValueError" and "norm_type" in msg, (rank, kind, msg)


@pytest.mark.parametrize("key", [f"zero_between_{z}_{k}" for z in ("none", "false")
                                 for k in (0, 1)])
def test_model_zero_grad_between_backward_and_step_equals_one_process(results, key):
    """``model.zero_grad()`` after a backward drops that backward's gradients also on the owner of
    a matrix that had none itself (its reduced gradient held no ``.grad`` marker to drop)."""
    _check(results, key)


@pytest.mark.parametrize("key", ["zero_before_step_none", "zero_before_step_false"])
def test_model_zero_grad_right_before_step_equals_one_process(results, key):
    """Zeroed right before the step: ``set_to_none=False`` steps every matrix with a zero gradient
    (momentum and weight decay act), ``set_to_none=True`` skips them, as torch."""
    _check(results, key)
