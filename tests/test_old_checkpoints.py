"""Checkpoints written by an older dmuon (f573449, before the one owner driver and torch's option
names) still load, in both formats, and training resumes bitwise as the older code resumed it
(issue 45: "today's checkpoints of plain Muon still load").

``tests/data/old_checkpoints.pt`` was written by ``tests/data/make_old_checkpoints.py`` run at
that commit: plain Muon and NorMuon after 2 of 4 steps, as dmuon's full optimizer dict and as
torch's protocol (a full state dict through ``torch.distributed.checkpoint.state_dict``), and the
weights that commit reached after the last 2 steps. ``param_groups[0]`` keeps the functional
core's names (``ns_eps``, ``lr_scale``) while the constructor speaks torch's: torch's tools load
into the current optimizer's keys, so renamed keys would break these checkpoints.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_utils import run_ranks

DATA = Path(__file__).resolve().parent / "data"


def _worker(rank: int, world: int) -> dict:
    import sys
    sys.path.insert(0, str(DATA))
    from make_old_checkpoints import build, train
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    import dmuon
    from models import make_batches
    old = torch.load(DATA / "old_checkpoints.pt", weights_only=False)
    batches = make_batches(old["steps"], old["batch"])
    out = {}
    for kind in ("muon", "normuon"):
        for fmt in ("optim_full", "optim_torch"):
            model, opt = build(rank, world, kind)
            dmuon.set_model_state_dict(model, old[kind]["model"])
            if fmt == "optim_full":
                dmuon.set_optimizer_state_dict(model, opt, old[kind][fmt])
            else:
                set_optimizer_state_dict(model, opt, old[kind][fmt],
                                         options=StateDictOptions(full_state_dict=True))
            g = opt.param_groups[0]
            keys = ("eps" in g, "adjust_lr_fn" in g, g["ns_eps"], g["lr_scale"])
            train(model, opt, rank, world, batches[2:])
            got = dmuon.get_model_state_dict(model, cpu_offload=True)
            want = old[kind]["final"]
            out[(kind, fmt)] = (keys, sorted(got) == sorted(want) and all(
                torch.equal(got[k], want[k]) for k in want))
    return out


@pytest.mark.skipif(not (DATA / "old_checkpoints.pt").exists(), reason="fixture missing")
def test_older_checkpoints_load_and_resume_bitwise():
    for r in run_ranks(_worker, 2, timeout=120):
        for case, (keys, equal) in r.items():
            assert keys == (False, False, 1e-7, "moonlight"), (case, keys)
            assert equal, case
