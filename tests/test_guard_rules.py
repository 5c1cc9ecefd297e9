"""The guards' pure rules (:mod:`dmuon.functional.guard_rules`): the full-shape answers of a
placeholder and the fix each refusal names, without any guard or process group."""
from __future__ import annotations

import torch

from dmuon.functional.guard_rules import (ALLOWED, CONVERSIONS, PASS_ON, first_instance,
                                          full_shape_query, func_name, refusal_hint)


def test_full_shape_answers():
    me = torch.empty(0)
    shape = (4, 3, 2)
    q = lambda f, *a, **k: full_shape_query(func_name(f), f, (me, *a), k, me, shape)  # noqa: E731
    assert q(torch.Tensor.size) == torch.Size(shape) and q(torch.Tensor.size, 1) == 3
    assert q(torch.Tensor.size, dim=2) == 2
    assert q(torch.Tensor.numel) == 24 and q(torch.Tensor.nelement) == 24
    assert q(torch.Tensor.dim) == 3 and q(torch.Tensor.ndimension) == 3
    assert full_shape_query("__get__", torch.Tensor.shape.__get__, (me,), {}, me, shape) == shape
    assert full_shape_query("__get__", torch.Tensor.ndim.__get__, (me,), {}, me, shape) == 3
    assert full_shape_query("__get__", torch.Tensor.dtype.__get__, (me,), {}, me, shape) is PASS_ON
    assert q(torch.Tensor.add, 1) is PASS_ON  # not a shape query
    other = torch.empty(0)  # a query about another tensor is not this guard's
    assert full_shape_query("size", torch.Tensor.size, (other,), {}, me, shape) is PASS_ON


def test_refusal_hints():
    assert refusal_hint("to", torch.Tensor.to).startswith("model.to(device / dtype) before")
    assert refusal_hint("to") == refusal_hint("add")  # a marker: no conversion hint
    assert "meta-device init" in refusal_hint("normal_", torch.nn.init.normal_)
    # a computation may come from a forward that did not run the group's hooks (session 13)
    assert "register_fsdp_forward_method" in refusal_hint("linear", torch.nn.functional.linear,
                                                          "layers.0")
    assert "the module 'layers.0'" in refusal_hint("linear", torch.nn.functional.linear, "layers.0")
    assert "call the model itself" in refusal_hint("linear", torch.nn.functional.linear, "")
    # autograd.grad / backward(inputs=) on a Z3 block matrix: Z2's local gradient, not a forward
    for name, fn in (("grad", torch.autograd.grad), ("backward", torch.autograd.backward)):
        hint = refusal_hint(name, fn, "layers.0")
        assert "reshard_after_forward=False (Z2)" in hint and "autograd.grad" in hint, hint
        assert "register_fsdp_forward_method" not in hint, hint
    assert refusal_hint("_foreach_norm").startswith("dmuon.clip_grad_norm_")
    assert refusal_hint("clamp_", torch.Tensor.clamp_).startswith("dmuon.clip_grad_value_")
    assert refusal_hint("add", torch.Tensor.add).startswith("dmuon.Muon(model, ...)")
    assert not CONVERSIONS & ALLOWED


def test_first_instance():
    class A:
        pass
    a = A()
    assert first_instance(A, (1, [2, a]), {}) is a and first_instance(A, (1,), {"x": a}) is a
    assert first_instance(A, (1, 2), {}) is None
