"""Three user edges at one rank, in one process (the default tier's cheap checks; the ranks are
threads of torch's multi-threaded process group, ``tests/threaded_world.py``): each path is exact
(equal to ``RefMuon`` on the plain model) or raises a clear dmuon error before anything changed.

- A hook-group module called directly (``model.layers[0](x)``) before the model's first forward.
  Before: ``AttributeError: ... '_group_forward_seen'`` (an internal flag not set yet). Now as
  plain FSDP2 in torch 2.13: the call, its backward and a step are exact, and the model's own
  forward after it raises FSDP2's "FSDP requires running forward through the root module first"
  (FSDP2's pre-forward hooks run before dmuon's and set the block up as its own root).
- A second backward from a tensor inside a block (not the block's output), right after a
  ``dmuon.no_sync`` backward on a group kept gathered (Z2), no forward between. Before: torch's
  in-place add into the zero-stride ``.grad`` marker raised "more than one element of the
  written-to tensor refers to a single memory location". The same from the model's output
  (``retain_graph``) was exact.
- A block that returns its input unchanged (the default tier's check of
  ``tests/test_block_returns_its_input.py``, where one rank of two does so): its group must be
  re-gathered before the earlier block's, in reverse forward order as on a rank whose block does
  not return its input. Before: torch ran the earlier block's hook first (one tensor's hooks run in
  the order they were registered).
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from stateful_harness import build_dmuon
from test_user_paths_review5 import AllMatrices
from threaded_world import run_threads
from user_paths_harness import TOL, RefMuon



def _model():
    torch.manual_seed(0)
    return AllMatrices().double()


def _x():
    return torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))



def _block_first(rank, world):
    import dmuon
    model = _model()
    if world:
        model, opt = build_dmuon(rank, world, model, model.layers,
                                 {"z3": True, "predicate": lambda n, p: p.ndim == 2})
    else:
        opt = RefMuon(model, lambda n, p: p.ndim == 2)
    model.layers[0](_x()).pow(2).sum().backward()
    opt.step()
    if not world:
        return model.state_dict(), None
    with pytest.raises(RuntimeError) as e:  # FSDP2's own refusal, as without dmuon
        model(_x())
    return dmuon.get_model_state_dict(model), str(e.value)


def test_a_block_called_before_the_models_first_forward_works_as_with_fsdp2():
    got, error = run_threads(_block_first, 1)[0]
    assert "FSDP requires running forward through the root module first" in error
    ref, _ = _block_first(0, 0)
    for k, v in ref.items():
        assert float((got[k] - v).abs().max()) <= TOL, k


def _second_backward(rank, world, start):
    """``start``: "inner" a tensor inside a Z2 block, "root" inside a Z3 model's root group (kept
    gathered across no_sync), "output" the loss (``retain_graph``)."""
    import dmuon
    model = _model()
    inner = []
    held = model.out_proj if start == "root" else model.layers[0].up_proj
    held.register_forward_hook(lambda m, a, out: inner.append(out))
    if world:
        model, opt = build_dmuon(rank, world, model, model.layers,
                                 {"z3": start == "root", "predicate": lambda n, p: p.ndim == 2})
    else:
        opt = RefMuon(model, lambda n, p: p.ndim == 2)
    loss = model(_x())
    with dmuon.no_sync(model) if world else torch.enable_grad():
        loss.backward(retain_graph=True)
    (loss if start == "output" else inner[0].pow(2).sum()).backward()
    opt.step()
    return dmuon.get_model_state_dict(model) if world else model.state_dict()


@pytest.mark.parametrize("start", ["inner", "root", "output"])
def test_a_second_backward_after_a_no_sync_backward_on_a_gathered_group(start):
    got = run_threads(_second_backward, 1, start)[0]
    ref = _second_backward(0, 0, start)
    for k, v in ref.items():
        assert float((got[k] - v).abs().max()) <= TOL, k


def _regather_order(rank, world):
    from dmuon.stateful.runtime.state import get_state
    from test_block_returns_its_input import _Model
    torch.manual_seed(0)
    model = _Model().double()
    model, _ = build_dmuon(rank, world, model, model.layers,
                           {"z3": True, "predicate": lambda n, p: p.ndim == 2})
    model(_x()).backward()  # the first forward fixes the order
    st, order = get_state(model), []
    unshard = st.unshard
    st.unshard = lambda key, regather=False, **kw: (order.append(key) if regather else None,
                                                      unshard(key, regather, **kw))
    model.layers[2].skip = True  # returns layers.1's output
    model(_x()).backward()
    return list(dict.fromkeys(order))


def test_a_block_returning_its_input_is_re_gathered_in_reverse_forward_order():
    assert run_threads(_regather_order, 1)[0] == ["", "layers.2", "layers.1", "layers.0"]


class _LayerDrop(AllMatrices):
    """LayerDrop: at the steps in ``drop_at``, ``layers.1`` is skipped on every rank (the model
    passes its input on; the block is not called)."""
    step, drop_at = 0, (1, 2)

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = x if (i == 1 and self.step in self.drop_at) else layer(x, False)
        return (self.out_proj(x) ** 2).mean()


def _built(rank, world, model, z3, hsdp=False):
    """``(model, dmuon.Muon)`` on ``world`` thread-ranks (every matrix dedicated; ``hsdp``: a
    2 x (world / 2) mesh), or ``(model, RefMuon)`` in one process (``world`` 0)."""
    if not world:
        return model, RefMuon(model, lambda n, p: p.ndim == 2)
    return build_dmuon(rank, world, model, model.layers,
                       {"z3": z3, "hsdp": hsdp, "predicate": lambda n, p: p.ndim == 2})


def _layer_drop(rank, world, template, z3):
    """Four steps from a copy of ``template`` (built once, outside the thread-ranks: they share
    torch's global RNG, so two ranks building at once drew interleaved weights)."""
    import copy

    import dmuon
    model, opt = _built(rank, world, copy.deepcopy(template), z3)
    g = torch.Generator().manual_seed(1)
    for model.step in range(4):
        x = torch.randn(4, 8, generator=g, dtype=torch.float64)
        for r in ([rank] if world else range(2)):  # one process: both ranks' halves, averaged
            (model(x.chunk(2)[r]) / (1 if world else 2)).backward()
        opt.step()
        opt.zero_grad()
    return dmuon.get_model_state_dict(model) if world else model.state_dict()


@pytest.mark.parametrize("z3", [True, False], ids=["z3", "z2"])
def test_a_block_skipped_on_every_rank_for_two_steps_equals_one_process(z3):
    """LayerDrop-style skipping on every rank (the block not called, its matrices without a
    gradient at those steps), 2 thread-ranks, Z3 and Z2: equal to ``RefMuon`` in one process."""
    torch.manual_seed(0)
    template = _LayerDrop().double()
    ref = _layer_drop(0, 0, template, z3)
    for got in run_threads(_layer_drop, 2, template, z3):
        assert max(float((got[k] - v).abs().max()) for k, v in ref.items()) <= TOL


class _ScaledBlock(torch.nn.Module):
    """A Muon matrix and an FSDP2 vector (AdamW) that only this block's forward reads."""

    def __init__(self, dim=8):
        super().__init__()
        self.up_proj = torch.nn.Linear(dim, dim, bias=False)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, dim))

    def forward(self, x, use_scale=True):
        y = torch.tanh(self.up_proj(x))
        return x + (y * self.scale if use_scale else y)


class _DropOnRanks(torch.nn.Module):
    """At the steps in ``drop_at``: ``layers.1`` skipped on every rank (``drop_on`` None), or
    called without reading its ``scale`` on the ranks in ``drop_on``; either way its FSDP2 vector
    ``scale`` gets no gradient there."""

    def __init__(self, n=3):
        super().__init__()
        self.layers = torch.nn.ModuleList(_ScaledBlock() for _ in range(n))
        self.out_proj = torch.nn.Linear(8, 8, bias=False)
        self.step, self.rank, self.drop_at, self.drop_on = 0, 0, (1, 2), None
        self.micro, self.drop_micro = 0, (0, 1)  # micro-batch index, those that drop
        self.ckpt = False  # each block under a non-reentrant activation checkpoint

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        now = self.step in self.drop_at and self.micro in self.drop_micro
        for i, layer in enumerate(self.layers):
            if i == 1 and now and self.drop_on is None:
                continue
            scaled = not (i == 1 and now and self.rank in (self.drop_on or ()))
            x = checkpoint(layer, x, scaled, use_reentrant=False) if self.ckpt else layer(x, scaled)
        return (self.out_proj(x) ** 2).mean()


def _drop_fsdp_param(rank, world, template, z3, drop_on, zero, steps=4, accum=1, ranks=2):
    """``steps`` steps from a copy of ``template`` (built once: torch's global RNG is shared by the
    thread-ranks); ``zero``: ``opt.zero_grad()`` after each step (else never: the gradients add
    up across steps, as with torch); ``accum`` micro-batches per step."""
    import copy

    import dmuon
    model = copy.deepcopy(template)
    model.drop_on = drop_on
    model, opt = _built(rank, world, model, z3, hsdp=ranks == 4)
    g = torch.Generator().manual_seed(1)
    for model.step in range(steps):
        x = torch.randn(4, 8, generator=g, dtype=torch.float64)
        for mb in range(accum):  # micro-batches: the first ones inside dmuon.no_sync
            model.micro = mb
            sync = not world or mb == accum - 1
            with contextlib.nullcontext() if sync else dmuon.no_sync(model):
                for r in ([rank] if world else range(ranks)):  # one process: every part
                    model.rank = r
                    part = x.chunk(ranks)[r].chunk(accum)[mb]
                    (model(part) / ((1 if world else ranks) * accum)).backward()
        opt.step()
        if zero:
            opt.zero_grad()
    return dmuon.get_model_state_dict(model) if world else model.state_dict()


def _check_drop(z3, drop_on, zero, accum=1, drop_micro=(0, 1)):
    torch.manual_seed(0)
    template = _DropOnRanks().double()
    template.drop_micro = drop_micro
    ref = _drop_fsdp_param(0, 0, template, z3, drop_on, zero, accum=accum)
    for got in run_threads(_drop_fsdp_param, 2, template, z3, drop_on, zero, 4, accum):
        assert max(float((got[k] - v).abs().max()) for k, v in ref.items()) <= TOL


@pytest.mark.parametrize("z3", [True, False], ids=["z3", "z2"])
@pytest.mark.parametrize("drop_on", [None, (0,)], ids=["every_rank", "rank0_only"])
def test_an_fsdp2_param_unused_for_two_steps_equals_one_process(z3, drop_on):
    """An FSDP2 param (AdamW) of a block skipped at two steps, 2 thread-ranks, Z3 and Z2: equal to
    ``RefMuon`` in one process. Skipped on every rank after ``zero_grad``: no gradient anywhere, so
    AdamW skips it (its value and moments untouched: no decay, no weight decay), as torch's AdamW on one
    device does; before, dmuon's ``set_reduce_scatter_unused_params`` (needed for params used on
    some ranks only) made FSDP2 give it a zero gradient and AdamW decayed it (3.6e-3 after 4
    steps). Not read on one rank: a zero from that rank in the average."""
    _check_drop(z3, drop_on, zero=True)


def test_an_fsdp2_param_unused_on_every_rank_of_an_hsdp_mesh():
    """HSDP 2 x 2 (4 thread-ranks), Z3, ``layers.1`` skipped on every rank at two steps: its FSDP2
    ``scale`` is skipped by AdamW (the pre-step all-reduce spans both mesh axes): equal to
    ``RefMuon``."""
    torch.manual_seed(0)
    template = _DropOnRanks().double()
    ref = _drop_fsdp_param(0, 0, template, True, None, True, 4, 1, 4)
    for got in run_threads(_drop_fsdp_param, 4, template, True, None, True, 4, 1, 4):
        assert max(float((got[k] - v).abs().max()) for k, v in ref.items()) <= TOL


@pytest.mark.parametrize("drop_micro", [(0, 1), (0,)], ids=["both", "first_only"])
def test_an_fsdp2_param_unused_in_no_sync_micro_batches(drop_micro):
    """Two micro-batches per step (the first inside ``dmuon.no_sync``), Z3, 2 thread-ranks:
    ``layers.1.scale`` unread on every rank in both (no gradient anywhere: AdamW skips it) or in
    the first only (the second's gradient counts: stepped): equal to ``RefMuon``."""
    _check_drop(True, None, zero=True, accum=2, drop_micro=drop_micro)


def _clear_loop(rank, world, template, z3, where, how):
    """3 steps of ``_DropOnRanks`` (``layers.1`` skipped on every rank at steps 1 and 2), the
    gradients cleared ``where`` ("after_step", "after_forward": between the forward and its
    backward, "never") by ``how`` ("opt" / "model": ``optimizer.zero_grad()`` /
    ``model.zero_grad()``; "opt_keep" / "model_keep": with ``set_to_none=False``). Returns
    ``(state dict, errors)``; with "never", a step that raises is followed by the fix its message
    names: ``optimizer.zero_grad()``, the backward again, the step."""
    import copy

    import dmuon
    model = copy.deepcopy(template)
    model, opt = _built(rank, world, model, z3)
    target = model if how.startswith("model") else opt

    def clear():
        target.zero_grad(set_to_none=not how.endswith("keep"))

    g, errors = torch.Generator().manual_seed(1), []

    def backward(x, after_forward):
        losses = []
        for r in ([rank] if world else range(2)):  # one process: both ranks' halves, averaged
            model.rank = r
            losses.append(model(x.chunk(2)[r]) / (1 if world else 2))
        if after_forward:
            clear()
        for loss in losses:
            loss.backward()

    for model.step in range(3):
        x = torch.randn(4, 8, generator=g, dtype=torch.float64)
        backward(x, where == "after_forward")
        try:
            opt.step()
        except RuntimeError as e:
            errors.append(str(e))
            opt.zero_grad()
            backward(x, False)
            opt.step()
        if where == "after_step":
            clear()
    return (dmuon.get_model_state_dict(model) if world else model.state_dict()), errors


@pytest.mark.parametrize("z3", [True, False], ids=["z3", "z2"])
@pytest.mark.parametrize("where,how,ckpt", [
    ("after_step", "model_keep", False), ("after_forward", "opt", False),
    ("after_forward", "model", False), ("after_forward", "model_keep", False),
    ("after_forward", "opt_keep", False), ("after_forward", "opt", True)])
def test_gradients_cleared_between_the_forward_and_its_backward_equal_one_process(z3, where, how,
                                                                                   ckpt):
    """``loss = model(x); optimizer.zero_grad(); loss.backward(); optimizer.step()`` and its
    variants (``model.zero_grad()``, ``set_to_none=False``), 2 thread-ranks: equal to ``RefMuon``
    in one process, no error. The last step's consumed markers stay ``.grad`` through the forward
    (they came off at the gather before), so a clear after the forward is seen; a zeroed one
    steps a matrix that gets no gradient (``layers.1``, skipped) with zeros, as torch does."""
    if not z3 and where == "after_forward" and how.startswith("model"):
        pytest.skip("FSDP2's own semantics (torch 2.13, also without dmuon): between a Z2 "
                    "forward and its backward model.parameters() yields FSDP2's unsharded "
                    "params, so model.zero_grad() there leaves the sharded .grad of the last "
                    "step (2.5e-3 here, the same before this change); optimizer.zero_grad() "
                    "clears it")
    torch.manual_seed(0)
    template = _DropOnRanks().double()
    template.ckpt = ckpt  # (the blocks re-gathered and re-run inside the backward)
    ref, _ = _clear_loop(0, 0, template, z3, where, how)
    for got, errors in run_threads(_clear_loop, 2, template, z3, where, how):
        assert errors == []
        assert max(float((got[k] - v).abs().max()) for k, v in ref.items()) <= TOL


@pytest.mark.parametrize("z3", [True, False], ids=["z3", "z2"])
def test_no_zero_grad_between_steps_raises_on_every_rank_and_the_fix_works(z3):
    """No ``zero_grad`` at all: torch would add each backward to the gradients the last step used
    (``.grad`` lives until cleared); dmuon keeps no stepped gradient, so the second and third
    ``step()`` raise on every rank, naming the fix, before anything changes (before: each step
    used the new gradients alone, silently, 1.4e-2 after 4 steps). After the fix the message
    names (``optimizer.zero_grad()``, the backward again) the run equals one process clearing
    after every step."""
    torch.manual_seed(0)
    template = _DropOnRanks().double()
    ref, _ = _clear_loop(0, 0, template, z3, "after_step", "opt")
    for got, errors in run_threads(_clear_loop, 2, template, z3, "never", "opt"):
        assert len(errors) == 2 and all("not cleared" in e and "zero_grad()" in e
                                        for e in errors), errors
        assert max(float((got[k] - v).abs().max()) for k, v in ref.items()) <= TOL


def _resume(rank, world, template, route, tmp):
    """6 steps of ``_DropOnRanks`` (``layers.1``'s FSDP2 ``scale`` without a gradient at steps 1
    and 2: its AdamW count falls 2 behind): uninterrupted, or saved after step 3 by ``route``
    and resumed in a new model and optimizer. Returns the final state and the AdamW counts."""
    import copy

    import torch.distributed.checkpoint as dcp

    import dmuon
    from dmuon.checkpoint import load_sharded, save_sharded

    def build():
        m = copy.deepcopy(template)
        return (m,) + tuple(_built(rank, world, m, True)[1:])

    model, opt = build()
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 8, generator=g, dtype=torch.float64) for _ in range(6)]
    for model.step in range(6):
        if model.step == 4 and route:
            if route == "torch":
                sd = opt.state_dict()
            elif route == "full":
                sd = dmuon.get_optimizer_state_dict(model, opt)
            elif route == "sharded":
                save_sharded(f"{tmp}/ck", model, opt)
            elif route == "dcp":
                dcp.save({"optim": opt.state_dict()}, checkpoint_id=f"{tmp}/dcp")
            msd = dmuon.get_model_state_dict(model)
            model, opt = build()
            model.step = 4
            dmuon.set_model_state_dict(model, msd)
            if route == "torch":
                opt.load_state_dict(sd)
            elif route == "full":
                dmuon.set_optimizer_state_dict(model, opt, sd)
            elif route == "sharded":
                load_sharded(f"{tmp}/ck", model, opt)
            elif route == "dcp":
                box = {"optim": opt.state_dict()}
                dcp.load(box, checkpoint_id=f"{tmp}/dcp")
                opt.load_state_dict(box["optim"])
        (model(xs[model.step].chunk(world)[rank])).backward()
        opt.step()
        opt.zero_grad()
    steps = {opt.param_name(p): int(s["step"]) for p, s in opt.state.items() if "exp_avg" in s}
    return dmuon.get_model_state_dict(model), steps


def _resume_routes(rank, world, template, routes, tmp):
    torch.set_num_threads(1)
    return {r: _resume(rank, world, template, r, f"{tmp}/{r}") for r in routes}


@pytest.mark.parametrize("route", ["torch", "full", "files"])
def test_the_adamw_counts_of_a_skipped_param_survive_every_checkpoint_route(route, tmp_path):
    """torch.optim.AdamW's per-param counts (``scale`` of ``layers.1``: 4 after 6 steps, the
    others 6) are saved and loaded by every route (``optimizer.state_dict()``, dmuon's full
    dict, and on spawned gloo ranks ``save_sharded`` and torch's DCP); the resumed run equals
    the uninterrupted one bitwise and torch's AdamW in one process."""
    torch.manual_seed(0)
    template = _DropOnRanks().double()
    ref = _drop_fsdp_param(0, 0, template, True, None, True, steps=6)
    if route == "files":  # DCP on thread-ranks is not supported: spawned gloo ranks
        from dist_utils import run_ranks
        out = run_ranks(_resume_routes, 2, template, (None, "sharded", "dcp"), str(tmp_path),
                        timeout=120)
        pairs = [(o[None], o[r]) for o in out for r in ("sharded", "dcp")]
    else:
        pairs = list(zip(run_threads(_resume, 2, template, None, str(tmp_path)),
                         run_threads(_resume, 2, template, route, str(tmp_path))))
    for (a, sa), (b, sb) in pairs:
        assert sa == sb and sa["layers.1.scale"] == 4 and sa["layers.0.scale"] == 6
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert max(float((b[k] - v).abs().max()) for k, v in ref.items()) <= TOL


def _divergent(rank, world, template, what):
    """Rank 1's optimizer differs (``"lr"``: a per-rank scheduler mistake; ``"momentum_dtype"``:
    built with another option): the step raises on every rank, changing nothing; with the same
    hyper-parameters again, the next batch steps."""
    import copy

    import dmuon
    model = copy.deepcopy(template)
    kw = {"momentum_dtype": torch.bfloat16} if what == "momentum_dtype" and rank == 1 else {}
    model, opt = build_dmuon(rank, world, model, model.layers,
                             {"z3": True, "predicate": lambda n, p: p.ndim == 2, "muon_kw": kw})
    if what == "lr" and rank == 1:
        opt.param_groups[0]["lr"] *= 2
    before = dmuon.get_model_state_dict(model)
    model(_x().chunk(world)[rank]).backward()
    with pytest.raises(RuntimeError, match="different hyper-parameters") as e:
        opt.step()
    after = dmuon.get_model_state_dict(model)
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    stepped = True
    if what == "lr":
        opt.param_groups[0]["lr"] = 0.02  # (rank 0's)
        model(_x().chunk(world)[rank]).backward()
        opt.step()
        stepped = not torch.equal(before["out_proj.weight"],
                                  dmuon.get_model_state_dict(model)["out_proj.weight"])
    assert ("lr=0.04" if what == "lr" and rank == 1 else "lr=0.02") in str(e.value)  # its own
    return unchanged, stepped, str(e.value)[:40]


@pytest.mark.parametrize("what", ["lr", "momentum_dtype"])
def test_hyper_parameters_that_differ_across_ranks_raise_on_every_rank(what):
    torch.manual_seed(0)
    template = _DropOnRanks().double()
    for unchanged, stepped, msg in run_threads(_divergent, 2, template, what):
        assert unchanged and stepped and msg.startswith("dmuon.Muon.step: the ranks'")
