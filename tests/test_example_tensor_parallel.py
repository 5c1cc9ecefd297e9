"""``examples/tensor_parallel.py`` runs in both orders on 4 gloo ranks: the loss falls, the TP
gathers / scatters move bytes, and the state dict holds full matrices (slow tier)."""
from __future__ import annotations

import importlib.util
import pathlib

import pytest

from dist_utils import run_ranks

_PATH = pathlib.Path(__file__).resolve().parents[1] / "examples" / "tensor_parallel.py"


def _main(rank: int, world: int, order: str) -> dict:
    spec = importlib.util.spec_from_file_location("tp_example", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main(order, steps=30, verbose=False)


@pytest.mark.slow
@pytest.mark.parametrize("order", ["A", "B"])
def test_tensor_parallel_example(order):
    res = run_ranks(_main, 4, order, timeout=180)
    for out in res:
        assert out["losses"][-1] < 0.5 * out["losses"][0], out["losses"]
        assert out["tp_bytes"] > 0
        assert out["shapes"]["layers.0.q_proj.weight"] == (64, 64)
        assert out["shapes"]["layers.1.down_proj.weight"] == (64, 128)
