"""Users' paths, third round (issue 37; 2 gloo ranks, fp64, 3 steps): each equal to the same loop
on one process with ``RefMuon`` to <= 1e-10, or a clear error on every rank within a bound.

Paths: a ``register_post_accumulate_grad_hook`` registered on the dedicated matrices after
``dedicate_params`` (and, in ZeRO-2, between a forward and its backward); such a hook that steps
the matrix itself (optimizer-in-backward); ``if rank == 0: torch.save(model.state_dict(), f)``
and other state dicts called on some ranks only; a nested ``fully_shard`` with its own
``MixedPrecisionPolicy``; a double backward (an R1 gradient penalty through ``create_graph=True``); errors that name the
real cause: ``torch.amp.GradScaler``, PEFT applied after ``dedicate_params``, a flat model whose
forward returns a plain object hiding the loss.

One spawn of 2 ranks runs every path (the default tier's budget); the reference runs each rank's
micro-batch in turn on one process (loss / world, summed gradients).
"""
from __future__ import annotations

import pytest
import torch
from dist_utils import catch, run_each, run_ranks
from models import make_batches, make_model, muon_predicate
from stateful_harness import build_dmuon
from user_paths_harness import TOL, RefMuon

STEPS, BATCH, WORLD = 3, 4, 2


# ----------------------------------------------------------------------- helpers
def _build(make, env, cfg=None):
    model = make()
    if env["dist"]:
        return build_dmuon(env["rank"], env["world"], model, model.layers, cfg or {})
    return model, RefMuon(model)


def _full_sd(model, env):
    import dmuon
    if env["dist"]:
        return dmuon.get_model_state_dict(model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _chunks(ids, env):
    """This rank's micro-batch (distributed) or every rank's in turn (reference), with the loss
    scale that makes their gradients sum to the distributed average."""
    ranks = [env["rank"]] if env["dist"] else range(WORLD)
    return [(ids.chunk(WORLD)[r], 1.0 if env["dist"] else 1.0 / WORLD) for r in ranks]


def _backward_alone(model, loss, env):
    """``loss.backward()``; the reference runs each simulated rank's backward on fresh ``.grad``
    and sums afterwards, so that a post-accumulate-grad hook sees that rank's gradient alone (as
    on each rank), not the running sum."""
    if env["dist"]:
        loss.backward()
        return
    prev = {p: p.grad for p in model.parameters()}
    model.zero_grad(set_to_none=True)
    loss.backward()
    for p, g in prev.items():
        if g is not None:
            p.grad = g if p.grad is None else p.grad + g


# ----------------------------------------------------------------------- item 1: hooks after setup
def _grad_hook(seen):
    """The usual defensive post-accumulate-grad hook (gradient monitors, per-param scaling)."""
    def hook(p):
        if p.grad is None:
            return
        seen.append(float(p.grad.norm()))
        p.grad.mul_(0.5)
    return hook


def _hook_after(cfg, when):
    """Hooks on every dedicated matrix, registered after setup (``when="setup"``) or between the
    first forward and its backward (``when="mid"``); they halve the gradient and log its norm."""
    def path(env):
        model, opt = _build(make_model, env, cfg)
        seen = []
        mats = [p for n, p in model.named_parameters() if n.endswith("proj.weight")]
        if when == "setup":
            for p in mats:
                p.register_post_accumulate_grad_hook(_grad_hook(seen))
        for i, ids in enumerate(make_batches(STEPS, BATCH)):
            opt.zero_grad()
            for mb, scale in _chunks(ids, env):
                loss = model(mb) * scale
                if when == "mid" and i == 0 and not getattr(model, "_hooked", False):
                    model._hooked = True
                    for p in mats:
                        p.register_post_accumulate_grad_hook(_grad_hook(seen))
                _backward_alone(model, loss, env)
            opt.step()
        return {"sd": _full_sd(model, env), "extra": {"hooked": len(seen) > 0}}
    return path


def _hook_writes(env):
    """Optimizer-in-backward: a hook that steps the dedicated matrix itself (``p.add_``). Its
    gathered copy is not the matrix (the owner's master is): the write must raise, not vanish."""
    model, opt = _build(make_model, env)
    mats = [p for n, p in model.named_parameters() if n.endswith("proj.weight")]

    def step_in_backward(p):
        if p.grad is not None:
            with torch.no_grad():
                p.add_(p.grad, alpha=-0.01)
    for p in mats:
        p.register_post_accumulate_grad_hook(step_in_backward)
    for ids in make_batches(2, BATCH):
        opt.zero_grad()
        for mb, scale in _chunks(ids, env):
            (model(mb) * scale).backward()
        opt.step()
    return {"sd": _full_sd(model, env)}


# ----------------------------------------------------------------------- item 3: nested policies
def _muon(model):
    import dmuon
    from stateful_harness import HP
    return dmuon.Muon(model, lr=HP["lr"], momentum=HP["momentum"], nesterov=HP["nesterov"],
                      weight_decay=HP["weight_decay"], ns_steps=HP["ns_steps"],
                      ns_dtype=torch.float64, adamw_lr=HP["adamw_lr"],
                      adamw_betas=HP["adamw_betas"], adamw_eps=HP["adamw_eps"],
                      adamw_weight_decay=HP["adamw_weight_decay"])


def _fp32_attention(attn):
    """The reference's ``self_attn`` as FSDP2's ``MixedPrecisionPolicy(param_dtype=float32)`` on
    it runs: the input cast to fp32 (``cast_forward_inputs``), the weights' fp32 copies."""
    import torch.nn.functional as F
    from models import _causal_attention

    def forward(x):
        x = x.float()
        b, t, d = x.shape
        hd = d // attn.heads

        def lin(m, y):
            return F.linear(y, m.weight.float())

        def split(y):
            return y.view(b, t, -1, hd).transpose(1, 2)
        out = _causal_attention(split(lin(attn.q_proj, x)), split(lin(attn.k_proj, x)),
                                split(lin(attn.v_proj, x)))
        return lin(attn.o_proj, out.transpose(1, 2).reshape(b, t, -1))
    attn.forward = forward


def _nested_mp(env):
    """``fully_shard(layer.self_attn, mp_policy=MixedPrecisionPolicy(param_dtype=float32,
    reduce_dtype=float64))`` inside each ``fully_shard(layer)`` (no policy: fp64): the attention
    matrices compute in fp32, the MLP's in fp64 (gradients averaged in fp64: exact)."""
    model = make_model()
    if env["dist"]:
        import dmuon
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh("cpu", (env["world"],))
        dmuon.dedicate_params(model, mesh, muon_predicate)
        pol = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float64)
        for layer in model.layers:
            fully_shard(layer.self_attn, mesh=mesh, mp_policy=pol)
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = _muon(model)
    else:
        for layer in model.layers:
            _fp32_attention(layer.self_attn)
        opt = RefMuon(model)
    for ids in make_batches(STEPS, BATCH):
        opt.zero_grad()
        for mb, scale in _chunks(ids, env):
            (model(mb) * scale).backward()
        opt.step()
    return {"sd": _full_sd(model, env)}


# ----------------------------------------------------------------------- item 4: double backward
class _Layer(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.up_proj = torch.nn.Linear(dim, dim)  # the weight is Muon's, the bias AdamW's

    def forward(self, x):
        return x + torch.tanh(self.up_proj(x))


class Disc(torch.nn.Module):
    """A GAN discriminator: ``layers.N.up_proj`` blocks and a linear head."""

    def __init__(self, dim=8, n=2):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Layer(dim) for _ in range(n))
        self.head = torch.nn.Linear(dim, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _disc():
    torch.manual_seed(2)
    return Disc().double()


def _r1_penalty(cfg):
    return lambda env: _r1_penalty_run(env, cfg)


def _r1_penalty_run(env, cfg):
    """R1 gradient penalty (StyleGAN / WGAN-GP style): ``autograd.grad(D(x).sum(), x,
    create_graph=True)``, then ``.backward()`` through that gradient; FSDP2 told to keep its
    params (``reshard_after_forward=False``, and ``set_reshard_after_backward(False)`` for the
    first pass only: kept for good, FSDP2 would run the next forward on its stale pre-step
    copies)."""
    import torch.nn.functional as F
    model, opt = _build(_disc, env, cfg)
    keep = model.set_reshard_after_backward if env["dist"] else (lambda flag: None)
    gen = torch.Generator().manual_seed(5)
    data = [torch.randn(BATCH, 8, generator=gen, dtype=torch.float64) for _ in range(STEPS)]
    for real in data:
        opt.zero_grad()
        for x, scale in _chunks(real, env):
            x = x.clone().requires_grad_(True)
            out = model(x)
            keep(False)
            (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
            loss = F.softplus(-out).mean() + 5.0 * g.pow(2).sum(-1).mean()
            keep(True)
            (loss * scale).backward()
        opt.step()
    return {"sd": _full_sd(model, env)}


# ----------------------------------------------------------------------- item 5: errors that point
def _grad_scaler(env):
    """fp16 loss scaling in a custom loop: ``torch.amp.GradScaler``'s ``scale`` / ``step`` /
    ``update`` around ``dmuon.Muon``."""
    model, opt = _build(make_model, env)
    scaler = torch.amp.GradScaler("cpu")
    ids = make_batches(1, BATCH)[0]
    opt.zero_grad()
    for mb, scale in _chunks(ids, env):
        scaler.scale(model(mb) * scale).backward()
    scaler.step(opt)
    scaler.update()


class _LoraLinear(torch.nn.Module):
    """What PEFT's ``get_peft_model`` puts in place of a target ``nn.Linear``: the original as
    ``base_layer`` (frozen) plus ``lora_A`` / ``lora_B``."""

    def __init__(self, base, r=2):
        super().__init__()
        self.base_layer = base
        self.lora_A = torch.nn.Linear(base.in_features, r, bias=False, dtype=torch.float64)
        self.lora_B = torch.nn.Linear(r, base.out_features, bias=False, dtype=torch.float64)
        torch.nn.init.zeros_(self.lora_B.weight)

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


class _PeftModel(torch.nn.Module):
    """``get_peft_model(model, LoraConfig(target_modules=["q_proj", "v_proj"]))``'s layout:
    ``base_model.model.<the model>``, the targets wrapped, everything else frozen."""

    def __init__(self, model):
        super().__init__()
        self.base_model = torch.nn.Module()
        self.base_model.model = model
        model.requires_grad_(False)
        for layer in model.layers:
            for t in ("q_proj", "v_proj"):
                setattr(layer.self_attn, t, _LoraLinear(getattr(layer.self_attn, t)))

    def forward(self, ids):
        return self.base_model.model(ids)


def _peft_after(env):
    """PEFT applied after ``dedicate_params`` (then ``fully_shard`` and ``dmuon.Muon`` on it)."""
    import dmuon
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model = make_model()
    mesh = init_device_mesh("cpu", (env["world"],))
    dmuon.dedicate_params(model, mesh, muon_predicate)
    peft = _PeftModel(model)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(peft, mesh=mesh)
    opt = _muon(peft)
    opt.zero_grad()
    peft(make_batches(1, BATCH)[0].chunk(WORLD)[env["rank"]]).backward()
    opt.step()


class _Out:
    """A plain object hiding the loss from torch's pytree (not a tuple, dict, dataclass
    registered as a pytree node or ``ModelOutput``)."""

    def __init__(self, loss):
        self.loss = loss


class _Flat(torch.nn.Module):
    """No ``layers.N``: ``fully_shard(model)`` alone; its forward returns :class:`_Out`."""

    def __init__(self, dim=8):
        super().__init__()
        torch.manual_seed(3)
        self.up_proj = torch.nn.Linear(dim, dim, dtype=torch.float64)
        self.scale = torch.nn.Parameter(torch.ones(dim, dtype=torch.float64))

    def forward(self, x):
        return _Out((torch.tanh(self.up_proj(x)) * self.scale).pow(2).mean())


def _flat_object(env):
    import dmuon
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model = _Flat()
    mesh = init_device_mesh("cpu", (env["world"],))
    dmuon.dedicate_params(model, mesh, muon_predicate)
    fully_shard(model, mesh=mesh)
    opt = _muon(model)
    x = torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    for _ in range(2):
        opt.zero_grad()
        model(x.chunk(WORLD)[env["rank"]]).loss.backward()
        opt.step()


PATHS = {
    "hook_after_setup": _hook_after({}, "setup"),
    "hook_after_setup_z2": _hook_after({"z3": False}, "setup"),
    "hook_mid_z2": _hook_after({"z3": False}, "mid"),
    "hook_writes": _hook_writes,
    "nested_mp": _nested_mp,
    "r1_penalty": _r1_penalty({"z3": False}),
    "r1_penalty_z3": _r1_penalty({}),
}


# ----------------------------------------------------------------------- item 2: one-rank saves
JOIN_S = 3.0  # the join bound the workers set (DMUON_JOIN_TIMEOUT_S)


def _one_rank_saves(rank, world):
    """``if rank == 0: torch.save(model.state_dict(), f)`` (the single-GPU habit; HF's
    ``save_pretrained`` calls the same), then ``dmuon.get_model_state_dict`` on rank 1 only; after
    each the ranks meet in a barrier, and then a save on every rank must work."""
    import datetime
    import io
    import time

    import torch.distributed as dist

    import dmuon
    model = make_model()
    model, opt = build_dmuon(rank, world, model, model.layers, {},
                             timeout=datetime.timedelta(seconds=20))
    ids = make_batches(1, BATCH)[0]
    model(ids.chunk(world)[rank]).backward()
    opt.step()
    out = {}
    for key, who, call in (("rank0_state_dict", 0, lambda: torch.save(model.state_dict(),
                                                                        io.BytesIO())),
                           ("rank1_get_model_state_dict", 1,
                            lambda: dmuon.get_model_state_dict(model)),
                           ("rank0_optimizer_state_dict", 0, lambda: torch.save(opt.state_dict(),
                                                                              io.BytesIO()))):
        t0 = time.monotonic()
        out[key] = catch(call) if rank == who else (None, None)
        out[key + "_s"] = time.monotonic() - t0
        dist.barrier()
    out["every_rank_after"] = catch(lambda: torch.save(model.state_dict(), io.BytesIO()))
    return out


ERRORS = {"grad_scaler": _grad_scaler, "peft_after": _peft_after, "flat_object": _flat_object}


def _worker(rank, world):
    import os
    os.environ["DMUON_JOIN_TIMEOUT_S"] = str(JOIN_S)
    torch.set_num_threads(1)
    env = dict(rank=rank, world=world, dist=True)
    out = run_each(PATHS, env)
    for key, path in ERRORS.items():
        out[key] = catch(lambda: path(env))
    out["one_rank_saves"] = _one_rank_saves(rank, world)  # last: before the fix it broke the group
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_worker, WORLD, timeout=180)


def _diff(a, b):
    if isinstance(b, dict):
        assert set(a) == set(b), (set(a) ^ set(b))
        return max((_diff(a[k], v) for k, v in b.items()), default=0.0)
    if isinstance(b, (bool, str)):
        assert a == b, (a, b)
        return 0.0
    return float((a - b).abs().max())


def _check(results, key):
    ref = PATHS[key](dict(rank=0, world=1, dist=False))
    for rank, r in enumerate(results):
        got = r[key]
        assert "error" not in got, (key, rank, got.get("error"))
        assert _diff(got.get("extra", {}), ref.get("extra", {})) == 0.0
        worst = _diff(got["sd"], ref["sd"])
        assert worst <= TOL, f"{key} rank {rank}: max abs diff {worst:.3g}"


@pytest.mark.parametrize("key", ["hook_after_setup", "hook_after_setup_z2", "hook_mid_z2"])
def test_post_accumulate_grad_hook_after_setup_sees_the_gradient(results, key):
    """Before: the hook saw ``p.grad is None`` on every dedicated matrix (a defensive hook did
    nothing: 0.114 from one process after 4 steps in the issue's run). Now dmuon's own hook runs
    after the user's (reordered at registration on a placeholder; a hook registered while the
    param is gathered gets ``.grad`` in that backward and dmuon takes it at its end)."""
    _check(results, key)


def test_optimizer_in_backward_on_a_dedicated_matrix_raises_on_every_rank(results):
    """A hook that updates the param itself (optimizer-in-backward) writes into the gathered copy,
    which dmuon discards: every rank must raise, naming the param and ``dmuon.Muon``. Before: the
    write vanished at the next reshard, silently."""
    for rank, r in enumerate(results):
        err = r["hook_writes"].get("error", "")
        assert "DedicatedParamError" in err and "in place" in err and "dmuon.Muon" in err, \
            (rank, err[:400])


def test_state_dict_on_one_rank_raises_within_seconds_naming_the_cause(results):
    """Before: rank 0 waited in the collective state dict for the whole timeout (30 min at
    torch's default), then raised about "the weight gather (forward / backward pre-hook)
    collective"; the other rank saw "Connection closed by peer". Now the calling rank raises
    after the join bound (here 3 s), naming the cause and the fix; the others are not held; a
    save on every rank afterwards works."""
    for rank, r in enumerate(results):
        o = r["one_rank_saves"]
        for key, who in (("rank0_state_dict", 0), ("rank1_get_model_state_dict", 1),
                         ("rank0_optimizer_state_dict", 0)):
            kind, msg = o[key]
            if rank == who:
                assert kind is not None and "state_dict / save is collective: call it on every " \
                    "rank" in msg and f"[{1 - who}]" in msg, (rank, key, kind, msg)
                # a fix that works (tests/test_stateful_hf.py saves that way); not the one
                # FSDP2 refuses (save_pretrained(dir, is_main_process=...) on every rank)
                assert "save_pretrained(dir, state_dict=sd)" in msg and "trainer.save_model(dir)" \
                    in msg, (rank, key, msg)
                assert o[key + "_s"] < JOIN_S + 10, (rank, key, o[key + "_s"])
            else:
                assert kind is None, (rank, key, msg)
        assert o["every_rank_after"] == (None, None), (rank, o["every_rank_after"])


def test_nested_fully_shard_policy_is_followed_per_matrix(results):
    """Before: every rank raised torch's ``expected m1 and m2 to have the same dtype`` (the
    attention matrices gathered in fp64, their input cast to fp32 by FSDP2), no word of dmuon.
    Now each matrix follows the policy of the innermost ``fully_shard`` module holding it."""
    _check(results, "nested_mp")


@pytest.mark.parametrize("key", ["r1_penalty", "r1_penalty_z3"])
def test_double_backward_gradient_penalty_equals_one_process(results, key):
    """Before: every rank raised torch's internal ``setStorage ... size 0`` in the second backward
    (dmuon had freed the gathered copies the first pass's graph saved); no dmuon setting kept
    them. Now a backward with ``create_graph=True`` keeps them gathered (its graph holds them)
    until the next backward without it ends, or the step; ZeRO-2 and ZeRO-3."""
    _check(results, key)


@pytest.mark.parametrize("key, needles", [
    ("grad_scaler", ("GradScaler", "fp16 loss scaling is not supported", "bf16")),
    ("peft_after", ("PEFT", "before dmuon.dedicate_params", "base_layer")),
    ("flat_object", ("_Out", "pytree", "FSDP2")),
])
def test_errors_name_the_real_cause(results, key, needles):
    """Before: GradScaler raised a ``DedicatedParamError`` telling the user to use ``dmuon.Muon``
    (they do); PEFT after ``dedicate_params`` was blamed on FSDP2 takeover and patch order; the
    flat model whose forward returns a plain object hiding the loss trained silently wrong (FSDP2
    never reduced its own params' gradients: 1.0 relative on the AdamW params). Now each raises
    on every rank naming the cause and the fix (bf16; PEFT first; a pytree-visible output)."""
    for rank, r in enumerate(results):
        kind, msg = r[key]
        assert kind is not None, (rank, key)
        for n in needles:
            assert n in msg, (rank, key, n, msg[:600])
