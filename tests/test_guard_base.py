"""The guards' one dispatch and one allow-list (:mod:`dmuon.stateful.runtime.guard_base`), on each
guard of one process: what passes, what raises, and what each subclass adds."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from dmuon.stateful.modes.meta_init import DedicatedUninit
from dmuon.stateful.runtime.guard_base import ALLOWED, ATTRIBUTE_CALLS, LOCAL_METADATA, TorchGuard
from dmuon.stateful.runtime.guards import (DedicatedGradMarker, DedicatedParamError,
                                           DedicatedPlaceholder, TPSliceGuard, make_marker,
                                           to_placeholder, to_plain, to_tp_slice_guard)


def test_one_allow_list():
    assert ALLOWED == ATTRIBUTE_CALLS | LOCAL_METADATA and not ATTRIBUTE_CALLS & LOCAL_METADATA
    for cls in (DedicatedPlaceholder, TPSliceGuard, DedicatedGradMarker, DedicatedUninit):
        assert issubclass(cls, TorchGuard)
        assert cls.__torch_function__.__func__ is TorchGuard.__torch_function__.__func__
    assert DedicatedPlaceholder._guard_allowed is ALLOWED and TPSliceGuard._guard_allowed is ALLOWED
    assert DedicatedGradMarker._guard_allowed == ALLOWED | {"detach_"}
    assert DedicatedUninit._guard_allowed is ATTRIBUTE_CALLS


def test_placeholder_dispatch():
    p = nn.Parameter(torch.empty(0))
    p._dmuon_name, p._dedicated_owner_rank = "layers.0.w", 3
    to_placeholder(p)
    assert type(p) is DedicatedPlaceholder and isinstance(p, nn.Parameter)
    assert p.numel() == 0 and p.dim() == 1 and p.requires_grad and "Parameter" in repr(p)
    assert p.to("cpu").numel() == 0 and p.float().dtype == torch.float32  # no-op conversions
    assert p.copy_(p) is p
    with pytest.raises(DedicatedParamError, match="'layers.0.w'.*owner rank 3.*clip_grad_norm_"):
        torch.linalg.vector_norm(p)
    with pytest.raises(DedicatedParamError, match="before dmuon.dedicate_params"):
        p.double()
    to_plain(p)
    assert type(p) is nn.Parameter and p.sum().item() == 0


def test_tp_slice_guard_refuses_even_a_no_op_conversion():
    p = nn.Parameter(torch.ones(2, 2))
    p._dmuon_name = "w"
    to_tp_slice_guard(p)
    assert type(p) is TPSliceGuard and p.shape == (2, 2) and p.size(0) == 2
    for op in (lambda: p.sum(), lambda: p.to("cpu")):
        with pytest.raises(DedicatedParamError, match="outside the forward of its hook group"):
            op()


def test_marker_zeroing_and_refusal():
    p = nn.Parameter(torch.ones(2))
    zeroed = []
    m = make_marker(p, "w", lambda: zeroed.append(1))
    assert type(m) is DedicatedGradMarker and m.numel() == 0
    m.zero_()
    torch._foreach_zero_([m])
    m.detach_()
    assert zeroed == [1, 1] and m.to("cpu").numel() == 0
    with pytest.raises(DedicatedParamError, match="gradient of the dedicated param 'w'.*clip_grad_value_"):
        m.clamp_(-1, 1)
    mom = make_marker(p, "w", None, what="momentum")
    with pytest.raises(DedicatedParamError, match="optimizer.state_dict"):
        mom.add_(1)
