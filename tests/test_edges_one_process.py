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


def _layer_drop(rank, world, z3):
    import dmuon
    torch.manual_seed(0)
    model = _LayerDrop().double()
    if world:
        model, opt = build_dmuon(rank, world, model, model.layers,
                                 {"z3": z3, "predicate": lambda n, p: p.ndim == 2})
    else:
        opt = RefMuon(model, lambda n, p: p.ndim == 2)
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
    ref = _layer_drop(0, 0, z3)
    for got in run_threads(_layer_drop, 2, z3):
        assert max(float((got[k] - v).abs().max()) for k, v in ref.items()) <= TOL
