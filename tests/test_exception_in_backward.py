"""An exception raised inside a backward on every rank (an out-of-memory error, a user's check in a
tensor hook), caught by the loop, the batch skipped: 2 gloo ranks, fp64, Z3 and Z2, a model whose
params are all dedicated (slow tier). Equal to one process that never saw the batch.

torch drops the callback a backward queued when the backward raises, so dmuon's end of backward
never ran. Before (measured): every later backward raised "a gradient of layers.2.up_proj.weight
arrived after the reduce of its hook group 'layers.2' was launched in this backward", so the run
could not go on. Now the next forward closes that backward first (``on_backward_end(raised=True)``).

FSDP2's own params are outside this test: plain FSDP2 with ``torch.optim.AdamW`` (no dmuon) ends
2.0e-2 away from one process after the same caught exception (torch 2.13, measured): FSDP2's
state is left mid-backward as well.
"""
from __future__ import annotations


import pytest
import torch
from dist_utils import run_ranks
from test_block_returns_its_input import _Model
from user_paths_harness import TOL, matrices_model

pytestmark = pytest.mark.slow

WORLD, AT, STEPS = 2, 1, 4


class _Bad(Exception):
    pass


def _train(env, z3=True):
    import dmuon
    torch.manual_seed(0)
    model = _Model().double()
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(4, 8, generator=g, dtype=torch.float64) for _ in range(STEPS)]
    model, opt = matrices_model(model, env, WORLD, z3)
    step, caught = [0], []

    def raise_in_backward(module, args, output):  # after layers.2's backward and reduce
        if step[0] == AT and env["dist"]:
            output.register_hook(lambda grad: (_ for _ in ()).throw(_Bad("bad backward")))
    model.layers[1].register_forward_hook(raise_in_backward)
    for i, x in enumerate(data):
        step[0] = i
        if i == AT and not env["dist"]:
            continue
        opt.zero_grad()
        try:
            for r in [env["rank"]] if env["dist"] else range(WORLD):
                (model(x.chunk(WORLD)[r]) / (1 if env["dist"] else WORLD)).backward()
        except _Bad:
            caught.append(i)
            continue
        opt.step()
    sd = dmuon.get_model_state_dict(model) if env["dist"] else model.state_dict()
    return {"sd": {k: v.detach().clone() for k, v in sd.items()}, "caught": caught}


def _worker(rank, world):
    out = {}
    for z3 in (True, False):
        try:
            out[z3] = _train({"dist": True, "rank": rank}, z3)
        except Exception as e:  # noqa: BLE001 - reported per mode
            out[z3] = {"error": f"{type(e).__name__}: {e}"}
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_worker, WORLD, timeout=120)


@pytest.mark.parametrize("z3", [True, False], ids=["z3", "z2"])
def test_an_exception_inside_the_backward_caught_then_next_batch_equals_one_process(results, z3):
    ref = _train({"dist": False})["sd"]
    for rank, out in enumerate(results):
        got = out[z3]
        assert "error" not in got, (rank, got["error"][:1500])
        assert got["caught"] == [AT]
        for k, v in ref.items():
            assert float((got["sd"][k] - v).abs().max()) <= TOL, (rank, k)
