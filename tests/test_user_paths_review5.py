"""Users' paths, fifth round (2 gloo ranks, fp64, 3 steps; slow tier: one spawn): each equal to
the same loop on one process with ``RefMuon`` to <= 1e-10, or a clear error on every rank.

Paths: an evaluation under ``torch.inference_mode()`` before the first training step (Lightning's
sanity-check validation runs under it by default; an ``eval_on_start``), on a model whose
FSDP2 params do not gather before dmuon's first hook group (here: every param is a Muon matrix);
``model.load_state_dict(sd, assign=True)`` after ``dmuon.Muon`` was built; gradient accumulation
whose last micro-batch runs inside ``dmuon.no_sync``; a micro-batch backwarded inside
``dmuon.no_sync`` and thrown away by ``opt.zero_grad()``, ``model.zero_grad()`` or ``p.grad = None``
on one matrix.

``model.zero_grad()`` (``set_to_none`` either way) or ``p.grad = None`` on one matrix after a
``dmuon.no_sync`` backward on a group kept gathered across it (every group in Z2, the root group in
Z3), also where a rank's matrix got no gradient in that micro-batch. Before: such a group's
matrices were full tensors, not placeholders, and showed no ``.grad`` marker (markers were
zero-size, for placeholders only; torch refuses a ``.grad`` of another shape): the local gradient
was held by dmuon alone, ``model.zero_grad()`` saw ``grad is None`` and the next synced backward
added the thrown-away gradient (8.5e-3 after 3 steps in Z2, 8.6e-3 in Z3 through the root group's
``out_proj``). Now they show a marker of their own shape with zero strides.
FSDP2's own params keep the gap in torch 2.13: plain FSDP2 + ``torch.optim`` adds a micro-batch
backwarded under ``set_requires_gradient_sync(False)`` to its next reduce-scatter whatever zeroes
the grads (``model.zero_grad()`` with or without ``set_to_none``, ``optimizer.zero_grad()``; Z2 and
Z3: 1.3e-2 after 3 steps), since it holds them on its unsharded params; ``dmuon.Muon.zero_grad``
drops them, ``model.zero_grad()`` does not (hence the paths above use a model of dedicated
matrices only; ``discard_no_sync_fsdp_z2`` checks that dmuon's matrices are exact beside them).

Before the fixes (measured): the first forward, under ``inference_mode``, built dmuon's gather
buffers as inference tensors; the next training forward's gather raised on the owner ("Inplace
update to inference tensor outside InferenceMode") while the other rank waited in the broadcast
until dmuon's timeout (FSDP2's own params have the same limit in torch 2.13: its buffers built
under ``inference_mode`` raise on every rank; a model with FSDP2 params at its root raises that
error first). ``load_state_dict(sd, assign=True)`` after ``dmuon.Muon`` was accepted: the FSDP2
params became new objects its AdamW group does not hold (frozen, silently, as with torch.optim)
while the matrices trained on (6.1e-3 from the uninterrupted run); now it raises on every rank.
A last micro-batch inside ``no_sync`` was left out of the step, silently (3.1e-2); now the step
raises on every rank and the gradients stay for a synced backward. ``opt.zero_grad()`` after a
``no_sync`` backward left FSDP2's unreduced gradients for its next reduce-scatter (8.9e-3); now
``Muon.zero_grad`` drops them too.
"""
from __future__ import annotations

import datetime

import pytest
import torch
import torch.nn as nn
from dist_utils import catch, run_each, run_ranks
from models import muon_predicate
from stateful_harness import build_dmuon
from user_paths_harness import RefMuon, check_path, max_abs_diff

STEPS, BATCH, WORLD = 3, 4, 2


class _Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.up_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x, skip=False):  # skip: its matrix (gathered all the same) gets no gradient
        return x * 1 if skip else x + torch.tanh(self.up_proj(x))  # (a new tensor: see the doc)


class AllMatrices(nn.Module):
    """Every param a Muon matrix: FSDP2 gathers nothing, dmuon's hooks run first."""

    def __init__(self, dim=8, n=2):
        super().__init__()
        self.layers = nn.ModuleList(_Block(dim) for _ in range(n))
        self.out_proj = nn.Linear(dim, dim, bias=False)
        self.skip: tuple[int, ...] = ()  # the layers whose matrix this forward leaves out

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x, i in self.skip)
        return (self.out_proj(x) ** 2).mean()


def _all_matrices():
    torch.manual_seed(0)
    return AllMatrices().double()


def _data():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(BATCH, 8, generator=g, dtype=torch.float64) for _ in range(STEPS)]


def _llama(env, cfg):
    """The tests' small Llama and its optimizer: dmuon's on the ranks (``cfg`` as
    :func:`build_dmuon`'s), the one-process reference otherwise."""
    from models import make_model
    model = make_model()
    if env["dist"]:
        return build_dmuon(env["rank"], env["world"], model, model.layers, cfg)
    return model, RefMuon(model)


def _full_sd(model, env):
    import dmuon
    if env["dist"]:
        return dmuon.get_model_state_dict(model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _inference_first(cfg):
    """An evaluation under ``torch.inference_mode()`` before each training step, the first one
    before any training forward."""
    def path(env):
        import dmuon
        model = _all_matrices()
        if env["dist"]:
            model, opt = build_dmuon(env["rank"], env["world"], model, model.layers,
                                     {**cfg, "predicate": lambda n, p: p.ndim == 2},
                                     options=dmuon.DedicateOptions(
                                         timeout=datetime.timedelta(seconds=10)))
        else:
            opt = RefMuon(model, lambda n, p: p.ndim == 2)
        val = torch.ones(2, 8, dtype=torch.float64)
        losses = []
        for x in _data():
            with torch.inference_mode():
                losses.append(float(model(val)))
            opt.zero_grad()
            ranks = [env["rank"]] if env["dist"] else range(WORLD)
            for r in ranks:
                (model(x.chunk(WORLD)[r]) / (1 if env["dist"] else WORLD)).backward()
            opt.step()
        return {"sd": _full_sd(model, env), "extra": losses}
    return path


def _assign_mid(env):
    """``model.load_state_dict(sd, assign=True)`` after ``dmuon.Muon`` was built (step 1; the
    model's own weights), then, refused or not, ``load_state_dict(sd)`` and training on. torch
    replaces the params by the dict's tensors, so an optimizer built before holds the old ones and
    silently stops updating the model; dmuon must refuse it on every rank, changing nothing (the
    run then equals the uninterrupted one)."""
    from models import make_batches
    model, opt = _llama(env, {})
    refused = None
    for i, ids in enumerate(make_batches(STEPS, BATCH)):
        if i == 1 and env["dist"]:
            sd = _full_sd(model, env)
            refused = catch(lambda: model.load_state_dict(
                {k: v.clone() for k, v in sd.items()}, assign=True))
            unchanged = max_abs_diff(_full_sd(model, env), sd) == 0.0
            model.load_state_dict(sd)
            refused = (*refused, unchanged)
        opt.zero_grad()
        ranks = [env["rank"]] if env["dist"] else range(WORLD)
        for r in ranks:
            (model(ids.chunk(WORLD)[r]) / (1 if env["dist"] else WORLD)).backward()
        opt.step()
    return {"sd": _full_sd(model, env), "extra": [], "refused": refused}


def _no_sync_last(cfg):
    """Gradient accumulation written the other way round: the first micro-batch synced, the
    last one inside ``dmuon.no_sync``, then ``step()``: the last micro-batch's gradients were never
    reduced. The step must raise on every rank and change nothing; the loop then runs one more
    micro-batch outside ``no_sync`` (which reduces all three) and steps, then trains on in the
    recipe's order (no_sync first): equal to one process."""
    def path(env):
        import contextlib
        from models import make_batches
        model, opt = _llama(env, cfg)
        ranks = [env["rank"]] if env["dist"] else range(WORLD)

        def backward(ids, no_sync):
            import dmuon
            ctx = dmuon.no_sync(model) if env["dist"] and no_sync else contextlib.nullcontext()
            with ctx:
                for r in ranks:
                    (0.5 * model(ids.chunk(WORLD)[r]) / (1 if env["dist"] else WORLD)).backward()
        before = _full_sd(model, env)
        first, last, extra = make_batches(3, BATCH, seed=7)
        backward(first, False)
        backward(last, True)
        refused = catch(opt.step) if env["dist"] else None
        refused = refused and (*refused, max_abs_diff(_full_sd(model, env), before) == 0.0)
        backward(extra, False)
        opt.step()
        for ids in make_batches(STEPS, BATCH):
            opt.zero_grad()
            for j, half in enumerate(ids.chunk(2)):
                backward(half, j == 0)
            opt.step()
        return {"sd": _full_sd(model, env), "extra": [], "refused": refused}
    return path


def _discard_no_sync(cfg, zero, all_matrices=False, skip=False):
    """A micro-batch backwarded inside ``dmuon.no_sync`` and thrown away before each step's
    (``zero``: ``opt`` for ``opt.zero_grad()``, ``model`` for ``model.zero_grad()``, ``keep`` for
    ``model.zero_grad(set_to_none=False)``, ``one`` for ``p.grad = None`` on ``layers.0``'s matrix
    only: the others' gradients of that micro-batch count; ``fsdp``: ``model.zero_grad()``, which
    on one process drops the dedicated matrices' gradients only, as FSDP2 keeps its params' in
    torch 2.13: see the module doc), then the step's own batch: its
    gradients must be gone, as a single-device ``zero_grad`` drops them (``all_matrices``: the
    model of :class:`AllMatrices`, every param dedicated; ``skip``: in step ``i``'s thrown-away
    micro-batch, ``layers.1``'s matrix gets no gradient on rank ``i % 2``: owner and not)."""
    def path(env):
        import contextlib

        import dmuon
        from models import make_batches, make_model
        pred = (lambda n, p: p.ndim == 2) if all_matrices else None
        model = _all_matrices() if all_matrices else make_model()
        if env["dist"]:
            model, opt = build_dmuon(env["rank"], env["world"], model, model.layers,
                                     {**cfg, **({"predicate": pred} if pred else {})})
        else:
            opt = RefMuon(model, pred) if pred else RefMuon(model)
        ranks = [env["rank"]] if env["dist"] else range(WORLD)
        scale = 1 if env["dist"] else WORLD
        data = _data() if all_matrices else make_batches(STEPS, BATCH)
        for i, x in enumerate(data):
            if zero in ("one", "fsdp"):  # (the others drop every gradient before the step's)
                opt.zero_grad()
            with dmuon.no_sync(model) if env["dist"] else contextlib.nullcontext():
                for r in ranks:
                    model.skip = (1,) if skip and r == i % WORLD else ()
                    (model(data[(i + 1) % STEPS].chunk(WORLD)[r].flip(0)) / scale).backward()
                model.skip = ()
            if zero == "one":
                model.layers[0].up_proj.weight.grad = None
            elif zero == "fsdp" and not env["dist"]:  # torch 2.13's FSDP2: its params keep theirs
                for n, p in model.named_parameters():
                    p.grad = None if muon_predicate(n, p) else p.grad
            else:
                (opt if zero == "opt" else model).zero_grad(**({"set_to_none": False}
                                                               if zero == "keep" else {}))
            for r in ranks:
                (model(x.chunk(WORLD)[r]) / scale).backward()
            opt.step()
        return {"sd": _full_sd(model, env), "extra": []}
    return path


def _missing_mid(env):
    """``model.load_state_dict(sd)`` (strict) at step 1 with a dict that lacks one key, every
    entry else shifted by 1 (a partial load would show): a dedicated matrix's on every rank, an
    FSDP2 param's on rank 1 only, a dedicated one's on rank 0 only; or that has one key more,
    under a block on every rank, at the top on rank 0 only. torch loads every other entry and
    raises at the end (on the ranks whose dict is so; plain FSDP2 too); dmuon must refuse on
    every rank, changing nothing. ``strict=False`` loads the rest and names the key, as
    torch does. Then the model's own dict is loaded and training goes on (the uninterrupted run)."""
    from models import make_batches
    model, opt = _llama(env, {})
    refused, loose = [], None
    for i, ids in enumerate(make_batches(STEPS, BATCH)):
        if i == 1 and env["dist"]:
            sd = _full_sd(model, env)
            for gone, ranks in (("layers.0.self_attn.q_proj.weight", (0, 1)), ("norm.weight", (1,)),
                                ("layers.1.mlp.up_proj.weight", (0,)),  # an extra key instead:
                                ("layers.0.mlp.extra.weight", (0, 1)), ("extra_head", (0,))):
                bad = {k: v + 1 for k, v in sd.items() if k != gone or env["rank"] not in ranks}
                if "extra" in gone and env["rank"] in ranks:
                    bad[gone] = torch.ones(2, dtype=torch.float64)
                kind, msg = catch(lambda: model.load_state_dict(bad))
                refused.append((kind, msg, gone, max_abs_diff(_full_sd(model, env), sd) == 0.0))
            res = model.load_state_dict({k: v for k, v in sd.items() if k != "norm.weight"},
                                        strict=False)
            loose = list(res.missing_keys)
            model.load_state_dict(sd)
        opt.zero_grad()
        ranks = [env["rank"]] if env["dist"] else range(WORLD)
        for r in ranks:
            (model(ids.chunk(WORLD)[r]) / (1 if env["dist"] else WORLD)).backward()
        opt.step()
    return {"sd": _full_sd(model, env), "extra": [], "refused": refused, "loose": loose}


def _discard_fsdp_knob(cfg, knob="gradient_sync"):
    """A micro-batch backwarded with FSDP2's own accumulation knob
    (``model.set_requires_gradient_sync(False)``, not ``dmuon.no_sync``; ``knob="all_reduce"``:
    ``set_requires_all_reduce(False)`` + ``set_is_last_backward(False)`` on HSDP), thrown away by
    ``optimizer.zero_grad()``, then the step's own micro-batch: a single-device ``zero_grad``
    drops it. FSDP2 keeps its params' share of it on their unsharded params, out of the sharded
    ``.grad``'s reach, and adds it to its next reduce-scatter (plain FSDP2 + AdamW: off by
    6.0e-3 after one step; a user-path review, session 14); ``dmuon.Muon.zero_grad`` drops it."""
    def path(env):
        from models import make_batches
        model, opt = _llama(env, cfg)
        ranks = [env["rank"]] if env["dist"] else range(WORLD)
        scale = 1 if env["dist"] else WORLD
        data = make_batches(STEPS, BATCH)
        for i, x in enumerate(data):
            opt.zero_grad()
            if env["dist"]:
                setting = (lambda on: (model.set_requires_all_reduce(on),
                                       model.set_is_last_backward(on))) if knob == "all_reduce" \
                    else model.set_requires_gradient_sync
                setting(False)
                model(data[(i + 1) % STEPS].chunk(WORLD)[env["rank"]].flip(0)).backward()
                setting(True)
                opt.zero_grad()  # the micro-batch is thrown away
            for r in ranks:
                (model(x.chunk(WORLD)[r]) / scale).backward()
            opt.step()
        return {"sd": _full_sd(model, env), "extra": []}
    return path


PATHS = {
    "inference_first": _inference_first({}),
    "inference_first_z2": _inference_first({"z3": False}),
    "assign_mid": _assign_mid,
    "missing_mid": _missing_mid,
    "no_sync_last": _no_sync_last({}),
    "no_sync_last_z2": _no_sync_last({"z3": False}),
    "discard_no_sync": _discard_no_sync({}, "opt"),
    "discard_no_sync_z2": _discard_no_sync({"z3": False}, "opt"),
    "discard_no_sync_model_z2": _discard_no_sync({"z3": False}, "model", all_matrices=True),
    "discard_no_sync_model_z2_skip": _discard_no_sync({"z3": False}, "model", True, skip=True),
    "discard_no_sync_keep_z2_skip": _discard_no_sync({"z3": False}, "keep", True, skip=True),
    "discard_no_sync_one_z2_skip": _discard_no_sync({"z3": False}, "one", True, skip=True),
    "discard_no_sync_model_z3_skip": _discard_no_sync({}, "model", True, skip=True),
    "discard_no_sync_fsdp_z2": _discard_no_sync({"z3": False}, "fsdp"),
    "discard_fsdp_knob": _discard_fsdp_knob({}),
    "discard_fsdp_knob_z2": _discard_fsdp_knob({"z3": False}),
    "discard_fsdp_all_reduce_hsdp": _discard_fsdp_knob({"hsdp": True}, "all_reduce"),
}


def _worker(rank, world):
    torch.set_num_threads(1)
    return run_each(PATHS, dict(rank=rank, world=world, dist=True))


@pytest.fixture(scope="module")
def results():
    return run_ranks(_worker, WORLD, timeout=120)


def _check(results, key):
    return check_path(results, PATHS, key)


@pytest.mark.slow
@pytest.mark.parametrize("key", ["inference_first", "inference_first_z2"])
def test_inference_mode_before_the_first_step_equals_one_process(results, key):
    _check(results, key)


@pytest.mark.slow
def test_load_with_assign_after_the_optimizer_raises_on_every_rank(results):
    _check(results, "assign_mid")  # the retried plain load: the uninterrupted run
    for rank, r in enumerate(results):
        kind, msg, unchanged = r["assign_mid"]["refused"]
        assert kind == "StateDictError" and "assign=True" in msg, (rank, kind, msg)
        assert unchanged, rank


@pytest.mark.slow
def test_strict_load_missing_or_extra_key_on_any_rank_raises_on_every_rank_changing_nothing(
        results):
    _check(results, "missing_mid")  # the model's own dict loaded after: the uninterrupted run
    for rank, r in enumerate(results):
        for kind, msg, gone, unchanged in r["missing_mid"]["refused"]:
            word = "not an entry of this model" if "extra" in gone else "missing"
            assert kind == "StateDictError" and gone in msg and word in msg, (rank, msg)
            assert unchanged, (rank, gone)
        assert r["missing_mid"]["loose"] == ["norm.weight"], rank  # strict=False: torch's result


@pytest.mark.slow
@pytest.mark.parametrize("key", ["no_sync_last", "no_sync_last_z2"])
def test_step_after_a_last_micro_batch_inside_no_sync_raises_on_every_rank(results, key):
    for rank, r in enumerate(results):
        assert "error" not in r[key], (rank, r[key]["error"])
        kind, msg, unchanged = r[key]["refused"]
        assert kind == "RuntimeError" and "dmuon.no_sync" in msg, (rank, kind, msg)
        assert unchanged, rank
    _check(results, key)  # then the recipe's order equals one process


@pytest.mark.slow
@pytest.mark.parametrize("key", ["discard_no_sync", "discard_no_sync_z2"])
def test_zero_grad_drops_a_micro_batch_backwarded_inside_no_sync(results, key):
    _check(results, key)


@pytest.mark.slow
@pytest.mark.parametrize("key", ["discard_no_sync_model_z2", "discard_no_sync_model_z2_skip",
                                 "discard_no_sync_keep_z2_skip", "discard_no_sync_one_z2_skip"])
def test_model_zero_grad_drops_a_z2_micro_batch_backwarded_inside_no_sync(results, key):
    _check(results, key)


@pytest.mark.slow
@pytest.mark.parametrize("key", ["discard_fsdp_knob", "discard_fsdp_knob_z2",
                                 "discard_fsdp_all_reduce_hsdp"])
def test_zero_grad_drops_a_micro_batch_backwarded_with_fsdp2s_own_sync_knob_off(results, key):
    _check(results, key)


@pytest.mark.slow
def test_model_zero_grad_drops_a_z3_root_group_micro_batch_backwarded_inside_no_sync(results):
    _check(results, "discard_no_sync_model_z3_skip")  # out_proj: in the root group (always Z2)


@pytest.mark.slow
def test_model_zero_grad_after_no_sync_drops_dmuons_gradients_and_fsdp2_keeps_its_own(results):
    """FSDP2 + ``model.zero_grad()``: dmuon's matrices drop the micro-batch, FSDP2's params keep it
    (torch 2.13; the reference does the same, so this fails if either changes: then update
    docs/reliability.md)."""
    _check(results, "discard_no_sync_fsdp_z2")
