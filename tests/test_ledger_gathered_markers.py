"""The ledger's ``.grad`` marker on a matrix kept gathered across a ``no_sync`` backward (every hook
group in Z2, the root group in Z3), in one process (the default tier's cheap check of
``tests/test_user_paths_review5.py``'s slow ``model.zero_grad()`` paths): a marker of the matrix's
own shape (zero strides), which ``model.zero_grad()`` / ``p.grad = None`` drops and
``zero_grad(set_to_none=False)`` zeroes before the next gather; none where this rank has no
gradient, none while a ``create_graph`` graph could still accumulate into ``.grad``."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from dmuon.stateful.runtime.guards import DedicatedGradMarker
from dmuon.stateful.runtime.ledger import GradLedger, Held


def _gathered():
    model = nn.Linear(3, 2, bias=False).double()  # a gathered matrix: a full plain tensor
    return model, GradLedger({"w": model.weight}, ["w"], lambda n: False, lambda: None)


@pytest.mark.parametrize("drop", ["model.zero_grad()", "set_to_none=False", "p.grad = None"])
def test_zero_grad_drops_or_zeroes_a_gathered_matrix_gradient(drop):
    model, ledger = _gathered()
    ledger.show_markers(["w"])  # no gradient on this rank: nothing to show
    assert model.weight.grad is None
    ledger.add_local("w", torch.ones(2, 3, dtype=torch.float64))  # a no_sync micro-batch
    ledger.show_markers(["w"])
    marker = model.weight.grad
    assert type(marker) is DedicatedGradMarker
    assert tuple(marker.shape) == (2, 3) and marker.stride() == (0, 0)
    if drop == "p.grad = None":
        model.weight.grad = None
    else:
        model.zero_grad(set_to_none=drop != "set_to_none=False")
    ledger.take_markers(["w"])  # the next forward's gather
    rec = ledger.records["w"]
    assert model.weight.grad is None
    if drop == "set_to_none=False":
        assert rec.state is Held.LOCAL and float(rec.local.abs().max()) == 0.0
    else:
        assert rec.state is Held.NONE and rec.local is None


def test_a_kept_marker_keeps_the_gradient_and_create_graph_shows_none():
    model, ledger = _gathered()
    ledger.add_local("w", torch.ones(2, 3, dtype=torch.float64))
    ledger.show_markers(["w"], gathered=False)  # a create_graph backward's gathered copy
    assert model.weight.grad is None
    ledger.show_markers(["w"])
    ledger.take_markers(["w"])
    assert model.weight.grad is None and torch.equal(ledger.records["w"].local,
                                                     torch.ones(2, 3, dtype=torch.float64))
