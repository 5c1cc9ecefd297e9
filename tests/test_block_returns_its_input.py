"""A block that returns its input unchanged on one rank only (``if rank == 1 and skip: return x``):
2 gloo ranks, fp64, Z3, one spawn (slow tier); equal to one process with ``RefMuon`` (each
rank's half of the batch through the model as that rank runs it) to <= 1e-10, or a clear error on
every rank.

On the rank that skips, the block's output is the previous block's output: the same tensor carries
both groups' pre-backward hooks, which torch runs in the order they were registered (the earlier
block's first), so that rank re-gathered the two groups in the opposite order of the other rank.
Before (measured): both ranks waited in different re-gathers until dmuon's timeout ("the weight
gather ... 'regather:unshard/layers.2' ... A timeout means a rank of [0, 1] never reached it ...",
10 s here), naming no cause.

The first block returning the model's input (a tensor that needs no gradient) on one rank only is
another edge: that rank finds no tensor to hook and keeps the group gathered through the backward,
while the other rank frees it and re-gathers it. Before (measured): a gather timeout. Now that rank
joins the re-gather (where a later block prefetches it, or at the backward's end) and the next
forward's gather.

A block run under ``torch.no_grad()`` or on a detached input on one rank only cuts that rank's
backward before the earlier blocks (measured by a user-path review: a gather timeout). Every Z3
group a forward gathered is now re-gathered once in each backward: where the rank's backward did
not reach it, at the backward's end, before its reduces.
"""
from __future__ import annotations


import pytest
import torch
import torch.nn as nn
from dist_utils import run_each, run_ranks
from user_paths_harness import TOL, matrices_model

pytestmark = pytest.mark.slow

WORLD, STEPS = 2, 2


class _Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.up_proj = nn.Linear(dim, dim, bias=False)
        self.skip = False

    def forward(self, x):
        return x if self.skip else x + torch.tanh(self.up_proj(x))


class _Model(nn.Module):
    def __init__(self, dim=8, n=3):
        super().__init__()
        self.layers = nn.ModuleList(_Block(dim) for _ in range(n))
        self.out_proj = nn.Linear(dim, dim, bias=False)
        self.cut = (-1, "")  # (block, "no_grad" | "detach"): its output / input carries no grad

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            how = self.cut[1] if i == self.cut[0] else ""
            if how == "no_grad":
                with torch.no_grad():
                    x = layer(x)
            else:
                x = layer(x.detach() if how == "detach" else x)
        return (self.out_proj(x) ** 2).mean()


def _skipping(layer, n=3, ranks=(1,), forward_only=False, how="skip"):
    """``layers[layer]`` returns its input on the ``ranks`` only, from the second step on
    (``forward_only``: also in a forward with gradients whose loss no backward uses, before each
    step's zero_grad); ``how="no_grad"`` / ``"detach"``: it runs under ``torch.no_grad()`` / on
    a detached input there instead (the backward of that rank never reaches the blocks before)."""
    def path(env):
        import dmuon
        torch.manual_seed(0)
        model = _Model(n=n).double()
        g = torch.Generator().manual_seed(1)
        data = [torch.randn(4, 8, generator=g, dtype=torch.float64) for _ in range(STEPS)]
        model, opt = matrices_model(model, env, WORLD)
        def odd(on):
            if how == "skip":
                model.layers[layer].skip = on
            else:
                model.cut = (layer, how) if on else (-1, "")
        for i, x in enumerate(data):
            if forward_only and env["dist"]:
                odd(i > 0 and env["rank"] in ranks)
                model(x.chunk(WORLD)[env["rank"]])  # an evaluation without no_grad: no backward
            opt.zero_grad()
            for r in [env["rank"]] if env["dist"] else range(WORLD):
                odd(i > 0 and r in ranks)
                (model(x.chunk(WORLD)[r]) / (1 if env["dist"] else WORLD)).backward()
            opt.step()
        return dmuon.get_model_state_dict(model) if env["dist"] else model.state_dict()
    return path


PATHS = {"last": _skipping(2), "first": _skipping(0), "only": _skipping(0, n=1),
         "every_rank": _skipping(0, ranks=(0, 1)), "forward_only": _skipping(0, forward_only=True),
         "no_grad": _skipping(1, how="no_grad"), "no_grad_last": _skipping(2, how="no_grad"),
         "detach": _skipping(2, how="detach")}


def _worker(rank, world):
    return run_each(PATHS, {"dist": True, "rank": rank, "world": world})


@pytest.fixture(scope="module")
def results():
    return run_ranks(_worker, WORLD, timeout=120)


def _check(results, key):
    ref = PATHS[key]({"dist": False})
    for rank, out in enumerate(results):
        assert "error" not in out[key], (rank, out[key]["error"][:1500])
        for k, v in ref.items():
            assert float((out[key][k] - v).abs().max()) <= TOL, (rank, k)



def test_a_block_returning_its_input_on_one_rank_only_equals_one_process(results):
    _check(results, "last")


def test_the_first_block_returning_the_models_input_on_one_rank_only(results):
    _check(results, "first")


def test_the_only_block_returning_the_models_input_on_one_rank_only(results):
    """No later block's backward prefetches its re-gather: the rank joins at the backward's end."""
    _check(results, "only")


def test_the_first_block_returning_the_models_input_on_every_rank(results):
    """Every rank keeps the group gathered: the joined re-gathers run on every rank or on none
    (passes without the fix too: it guards the fix)."""
    _check(results, "every_rank")


def test_a_forward_whose_loss_no_backward_uses_then_training(results):
    """The rank that kept the block gathered still runs the next forward's gather."""
    _check(results, "forward_only")


@pytest.mark.parametrize("key", ["no_grad", "no_grad_last", "detach"])
def test_a_block_under_no_grad_or_on_a_detached_input_on_one_rank_only(results, key):
    """That rank's backward never reaches the blocks before it: it re-gathers them at the
    backward's end, as the other rank's backward does on its way (before: a gather timeout)."""
    _check(results, key)
