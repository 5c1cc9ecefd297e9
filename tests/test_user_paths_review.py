"""Users' torch idioms on a dmuon model (2 gloo ranks, fp64, 3 steps), each equal to the same
loop on one process with a single-device twin of ``dmuon.Muon`` (``user_paths_harness.RefMuon``: the same two param
groups, read at every step; functional Muon with fp64 NS + functional AdamW) to <= 1e-10.

Paths: ``param_groups`` hyper-parameters changed between steps (momentum, weight decay, Nesterov,
NS steps, lr scale, betas, eps, lr); ``SequentialLR`` and ``OneCycleLR(cycle_momentum=False)``;
``step(closure)``; two backward passes of one forward (``retain_graph=True``); gradient
accumulation through FSDP2's own ``set_requires_gradient_sync(False)`` (not ``dmuon.no_sync``); a
grad-enabled forward that is never backwarded; and a block called twice per forward under
reentrant activation checkpointing (its weights get one gradient per checkpoint segment).

Before the fix (measured): with that reused block under ``use_reentrant=True`` the second
segment's gradients of its dedicated matrices arrived after their reduce had been launched and
were dropped; the weights differed from one process by up to 1.4e-2 after 3 steps, no error.
Now a hook group called more than once in a forward reduces at the end of backward, and a
gradient that still arrives after its group's reduce raises (deferral removed: both ranks raise).
Also before (measured): after ``opt.zero_grad(set_to_none=False)``, a matrix no rank used in a step
was skipped (``None``) where torch steps it with its zero gradient (1.2e-2 after 3 steps); now
after each step the owners' stepped matrices carry consumed ``.grad`` markers
(``dmuon.stateful.runtime.ledger``): zeroing one (``opt.zero_grad`` or ``model.zero_grad`` with
``set_to_none=False``) makes a matrix without a new gradient step with zeros, dropping one skips it,
and a matrix that never had a gradient stays skipped, as torch leaves its ``grad`` ``None``. (Two
earlier versions, a flag set by ``Muon.zero_grad``, zeroed matrices that never had a gradient, and
then ones ``model.zero_grad()`` had set to ``None``: both measured wrong here.)
(FSDP2 itself drops them the same way for a ``fully_shard`` module reused under reentrant
checkpointing, so the reused block here is not ``fully_shard``-ed: its norms are the root's.)
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_utils import catch, run_ranks
from models import TinyLlama, make_batches, make_model, muon_predicate
from stateful_harness import build_dmuon
from user_paths_harness import assert_state_equal, reference_run

STEPS, BATCH = 3, 4


def _reuse_model():
    # layers.0 runs twice per forward, each call in its own reentrant checkpoint
    m = TinyLlama(checkpointing="reentrant", reuse_first=True)
    m.load_state_dict(make_model().state_dict())
    return m.double()


# ----------------------------------------------------------------------- the users' loops
def _local(ids, env):
    return ids.chunk(env["world"])[env["rank"]]


def _hparams(model, opt, batches, env):
    for i, ids in enumerate(batches):
        opt.zero_grad()
        model(_local(ids, env)).backward()
        opt.step()
        g0, g1 = opt.param_groups
        if i == 0:
            g0.update(momentum=0.8, weight_decay=0.1)
            g1.update(betas=(0.7, 0.9), weight_decay=0.3, eps=1e-3)
        if i == 1:
            g0.update(nesterov=False, ns_steps=3, lr_scale="jordan")
            g1["lr"] = 1e-2


def _schedulers(model, opt, batches, env):
    sch = torch.optim.lr_scheduler
    seq = sch.SequentialLR(opt, [sch.LinearLR(opt, start_factor=0.5, total_iters=1),
                                 sch.CosineAnnealingLR(opt, T_max=3)], milestones=[1])
    one = sch.OneCycleLR(opt, max_lr=[0.03, 4e-3], total_steps=2 * len(batches),
                         cycle_momentum=False)
    lrs = []
    for ids in batches:
        opt.zero_grad()
        model(_local(ids, env)).backward()
        opt.step()
        seq.step()
        one.step()
        lrs.append([g["lr"] for g in opt.param_groups])
    return lrs


def _closure(model, opt, batches, env):
    losses = []
    for ids in batches:
        def closure():
            opt.zero_grad()
            loss = model(_local(ids, env))
            loss.backward()
            return loss
        losses.append(float(opt.step(closure).detach()))
    return losses


def _retain_graph(model, opt, batches, env):
    for ids in batches:
        opt.zero_grad()
        loss = model(_local(ids, env))
        loss.backward(retain_graph=True)
        (0.5 * loss).backward()
        opt.step()


def _fsdp_accumulation(model, opt, batches, env):
    for ids in batches:
        opt.zero_grad()
        micro = _local(ids, env).chunk(2)
        for i, mb in enumerate(micro):
            if env["dist"]:
                model.set_requires_gradient_sync(i == len(micro) - 1)
            (model(mb) / len(micro)).backward()
        opt.step()


def _dangling_forward(model, opt, batches, env):
    for ids in batches:
        opt.zero_grad()
        model(_local(ids, env))  # grad-enabled, never backwarded
        model(_local(ids, env)).backward()
        opt.step()


class SkipLlama(TinyLlama):
    """``layers.1`` is skipped while ``self.skip`` is set (no rank gets a gradient for it)."""

    skip = False

    def forward(self, ids):
        x = self.embed_tokens(ids[:, :-1])
        for i, layer in enumerate(self.layers):
            if not (self.skip and i == 1):
                x = layer(x)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _skip_model():
    m = SkipLlama()
    m.load_state_dict(make_model().state_dict())
    return m.double()


def _zero_not_none_skip(model, opt, batches, env):
    """``zero_grad(set_to_none=False)``: a matrix no rank used in step 1 has a zero gradient in
    torch (Muon still applies momentum and weight decay to it), not ``None``."""
    for i, ids in enumerate(batches):
        opt.zero_grad(set_to_none=False)
        model.skip = i == 1
        model(_local(ids, env)).backward()
        opt.step()


def _zero_not_none_first_skip(model, opt, batches, env):
    """``zero_grad(set_to_none=False)`` before any gradient: a matrix no rank used in step 0 still
    has ``grad None`` in torch (zeroing leaves a missing gradient missing), so it is skipped."""
    for i, ids in enumerate(batches):
        opt.zero_grad(set_to_none=False)
        model.skip = i == 0
        model(_local(ids, env)).backward()
        opt.step()


def _model_zero_not_none_skip(model, opt, batches, env):
    """``model.zero_grad(set_to_none=False)`` (the module's, not the optimizer's): the same torch
    semantics as ``opt.zero_grad(set_to_none=False)``, a matrix no rank used in step 1 has a zero
    gradient."""
    for i, ids in enumerate(batches):
        model.zero_grad(set_to_none=False)
        model.skip = i == 1
        model(_local(ids, env)).backward()
        opt.step()


def _model_zero_then_none_skip(model, opt, batches, env):
    """``model.zero_grad(set_to_none=False)`` then ``model.zero_grad()``: the gradients are gone
    (``None``), so a matrix no rank uses in that step is skipped. (The last step: FSDP2 zero-fills
    the skipped layer's norms' gradients where torch has ``None``, which would move every later
    forward; only the matrices are compared.)"""
    last = len(batches) - 1
    for i, ids in enumerate(batches):
        model.zero_grad(set_to_none=False)
        if i == last:
            model.zero_grad()
        model.skip = i == last
        model(_local(ids, env)).backward()
        opt.step()


def _none_then_opt_not_none_skip(model, opt, batches, env):
    """``model.zero_grad()`` then ``opt.zero_grad(set_to_none=False)``: the first leaves ``None``,
    which the second does not turn into zeros, so a matrix no rank uses in that step is skipped."""
    last = len(batches) - 1
    for i, ids in enumerate(batches):
        if i == last:
            model.zero_grad()
        opt.zero_grad(set_to_none=False)
        model.skip = i == last
        model(_local(ids, env)).backward()
        opt.step()


def _plain(model, opt, batches, env):
    for ids in batches:
        opt.zero_grad()
        model(_local(ids, env)).backward()
        opt.step()


PATHS = {"hparams": (make_model, _hparams, None), "schedulers": (make_model, _schedulers, None),
         "closure": (make_model, _closure, None), "retain_graph": (make_model, _retain_graph, None),
         "fsdp_accumulation": (make_model, _fsdp_accumulation, None),
         "dangling_forward": (make_model, _dangling_forward, None),
         # the reused block is not fully_shard-ed (FSDP2's own limit, see the module doc)
         "reuse_reentrant": (_reuse_model, _plain, lambda m: list(m.layers)[1:]),
         "zero_not_none_skip": (_skip_model, _zero_not_none_skip, None),
         "zero_not_none_first_skip": (_skip_model, _zero_not_none_first_skip, None),
         "model_zero_not_none_skip": (_skip_model, _model_zero_not_none_skip, None),
         "model_zero_then_none_skip": (_skip_model, _model_zero_then_none_skip, None),
         "none_then_opt_not_none_skip": (_skip_model, _none_then_opt_not_none_skip, None)}


def _worker(rank, world):
    import dmuon
    torch.set_num_threads(1)
    out = {}
    for key, (make, loop, blocks) in PATHS.items():
        model = make()
        model, opt = build_dmuon(rank, world, model,
                                 model.layers if blocks is None else blocks(model), {})
        extra = loop(model, opt, make_batches(STEPS, BATCH), dict(rank=rank, world=world,
                                                                  dist=True))
        out[key] = {"sd": dmuon.get_model_state_dict(model, cpu_offload=True), "extra": extra}
    # torch's own clip over model.parameters() after a step (e.g. to log a gradient norm): the
    # owners' consumed markers make it raise, as before a step, instead of a norm without them
    out["torch_clip_after_step"] = catch(
        lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    return out


def _reference(key):
    make, loop, _ = PATHS[key]
    return reference_run(make, loop, STEPS, BATCH)


@pytest.fixture(scope="module")
def results():
    return run_ranks(_worker, 2, timeout=120)


def _check(results, key, keys=None):
    ref = _reference(key)
    assert_state_equal(results, key, ref, keys)
    return ref


@pytest.mark.parametrize("key", ["hparams", "schedulers", "closure", "retain_graph",
                                 "fsdp_accumulation", "dangling_forward"])
def test_torch_idiom_equals_one_process(results, key):
    ref = _check(results, key)
    if key == "schedulers":
        assert all(r[key]["extra"] == ref["extra"] for r in results)
    if key == "closure":  # step(closure) returns the closure's (local) loss
        assert all(len(r[key]["extra"]) == STEPS for r in results)


def test_block_reused_under_reentrant_checkpointing_equals_one_process(results):
    _check(results, "reuse_reentrant")


def test_zero_grad_not_none_steps_an_unused_matrix_as_one_process(results):
    _check(results, "zero_not_none_skip")


def test_zero_grad_not_none_skips_a_matrix_that_never_had_a_gradient(results):
    # only the Muon matrices: FSDP2 itself zero-fills its unused params' gradients (the norms of
    # the skipped layer), which a single-device optimizer would skip (fsdp_info documents it)
    mats = {n for n, p in _skip_model().named_parameters() if muon_predicate(n, p)}
    _check(results, "zero_not_none_first_skip", keys=mats)


@pytest.mark.parametrize("key", ["model_zero_not_none_skip", "model_zero_then_none_skip",
                                 "none_then_opt_not_none_skip"])
def test_model_zero_grad_steps_an_unused_matrix_as_one_process(results, key):
    """dmuon's step consumes the owners' gradients; the consumed markers it leaves as ``.grad``
    (dmuon.stateful.runtime.ledger) carry what torch's kept ``.grad`` would: zeroed (step with a
    zero gradient) or dropped (skip)."""
    mats = {n for n, p in _skip_model().named_parameters() if muon_predicate(n, p)}
    _check(results, key, keys=mats)


def test_torch_clip_after_step_raises_on_every_rank(results):
    for rank, r in enumerate(results):
        kind, msg = r["torch_clip_after_step"]
        assert kind == "DedicatedParamError" and "dmuon.clip_grad_norm_" in msg, (rank, kind, msg)
