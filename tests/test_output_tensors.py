"""Which tensors of a forward output the runtime hooks (:mod:`dmuon.functional.output_tensors`)."""
from __future__ import annotations

import dataclasses

import torch

from dmuon.compat.torch_api import tree_leaves
from dmuon.functional.output_tensors import grad_tensors


class _Plain:  # neither a pytree node nor a dataclass: its attributes are entered
    def __init__(self, loss):
        self.loss = loss


class _Slots:
    __slots__ = ("aux",)

    def __init__(self, aux):
        self.aux = aux


@dataclasses.dataclass
class _Out:
    loss: torch.Tensor
    extra: object = None


def test_grad_tensors_finds_each_tensor_requiring_grad_once():
    a, b, c = (torch.ones(2, requires_grad=True) for _ in range(3))
    frozen = torch.ones(2)
    out = {"x": [a, (a, frozen)], "y": _Out(b, _Plain(_Slots({c}))), "z": "text", "n": 3}
    got = grad_tensors(out, tree_leaves)
    assert len(got) == 3 and {id(t) for t in got} == {id(a), id(b), id(c)}
    assert grad_tensors(torch.nn.Linear(2, 2), tree_leaves) == []  # modules are not entered
    deep = a
    for _ in range(8):
        deep = _Plain(deep)
    assert grad_tensors(deep, tree_leaves) == []  # deeper than MAX_DEPTH
