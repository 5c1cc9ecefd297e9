"""The public face (issue 45): ``dmuon.Muon`` takes at most 17 options, torch's names where torch
has the option (``param_groups[0]`` keeps the functional core's names: the checkpoint format),
``dedicate_params`` at most 7 arguments (the rest is ``DedicateOptions``), the execution knobs are
setters, the momentum dtype is the momentum stage's option; the former spellings still work with a
``DeprecationWarning`` and never silently disagree with the new ones (pure checks, no processes;
the zoo and the gloo tests run the deprecated spellings end to end)."""
from __future__ import annotations

import inspect

import pytest
import torch

import dmuon
from dmuon.functional import muon_options as fopts
from dmuon.functional import variants
from dmuon.functional.dedicate_options import DedicateOptions, fold_deprecated
from dmuon.functional.muon import MuonHParams
from dmuon.functional.state_dtype import round_trip


def _options(fn, skip: int) -> list[str]:
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [n for n, p in list(inspect.signature(fn).parameters.items())[skip:] if p.kind in kinds]


def test_option_counts():
    assert len(_options(dmuon.Muon.__init__, 2)) <= 17  # (self, model)
    assert {"eps", "adjust_lr_fn"} <= set(_options(dmuon.Muon.__init__, 2))
    assert not {"ns_eps", "lr_scale", "momentum_dtype", "ns_engine", "elementwise", "adamw_impl",
                "replicate_async", "persistent_grad_buffers"} & set(_options(dmuon.Muon.__init__, 2))
    assert len(_options(dmuon.dedicate_params, 0)) <= 7
    assert all(hasattr(dmuon.Muon, f"set_{k}") for k in fopts.KNOBS)


def _given(**kw):
    base = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.0, ns_steps=5,
                ns_coefficients="polar_express", eps=1e-7, ns_dtype=None,
                adjust_lr_fn="match_rms_adamw", adamw_lr=1e-3, adamw_betas=(0.9, 0.999),
                adamw_eps=1e-8, adamw_weight_decay=0.01, check_finite="auto")
    return {**base, **kw}


def test_former_spellings_map_warn_and_never_disagree():
    group, _, knobs, mu, notes = fopts.check_options((), _given(), dict(
        ns_eps=1e-8, lr_scale="jordan", momentum_dtype=torch.bfloat16, elementwise="foreach",
        replicate_async=False))
    # param_groups[0] holds the functional core's names (the checkpoint format, which torch's
    # state-dict tools and DCP need to equal the in-memory keys)
    assert group["ns_eps"] == 1e-8 and group["lr_scale"] == "jordan"
    assert "eps" not in group and "adjust_lr_fn" not in group
    assert fopts.hparams_of_group(group).lr_scale == "jordan"
    assert knobs["elementwise"] == "foreach" and knobs["replicate_async"] is False
    assert mu == torch.bfloat16 and len(notes) == 5
    with pytest.raises(ValueError, match="different values"):
        fopts.check_options((), _given(eps=1e-6), dict(ns_eps=1e-8))
    with pytest.raises(TypeError, match="unknown"):
        fopts.check_options((), _given(), dict(bogus=1))
    with pytest.raises(ValueError, match="nothing reads"):  # a loop writing torch's key raises
        fopts.hparams_of_group({**group, "eps": 1e-6})


def test_dedicate_options_fold_the_former_keywords():
    opts, notes = fold_deprecated(None, dict(split_ns=2, data_parallel="ddp"))
    assert opts == DedicateOptions(split_ns=2, data_parallel="ddp") and len(notes) == 2
    with pytest.raises(ValueError, match="different values"):
        fold_deprecated(DedicateOptions(split_ns=3), dict(split_ns=2))
    with pytest.raises(TypeError, match="unexpected"):
        fold_deprecated(None, dict(bogus=1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("nesterov", [True, False])
def test_momentum_dtype_is_the_momentum_stage_option(dtype, nesterov):
    """In one process the stage rounds its buffers after each update (what a distributed owner
    stores), and the Nesterov input (or the momentum output) is the unrounded value."""
    from dmuon.functional import transforms as T
    g = torch.Generator().manual_seed(0)
    p = {"w": torch.randn(6, 4, dtype=torch.float64, generator=g)}
    grads = [{"w": torch.randn(6, 4, dtype=torch.float64, generator=g)} for _ in range(3)]
    stage = T.trace_momentum(0.9, nesterov, dtype=dtype)
    assert stage.momentum_dtype == dtype
    chain = variants.muon(momentum_dtype=dtype)(MuonHParams(ns_dtype=torch.float64))
    assert chain.momentum_dtype == dtype
    state, b = stage.init(p), torch.zeros(6, 4, dtype=torch.float64)
    for gr in grads:
        out, state = stage.update(gr, state, p)
        b_new = 0.9 * b + gr["w"]
        want = torch.add(gr["w"], b_new, alpha=0.9) if nesterov else b_new
        b = round_trip(b_new, dtype)
        assert torch.equal(out["w"], want)
        assert torch.equal(state.momentum["w"], b)
