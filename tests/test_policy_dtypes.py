"""Per-param dtypes of the policy (``Rule(param_dtype=, reduce_dtype=, master_dtype=)``).

The 2-rank part runs in tests/test_views_hf.py's spawned group (:func:`dtype_worker`,
:func:`check_dtypes`): on an fp32 model with every weight dedicated (no fully_shard),
(1) fp64 masters for some params (storage, momentum) equal, bitwise, a single-process functional
reference keeping fp64 masters for those; (2) bf16 gathered copies / bf16 reduces for some params,
fp32 for the others, equal, bitwise, a reference doing the same casts (each rank's gradient in the
gathered dtype, cast to the reduce dtype, the two averaged there: with 2 ranks ``(a + b) / 2`` is
one rounding whatever the collective's order); (3) policies differing across ranks raise on every
rank (fingerprint); a master narrower than the param raises on every rank. The validation of the
fields themselves (4) runs here, in-process.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

D, STEPS = 16, 5


class CastLinear(nn.Module):
    """``y = x W^T`` computed in the weight's dtype (input cast to it), returned in fp32: a module
    that tolerates a per-param gathered dtype different from its neighbours'."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) / n_in ** 0.5)

    def forward(self, x):
        return F.linear(x.to(self.weight.dtype), self.weight).float()


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = CastLinear(D, 24), CastLinear(24, D)

    def forward(self, x):
        return x + torch.tanh(self.b(torch.tanh(self.a(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()


def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, D, generator=g) for _ in range(STEPS)]


#: case -> rules (pattern, fields); the model is fp32
CASES = {
    "master64": (("layers.0.*", dict(master_dtype=torch.float64)),),
    "mixed": (("layers.0.a.weight", dict(param_dtype=torch.bfloat16)),          # reduce: bf16
              ("layers.1.b.weight", dict(reduce_dtype=torch.bfloat16)),         # gathered fp32
              ("layers.1.a.weight", dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                         master_dtype=torch.float64))),
}


def policy_of(case: str):
    from dmuon.functional.policy import ParamPolicy, Rule
    return ParamPolicy(rules=tuple(Rule(p, **kw) for p, kw in CASES[case]))


def expected_dtypes(case: str) -> dict[str, tuple[torch.dtype, torch.dtype, torch.dtype]]:
    """``{name: (gathered, reduce, master)}`` by the documented precedence (no mp_policy;
    ``case=None``: no rules)."""
    from dmuon.functional.policy import ParamPolicy
    pol = policy_of(case) if case is not None else ParamPolicy()
    out = {}
    for n, _ in make_net().named_parameters():
        _, r = pol.rule_for(n)
        c = r.param_dtype if r is not None and r.param_dtype is not None else torch.float32
        red = r.reduce_dtype if r is not None and r.reduce_dtype is not None else c
        m = r.master_dtype if r is not None and r.master_dtype is not None else torch.float32
        out[n] = (c, red, m)
    return out


def _dmuon_case(rank: int, world: int, case: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon
    from dmuon.stateful.runtime.state import get_state

    model = make_net()
    mesh = init_device_mesh("cpu", (world,))
    dmuon.dedicate_params(model, mesh, lambda n, p: p.ndim == 2, policy=policy_of(case))
    seen: dict[str, str] = {}
    for n, m in model.named_modules():
        if isinstance(m, CastLinear):
            def note(mod, args, n=n):  # returns None: the args stay as they are
                seen.setdefault(n + ".weight", str(mod.weight.dtype))
            m.register_forward_pre_hook(note)
    opt = dmuon.Muon(model, ns_dtype=torch.float64)
    rt = get_state(model)
    for x in batches():
        opt.zero_grad()
        model(x.chunk(world)[rank]).backward()
        opt.step()
    return {"masters": {n: m.detach().clone() for n, m in rt.owned_masters().items()},
            "momentum": {n: str(b.dtype) for n, b in opt.muon_state.momentum.items()},
            "master_dtype": {n: str(d) for n, d in rt.master_dtype.items()},
            "storage": {n: str(m.dtype) for n, m in rt.masters.items()},
            "compute": {n: str(d) for n, d in rt.compute_dtype.items()},
            "reduce": {n: str(d) for n, d in rt.reduce_dtype.items()},
            "seen": seen, "describe": rt_describe(case)}


def rt_describe(case: str) -> str:
    return policy_of(case).describe()


def _raises(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return "no error"


def _dedicate(rank: int, world: int, policy) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon
    dmuon.dedicate_params(make_net(), init_device_mesh("cpu", (world,)), lambda n, p: p.ndim == 2,
                          policy=policy)


def dtype_worker(rank: int, world: int) -> dict:
    from dmuon.functional.policy import ParamPolicy, Rule
    out = {case: _dmuon_case(rank, world, case) for case in CASES}
    # (3) rank 1 keeps fp64 masters for a param, rank 0 does not: the fingerprints differ
    mine = ParamPolicy(rules=(Rule("layers.0.a.weight", master_dtype=torch.float64),)) \
        if rank == 1 else ParamPolicy(rules=(Rule("layers.0.a.weight"),))
    out["mismatch"] = _raises(lambda: _dedicate(rank, world, mine))
    # a master narrower than the param: raises on every rank (rank 0's rule only)
    narrow = ParamPolicy(rules=(Rule("layers.1.b.weight", master_dtype=torch.bfloat16),)) \
        if rank == 0 else ParamPolicy()
    out["narrow"] = _raises(lambda: _dedicate(rank, world, narrow))
    out["load"] = _load_case(rank, world)
    return out


def _load_case(rank: int, world: int) -> dict:
    """fp64 masters of fp32 params (``master64``) loaded from an fp64 model state dict, with and
    without ``rank0_only`` and through ``model.load_state_dict``: the masters after each load
    (this rank's owned ones)."""
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon
    from dmuon.stateful.runtime.state import get_state
    model = make_net()
    dmuon.dedicate_params(model, init_device_mesh("cpu", (world,)), lambda n, p: p.ndim == 2,
                          policy=policy_of("master64"))
    g = torch.Generator().manual_seed(7)
    sd = {k: torch.randn(v.shape, generator=g, dtype=torch.float64)
          for k, v in make_net().state_dict().items()}
    out = {}
    for rank0_only in (False, True):
        dmuon.set_model_state_dict(model, sd if rank == 0 or not rank0_only else None,
                                   rank0_only=rank0_only)
        out[rank0_only] = {n: m.detach().clone()
                           for n, m in get_state(model).owned_masters().items()}
    model.load_state_dict(sd)  # torch's own route rounds the same way
    out["torch"] = {n: m.detach().clone() for n, m in get_state(model).owned_masters().items()}
    out["sd"] = sd
    return out


def reference(case: "str | None", world: int = 2) -> dict[str, torch.Tensor]:
    """Single process: masters in their master dtype; per step and rank, the forward/backward on
    the rank's batch slice with the weights cast to the gathered dtype, the gradient cast to the
    reduce dtype, the ranks' gradients averaged in it, functional Muon on the masters."""
    from dmuon.functional import muon as fmuon
    dts = expected_dtypes(case)
    net = make_net()
    masters = {n: p.detach().to(dts[n][2]).clone() for n, p in net.named_parameters()}
    state = fmuon.init(masters)
    hp = fmuon.MuonHParams(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.0, ns_steps=5,
                           ns_dtype=torch.float64)
    params = dict(net.named_parameters())
    for x in batches():
        per_rank = []
        for xr in x.chunk(world):
            for n, p in params.items():
                p.data = masters[n].to(dts[n][0])
                p.grad = None
            net(xr).backward()
            per_rank.append({n: p.grad.to(dts[n][1]) for n, p in params.items()})
        grads = {n: (per_rank[0][n] + per_rank[1][n]) / world for n in params}
        with torch.no_grad():
            _, state = fmuon.update(grads, state, masters, hp, donate=True)
    return masters


def check_dtypes(results: list[dict]) -> None:
    """The assertions on :func:`dtype_worker`'s per-rank results."""
    for case in CASES:
        dts = expected_dtypes(case)
        ref = reference(case)
        got = {}
        for r in results:
            res = r[case]
            for n, (c, red, m) in dts.items():
                assert res["master_dtype"][n] == str(m), (case, n, res["master_dtype"])
                assert res["compute"][n] == str(c) and res["seen"][n] == str(c), (case, n, res)
                assert res["reduce"][n] == str(red), (case, n, res["reduce"])
                if n in res["storage"]:
                    assert res["storage"][n] == str(m), (case, n, res["storage"])
            for n, d in res["momentum"].items():
                assert d == str(dts[n][2]), (case, n, d)
            got.update(res["masters"])
        assert set(got) == set(ref)
        for n in ref:
            assert got[n].dtype == ref[n].dtype, (case, n)
            assert torch.equal(got[n], ref[n]), (case, n, float((got[n] - ref[n]).abs().max()))
        for field in ("master_dtype=float64",):
            assert field in results[0][case]["describe"], results[0][case]["describe"]
    # the rules matter: fp64 masters hold values fp32 cannot; the no-rule reference is elsewhere
    plain = reference(None)
    m64 = {k: v for r in results for k, v in r["master64"]["masters"].items()}
    for n in ("layers.0.a.weight", "layers.0.b.weight"):
        assert not torch.equal(m64[n], m64[n].float().double()), n
    mixed = {k: v for r in results for k, v in r["mixed"]["masters"].items()}
    assert float((mixed["layers.0.a.weight"] - plain["layers.0.a.weight"]).abs().max()) > 1e-4
    for r in results:
        assert r["mismatch"].startswith("RuntimeError") and "owner plan differs across ranks" \
            in r["mismatch"] and "policy" in r["mismatch"], r["mismatch"]
        assert "narrower" in r["narrow"] and "layers.1.b.weight" in r["narrow"], r["narrow"]
    # a model state dict holds the params' values: an fp64 value loads into an fp64 master of an
    # fp32 param rounded to the param's dtype first (as the param itself would hold it), with
    # rank0_only or without (the every-rank path kept the fp64 value, rank0_only rounded it)
    for r in results:
        load = r["load"]
        assert load[False] and set(load[False]) == set(load[True])
        for n, m in load[False].items():
            want = load["sd"][n].float().to(m.dtype)
            assert m.dtype == (torch.float64 if n.startswith("layers.0.") else torch.float32), n
            assert torch.equal(m, want), n
            assert torch.equal(load[True][n], want), n
            assert torch.equal(load["torch"][n], want), n


# ------------------------------------------------------------------------ (4) validation, in-process
@pytest.mark.parametrize("kw", [dict(param_dtype=torch.int32), dict(reduce_dtype="bf16"),
                                dict(master_dtype=torch.float8_e4m3fn),
                                dict(master_dtype=torch.complex64),
                                dict(param_dtype=torch.float32, master_dtype=torch.bfloat16),
                                dict(param_dtype=torch.bfloat16, master_dtype=torch.float16)])
def test_invalid_rule_dtypes_raise(kw):
    from dmuon.functional.policy import Rule
    with pytest.raises(ValueError, match="Rule"):
        Rule("*", **kw)


def test_dtype_rules_decide_fingerprint_describe():
    from dmuon.functional.policy import ParamPolicy, Rule
    from dmuon.functional.policy import policy_fingerprint
    pol = ParamPolicy(rules=(Rule("a", param_dtype=torch.bfloat16, master_dtype=torch.float64),))
    d = pol.decide("a", (4, 4), predicate_says_muon=True, dtype=torch.float32)
    assert (d.param_dtype, d.reduce_dtype, d.master_dtype) == (torch.bfloat16, None, torch.float64)
    assert "param_dtype=bfloat16" in pol.describe() and "master_dtype=float64" in pol.describe()
    other = ParamPolicy(rules=(Rule("a", param_dtype=torch.bfloat16, master_dtype=torch.float32),))
    assert policy_fingerprint("x", pol) != policy_fingerprint("x", other)
    # rules without dtypes keep the fingerprints they had
    assert ParamPolicy(rules=(Rule("a", lr_mult=2.0),)).canonical() == [["a", None, None, 2.0, None]]
    with pytest.raises(ValueError, match="narrower"):
        ParamPolicy(rules=(Rule("a", master_dtype=torch.float32),)).decide(
            "a", (4, 4), predicate_says_muon=True, dtype=torch.float64)
    with pytest.raises(ValueError, match="AdamW"):  # a dtype rule on an AdamW param
        pol.decide("a", (4,), predicate_says_muon=False)
    with pytest.raises(ValueError, match="AdamW"):
        Rule("a", route="adamw", reduce_dtype=torch.float32)


def test_resolve_group_dtypes_precedence():
    """Rule over the group's MixedPrecisionPolicy over the param's dtype; reduce defaults to the
    group policy's reduce_dtype, else the param's gathered dtype."""
    from dmuon.functional.policy import resolve_group_dtypes
    bf, f32, f64 = torch.bfloat16, torch.float32, torch.float64
    orig = {"a": f32, "b": f32, "c": f64}
    kw = dict(rule_param_dtype={"c": bf}, rule_reduce_dtype={"b": f64})
    dc, dr, c, r = resolve_group_dtypes("g", orig, group_param_dtype=None, group_reduce_dtype=None,
                                        **kw)  # c's rule: the rest is one dtype (fp32)
    assert (dc, dr, c, r) == (f32, f32, {"a": f32, "b": f32, "c": bf}, {"a": f32, "b": f64, "c": bf})
    dc, dr, c, r = resolve_group_dtypes("g", orig, group_param_dtype=f64, group_reduce_dtype=f32,
                                        **kw)
    assert (dc, dr, c, r) == (f64, f32, {"a": f64, "b": f64, "c": bf}, {"a": f32, "b": f64, "c": f32})
    with pytest.raises(ValueError, match="mixes param dtypes"):
        resolve_group_dtypes("g", orig, group_param_dtype=None, group_reduce_dtype=None,
                             rule_param_dtype={}, rule_reduce_dtype={})


def test_resolve_model_dtypes_each_param_follows_its_holder():
    """A param follows the fully_shard module holding it; a group's defaults are its own
    module's part's (else its first part's)."""
    from dmuon.functional.policy import resolve_model_dtypes
    bf, f32 = torch.bfloat16, torch.float32
    orig = {"x.a": f32, "x.y.b": f32, "z.c": f32}
    groups = {"x": ["x.a", "x.y.b"], "z": ["z.c"], "": []}
    holder = {"x.a": "X", "x.y.b": "Y", "z.c": "R"}  # x.y is fully_shard-ed inside x
    policy = {"X": (None, None), "Y": (bf, f32), "R": (bf, None)}
    defaults, c, r = resolve_model_dtypes(groups, holder, {"x": "Y", "z": "X", "": "R"}, policy,
                                          orig, rule_param_dtype={}, rule_reduce_dtype={})
    assert c == {"x.a": f32, "x.y.b": bf, "z.c": bf} and r == {"x.a": f32, "x.y.b": f32, "z.c": bf}
    assert defaults == {"x": (bf, f32), "z": (bf, bf)}  # z: its first (only) part's


def test_master_dtype_for_is_the_wider_of_the_param_dtype_and_fp32():
    from dmuon.functional.policy import master_dtype_for
    assert [master_dtype_for(d) for d in (torch.bfloat16, torch.float32, torch.float64)] == [
        torch.float32, torch.float32, torch.float64]
