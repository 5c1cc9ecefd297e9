"""Every private torch API dmuon uses resolves on the installed torch (:mod:`dmuon.compat.torch_api`).

CI runs this on torch 2.13; the GPU machine on 2.11; ``bash .ci/torch-matrix 2.15.0`` on 2.15. A torch release that moves one of them fails
here, by name, instead of inside a training step.
"""
from __future__ import annotations

import pytest
import torch

from dmuon.compat import torch_api as compat


def test_installed_torch_is_supported():
    assert compat.torch_supported(), torch.__version__


def test_every_private_api_resolves():
    report = compat.private_api_report()
    missing = [k for k, ok in report.items() if not ok]
    assert not missing, f"torch {torch.__version__}: {missing}"
    assert len(report) >= 7


@pytest.mark.parametrize("version,tested,runs", [
    ("2.10.1", False, False), ("2.11.0", True, True), ("2.13.0+cpu", True, True),
    ("2.14.1", True, True), ("2.15.0", True, True), ("2.15.1+cu132", True, True),
    ("2.16.0", False, True), ("3.0.0", False, True)])
def test_supported_range(version, tested, runs):
    """Tested: the range; runs: also a newer torch (whose private APIs are checked when installed,
    tests/test_torch_newer.py)."""
    assert compat.torch_tested(version) is tested
    assert compat.torch_supported(version) is runs


def test_in_backward_and_callback():
    seen = []
    x = torch.ones(2, requires_grad=True)

    def hook(grad):
        seen.append(("hook", compat.in_backward()))
        compat.queue_backward_callback(lambda: seen.append(("end", compat.in_backward())))
        return grad

    y = (x * 2).sum()
    x.register_hook(hook)
    assert not compat.in_backward()
    y.backward()
    assert seen[0] == ("hook", True) and seen[-1][0] == "end"


def test_fsdp_param_groups_reads_both_layouts():
    class New:
        _fsdp_param_groups = ["a", "b"]

    class Old:
        _fsdp_param_group = "a"

    assert compat.fsdp_param_groups(New()) == ["a", "b"]
    assert compat.fsdp_param_groups(Old()) == ["a"]
    assert compat.fsdp_param_groups(None) == []


def test_tensor_subclass_helpers():
    class Sub(torch.Tensor):
        calls: list = []

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            cls.calls.append(getattr(func, "__name__", str(func)))
            with compat.torch_function_disabled():
                return func(*args, **(kwargs or {}))

    base = torch.zeros(3)
    s = compat.make_tensor_subclass(Sub, base)
    assert type(s) is Sub and s.data_ptr() == base.data_ptr()
    Sub.calls.clear()
    with compat.torch_function_disabled():
        s.numel()
    assert Sub.calls == []
    s.numel()
    assert Sub.calls == ["numel"]


def test_module_and_mesh_helpers():
    import collections

    lin = torch.nn.Linear(2, 3)
    slots = compat.module_param_slots(lin)
    assert set(slots) == {"weight", "bias"} and slots["weight"] is lin.weight
    handle = lin.register_state_dict_post_hook(lambda *a: None)
    assert handle.id in compat.state_dict_hooks(lin)
    Pair = collections.namedtuple("Pair", "a b")
    t = torch.ones(1)
    assert compat.tree_leaves({"x": [t, (t, 2)], "y": Pair(t, 3)}) == [t, t, 2, t, 3]
    assert compat.mesh_root(object()) is None
    assert compat.composable_replicate_applied(lin) is False
    assert compat.DDP_IGNORE_ATTR == "_ddp_params_and_buffers_to_ignore"


def test_simulate_load_reports_what_torchs_own_strict_load_reports():
    """``compat.simulate_load`` (dmuon's strict check before anything loads) against torch's own
    ``load_state_dict(strict=False)`` result, on dicts with missing, extra and renamed keys: a
    ``checkpoint_wrapper`` (its load pre-hook renames keys), a non-persistent buffer; the same keys
    but for a module that overrides ``_load_from_state_dict`` (BatchNorm: torch judges those), and
    the values each module would load are the dict's."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    def model():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4),
                                checkpoint_wrapper(torch.nn.Linear(4, 2)))
        m[0].register_buffer("scratch", torch.zeros(1), persistent=False)
        return m

    full = model().state_dict()
    cases = [dict(full), {k: v for k, v in full.items() if k != "0.weight"},
             {k: v for k, v in full.items() if k != "1.running_mean"},
             {**full, "0.extra": torch.ones(1), "9.w": torch.ones(1)},
             {k: v for k, v in full.items() if not k.startswith("2.")}]
    # BatchNorm overrides _load_from_state_dict: its own keys are torch's to judge (at the end)
    mine = lambda keys: sorted(k for k in keys if not k.startswith("1."))  # noqa: E731
    for sd in cases:
        sim = compat.simulate_load(model(), sd, "")
        want = model().load_state_dict(dict(sd), strict=False)
        assert sim.judged
        assert sorted(sim.missing) == mine(want.missing_keys), sd.keys()
        assert sorted(sim.unexpected) == mine(want.unexpected_keys), sd.keys()
    sim = compat.simulate_load(model(), full, "")
    assert sim.values["2._checkpoint_wrapped_module.weight"] is full["2.weight"]  # the renamed key
