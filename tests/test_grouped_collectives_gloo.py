"""The grouped collective style (``dedicate_params(collectives="grouped")``) on real gloo meshes.

A hook group's per-owner broadcasts (forward gather, Z3 re-gather, HSDP publish) and its per-owner
reduces are each one NCCL group on CUDA (all-gather-v / reduce-v semantics, no padding); gloo runs
the group's parts one after another. Checked, fp64, in the slow tier (one spawned group per world
size):

* training equals the single-process reference (<= 1e-10 relative) and the per-owner style
  bitwise (the same reductions in the same order);
* the executor's gloo counters equal the step program's traffic and the per-owner run's (the same
  bytes: nothing is padded);
* the program records the style per hook group;
* 2 ranks: Z3 and Z2; 4 ranks: HSDP 2 x 2 Z3 (grouped stage-2 reduces and publish).
"""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_ranks
from stateful_harness import max_rel_err
from test_bucket_collectives_gloo import STEPS, _check, _styles, _worker

pytestmark = pytest.mark.slow


def _same_as_per_owner(results: list, pairs: list[tuple[str, str]]) -> None:
    for out in results:
        for po, gr in pairs:
            assert _styles(out[gr]) == {"grouped"}, out[gr].get("collective_reasons")
            assert _styles(out[po]) == {"per_owner"}
            a, b = out[po]["sd"], out[gr]["sd"]
            assert all(torch.equal(a[k], b[k]) for k in a), max_rel_err(b, a)
            assert out[gr]["counters"] == out[po]["counters"], (gr, out[gr]["counters"])


CFG_2 = [dict(id="per_owner_z3", steps=STEPS, dedicate_kw={"collectives": "per_owner"}),
         dict(id="grouped_z3", steps=STEPS, dedicate_kw={"collectives": "grouped"}),
         dict(id="per_owner_z2", steps=STEPS, z3=False, dedicate_kw={"collectives": "per_owner"}),
         dict(id="grouped_z2", steps=STEPS, z3=False, dedicate_kw={"collectives": "grouped"})]


def test_grouped_two_ranks_z3_z2_equal_reference_and_per_owner_bytes():
    results = run_ranks(_worker, 2, CFG_2, timeout=300)
    _check(results, CFG_2)
    _same_as_per_owner(results, [("per_owner_z3", "grouped_z3"), ("per_owner_z2", "grouped_z2")])


CFG_4 = [dict(id="hsdp_per_owner_z3", steps=STEPS, hsdp=True, batch=8,
              dedicate_kw={"collectives": "per_owner"}),
         dict(id="hsdp_grouped_z3", steps=STEPS, hsdp=True, batch=8,
              dedicate_kw={"collectives": "grouped"})]


def test_grouped_hsdp_two_by_two_equals_reference_and_per_owner_bytes():
    results = run_ranks(_worker, 4, CFG_4, timeout=300)
    _check(results, CFG_4)
    _same_as_per_owner(results, [("hsdp_per_owner_z3", "hsdp_grouped_z3")])
