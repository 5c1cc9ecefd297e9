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
"""
from __future__ import annotations

import datetime

import pytest
import torch
import torch.nn as nn
from dist_utils import run_each, run_ranks
from stateful_harness import build_dmuon
from user_paths_harness import TOL, RefMuon

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

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return (self.out_proj(x) ** 2).mean()


def _skipping(layer, n=3, ranks=(1,), forward_only=False):
    """``layers[layer]`` returns its input on the ``ranks`` only, from the second step on
    (``forward_only``: also in a forward with gradients whose loss no backward uses, before each
    step's zero_grad)."""
    def path(env):
        import dmuon
        torch.manual_seed(0)
        model = _Model(n=n).double()
        g = torch.Generator().manual_seed(1)
        data = [torch.randn(4, 8, generator=g, dtype=torch.float64) for _ in range(STEPS)]
        if env["dist"]:
            model, opt = build_dmuon(env["rank"], WORLD, model, model.layers,
                                     {"z3": True, "predicate": lambda n, p: p.ndim == 2},
                                     options=dmuon.DedicateOptions(
                                         timeout=datetime.timedelta(seconds=10)))
        else:
            opt = RefMuon(model, lambda n, p: p.ndim == 2)
        for i, x in enumerate(data):
            if forward_only and env["dist"]:
                model.layers[layer].skip = i > 0 and env["rank"] in ranks
                model(x.chunk(WORLD)[env["rank"]])  # an evaluation without no_grad: no backward
            opt.zero_grad()
            for r in [env["rank"]] if env["dist"] else range(WORLD):
                model.layers[layer].skip = i > 0 and r in ranks
                (model(x.chunk(WORLD)[r]) / (1 if env["dist"] else WORLD)).backward()
            opt.step()
        return dmuon.get_model_state_dict(model) if env["dist"] else model.state_dict()
    return path


PATHS = {"last": _skipping(2), "first": _skipping(0), "only": _skipping(0, n=1),
         "every_rank": _skipping(0, ranks=(0, 1)), "forward_only": _skipping(0, forward_only=True)}


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
