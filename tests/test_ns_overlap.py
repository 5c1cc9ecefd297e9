"""Owner NS overlapped with the backward: the pure decisions (:mod:`dmuon.functional.ns_overlap`),
default tier (< 1 s). The gloo equality runs are in ``test_ns_overlap_gloo.py`` (slow tier)."""
from __future__ import annotations

import pytest
import torch

from dmuon.functional import ns_overlap as O


def _stamp(**kw):
    base = dict(hparams=O.stamp_key((0.02, 0.95, True, 0.0)), steps=3, reduces=0,
                grads=(("a", (1, 0)),), writes=7)
    base.update(kw)
    return O.Stamp(**base)


def test_valid_when_nothing_changed():
    assert O.invalid_reason(_stamp(), _stamp()) is None


@pytest.mark.parametrize("change, word", [
    (dict(steps=4), "step"),
    (dict(reduces=1), "accumulation"),
    (dict(grads=(("a", (1, 1)),)), "gradient"),        # clipped / scaled in place
    (dict(grads=(("a", None),)), "gradient"),          # dropped (zero_grad)
    (dict(hparams=O.stamp_key((0.01, 0.95, True, 0.0))), "hyper-parameters"),
    (dict(writes=8), "state"),
])
def test_invalid_on_every_change(change, word):
    why = O.invalid_reason(_stamp(), _stamp(**change))
    assert why is not None and word in why


def test_stamp_key_tensor_lr_by_identity_and_version():
    lr = torch.tensor(0.02)
    k0 = O.stamp_key((lr, 0.95))
    assert O.stamp_key((lr, 0.95)) == k0
    lr.mul_(0.5)  # the same tensor written in place: another lr
    assert O.stamp_key((lr, 0.95)) != k0


def test_mode_decision():
    assert O.resolve_mode("off", None, "cuda")[0] == "off"
    assert O.resolve_mode("on", None, "cpu")[0] == "on"  # gloo exercises the speculation
    assert O.resolve_mode("auto", None, "cpu")[0] == "off"
    assert O.resolve_mode("auto", None, "cuda")[0] == "auto"
    for kw in (dict(tensor_parallel=True, split_ns=False, stored_momentum=None),
               dict(tensor_parallel=False, split_ns=True, stored_momentum=None),
               dict(tensor_parallel=False, split_ns=False, stored_momentum="offload"),
               dict(tensor_parallel=False, split_ns=False, stored_momentum=None, own_chain=True)):
        why = O.overlap_blocker(**kw)
        mode, reason = O.resolve_mode("on", why, "cuda")
        assert why and mode == "off" and why in reason
    with pytest.raises(ValueError, match="set_ns_overlap"):
        O.check_mode("yes")


def test_early_names_and_auto_choice():
    assert O.early_names({"a": True, "b": False, "c": True}, {"c": 0.5}) == ["a"]
    assert O.auto_choice([10, 11, 12], [9, 9.5, 13]) is True
    assert O.auto_choice([10, 10, 10], [10, 10, 10]) is False
    assert O.auto_choice([], [1.0]) is False


def test_replay_key():
    """A group's early update is replayed as a CUDA graph only under the same key (what a graph
    bakes in: hyper-parameters, gradients' and live tensors' storage); never where it reads the
    step (a schedule, a step count in the chain's state)."""
    g = torch.zeros(3)
    s = O.take_stamp((0.02, 0.95, "fused", 7), 3, 0, ["w"], {"w": g}, [[{"w": g}]])
    k = O.replay_key(s, [1, 2], [torch.zeros(4, 4)])
    assert k is not None and k == O.replay_key(s._replace(steps=9, writes=5), [1, 2], [])
    assert k != O.replay_key(s, [1, 3], [])  # a live tensor replaced (a load): another key
    assert k != O.replay_key(s._replace(hparams=O.stamp_key((0.01, 0.95, "fused", 7))), [1, 2], [])
    assert k != O.replay_key(s._replace(grads=(("w", (g.data_ptr() + 4, 0)),)), [1, 2], [])
    assert O.replay_key(s, [1, 2], [torch.tensor(3.0, dtype=torch.float64)]) is None  # a count
    sched = O.take_stamp(((lambda t: 0.02 / (1 + t), 0.95), "fused"), 3, 0, ["w"], {"w": g}, [])
    assert O.replay_key(sched, [1], []) is None  # an lr schedule, nested in the hparams


def test_live_tensors_lists_what_an_update_reads():
    """dmuon.functional.speculation.live_tensors (pure): the per-param state of ``names``, field
    by field, then their masters; the live tensors themselves (a stamp's inputs), in that order."""
    from types import SimpleNamespace

    from dmuon.functional.speculation import live_tensors

    mu, nu, w = ({n: torch.zeros(2) for n in "abc"} for _ in range(3))
    state = (SimpleNamespace(mu=mu), nu)  # a field at (index, attribute) and one at an index
    fields = [SimpleNamespace(path=(0, "mu")), SimpleNamespace(path=(1,))]
    got = live_tensors(state, fields, w, ["c", "a"])
    want = [mu["c"], mu["a"], nu["c"], nu["a"], w["c"], w["a"]]
    assert len(got) == len(want) and all(g is x for g, x in zip(got, want))
    assert live_tensors(state, fields, w, []) == []
