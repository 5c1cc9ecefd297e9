"""The optimizer's pure decisions (no process group): the owner driver's chain checks
(:mod:`dmuon.functional.owner_checks`), the step's verdicts (:mod:`dmuon.functional.step_checks`),
the momentum step's chunks (:mod:`dmuon.functional.momentum_chunks`), a step's lane counts
(:mod:`dmuon.functional.step_stats`) and the AdamW moments' storage
(:mod:`dmuon.functional.adamw_storage`)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch


def test_owner_checks():
    from dmuon.functional import owner_checks as oc
    from dmuon.functional import variants
    from dmuon.functional.matrix_view import Batch
    from dmuon.functional.muon import MuonHParams
    from dmuon.functional.state_fields import state_fields

    assert oc.is_muon(None) and oc.is_muon(variants.muon()) and not oc.is_muon(variants.normuon())
    oc.refuse_variant(False, "dmuon.save_sharded")  # Muon itself: every path carries its state
    with pytest.raises(NotImplementedError, match="dmuon.save_sharded does not carry the state"):
        oc.refuse_variant(True, "dmuon.save_sharded")
    with pytest.raises(TypeError, match="transform must be"):
        oc.check_transform(3)
    chain = variants.muon()(MuonHParams())
    meta = oc.meta_state(chain, {"w": Batch(0)}, {"w": (4, 3)}, {"w": torch.float32})
    fields = state_fields(meta)
    assert [f.key for f in fields] == ["momentum_buffer"]
    oc.check_fields(fields, meta, {"w": (4, 3)}, {"w": torch.float32})
    with pytest.raises(ValueError, match="the param's shape"):
        oc.check_fields(fields, meta, {"w": (4, 4)}, {"w": torch.float32})
    with pytest.raises(ValueError, match="fixed Transform"):
        oc.check_chain(chain, True, {"w": (0.5, 1.0)}, {})
    oc.check_chain(chain, False, {"w": (0.5, 1.0)}, {"w": SimpleNamespace(dim=1)})  # Muon: sums
    with pytest.raises(ValueError, match="no momentum stage"):
        oc.check_stored_field(None, torch.bfloat16, False)
    oc.check_fixed_hparams((1.0, 2), (1.0, 2))
    with pytest.raises(RuntimeError, match="hyper-parameters changed"):
        oc.check_fixed_hparams((1.0, torch.ones(1)), (1.0, torch.ones(1)))


def test_step_verdicts():
    from dmuon.functional import step_checks as sc

    sc.check_step_ready(True, True)
    with pytest.raises(RuntimeError, match="newer dmuon.Muon"):
        sc.check_step_ready(False, True)
    with pytest.raises(RuntimeError, match="no fresh gradient"):
        sc.check_step_ready(True, False)
    sc.check_grads_on_all_ranks(["a", "b"], [0, 2], 2)
    with pytest.raises(RuntimeError, match=r"\['b'\] have a gradient on some ranks only"):
        sc.check_grads_on_all_ranks(["a", "b"], [2, 1], 2)
    sc.check_finite_flags(torch.zeros(2, 3), [])
    flags = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    with pytest.raises(FloatingPointError, match=r"ranks \[1\].*ranks \[2\].*here: \['g'\]"):
        sc.check_finite_flags(flags, [("g", torch.tensor([float("nan")])), ("h", torch.ones(1))])
    p = SimpleNamespace(grad=torch.ones(1))
    with pytest.raises(RuntimeError, match=r"params \['x'\] were frozen"):
        sc.check_outside_grads([("x", p), ("y", SimpleNamespace(grad=None))])


def test_launch_fingerprints():
    """Equal sequences give equal fingerprints; a swapped, missing or extra launch on one rank
    makes the pre-step sums say so (with the sums' int64 bound kept)."""
    from dmuon.functional.step_checks import LAUNCH_PRIME, fold_launch, launches_differ

    def fp(labels):
        h = 0
        for label in labels:
            h = fold_launch(h, label)
        return h

    seq = ["gather:layers.0", "gather:layers.1", "regather:layers.1", "regather:layers.0"]
    assert fp(list(seq)) == fp(seq)
    swapped, missing, extra = seq[:2] + seq[:1:-1], seq[:-1], seq + ["gather:layers.0"]
    for world in (2, 3, 8, 1024):
        hs = [fp(seq)] * world
        assert launches_differ(sum(hs), sum(h * h for h in hs), world) is None
        for diff in (swapped, missing, extra):
            hs = [fp(seq)] * (world - 1) + [fp(diff)]
            assert fp(diff) != fp(seq)
            msg = launches_differ(sum(hs), sum(h * h for h in hs), world)
            assert msg is not None and "launched different sequences" in msg
    assert all(0 <= fp([str(i)]) < LAUNCH_PRIME for i in range(100))
    assert 1024 * (LAUNCH_PRIME - 1) ** 2 < 2 ** 63  # the all-reduce's int64 holds the sums


def test_failed_step_verdicts():
    """A step that raised (issue 46): ``[ranks failed, ranks changed]`` decides whether it can be
    retried (every rank failed before anything changed) or marks the optimizer broken; a broken
    optimizer's step raises first, naming the failure and the loads that clear it."""
    from dmuon.functional import step_checks as sc

    assert not sc.step_broken([0, 2]) and not sc.step_broken([2, 0])  # clean / all retryable
    assert sc.step_broken([1, 1]) and sc.step_broken([2, 1]) and sc.step_broken([1, 2])
    msg = sc.broken_step_message("rank(s) [0]: OutOfMemoryError: x")
    for needle in ("rank(s) [0]: OutOfMemoryError: x", "Muon.load_state_dict",
                   "set_optimizer_state_dict", "load_sharded", "set_model_state_dict"):
        assert needle in msg
    with pytest.raises(RuntimeError, match="refused, nothing was updated: a dmuon.Muon.step"):
        sc.check_step_ready(False, False, msg)  # before the other verdicts
    sc.check_not_broken(None, "a save")
    with pytest.raises(RuntimeError, match="a save: refused"):
        sc.check_not_broken(msg, "a save")
    t, u = torch.zeros(3), torch.ones(2)
    before = sc.write_count({"a": t}, [u, None], 3)
    assert sc.write_count({"a": t}, [u, None], 3) == before
    t.add_(1)  # an in-place write moves the count; a read does not
    u.sum()
    assert sc.write_count({"a": t}, [u, None], 3) == before + 1


def test_step_chunks_and_lane_delta():
    from dmuon.functional.momentum_chunks import step_chunks, within_room
    from dmuon.functional.step_stats import lane_delta

    nbytes = {"a": 4, "b": 4, "c": 10, "d": 2}
    # staged first (in staging order), then the rest in order; a larger matrix alone
    assert step_chunks(["a", "b", "c", "d"], ["d", "x"], nbytes, 8) == [[3, 0], [1], [2]]
    assert step_chunks(["a", "b"], [], nbytes, 100) == [[0, 1]]
    # the copies ahead of the step: in order, up to the first that does not fit (d would fit)
    assert within_room(nbytes, 9) == ["a", "b"] and within_room(nbytes, 20) == list(nbytes)
    assert within_room(nbytes, 3) == [] and within_room({}, 0) == []
    now = {"reduce": {"collectives": 5, "sent_bytes": 10}, "tp": {"collectives": 1}}
    prev = {"reduce": {"collectives": 2, "sent_bytes": 4}}
    assert lane_delta(now, prev) == {"reduce": {"collectives": 3, "sent_bytes": 6},
                                     "tp": {"collectives": 1}}


def test_adamw_storage_rounds_into_its_buffers():
    from dmuon.functional import adamw as fadamw
    from dmuon.functional.adamw_storage import AdamWStorage

    with pytest.raises(ValueError, match="8-bit float"):
        AdamWStorage(torch.float8_e4m3fn)
    params = {"w": torch.zeros(3)}
    st = AdamWStorage(torch.bfloat16)
    stored = st.stored_state(fadamw.init(params))
    assert stored.mu["w"].dtype == torch.bfloat16
    work = st.working_state(stored, params)
    assert work.mu["w"].dtype == torch.float32
    work = work._replace(mu={"w": torch.tensor([1.0 + 2 ** -10, 2.0, 3.0])})
    out = st.commit_state(stored, work)
    assert out.mu["w"] is stored.mu["w"] and out.mu["w"].tolist() == [1.0, 2.0, 3.0]
    fp32 = AdamWStorage(None)
    s32 = fadamw.init(params)
    assert fp32.stored_state(s32) is s32 and fp32.working_state(s32, params) is s32


def test_hyper_parameter_fingerprints_read_values_as_data():
    """Equal values give equal fingerprints whatever their Python or numpy type, a function kept
    in a group counts by its type (its repr's address differs by process), the params are not
    part of it; a changed value changes it (``dmuon.Muon.step``'s pre-step agreement)."""
    import numpy as np

    from dmuon.functional.step_checks import all_equal, hparams_fingerprint
    a = [{"params": [1], "lr": 0.02, "betas": (0.9, 0.99), "n": 5, "fn": lambda x: x}]
    b = [{"params": [2, 3], "lr": np.float64(0.02), "betas": [0.9, np.float64(0.99)],
          "n": np.int64(5), "fn": lambda y: y}]
    assert hparams_fingerprint(a) == hparams_fingerprint(b)
    assert hparams_fingerprint(a) != hparams_fingerprint([{**a[0], "lr": 0.020000000000000004}])
    h, k = hparams_fingerprint(a), hparams_fingerprint(b) + 1
    assert all_equal(2 * h, 2 * h * h, 2) and not all_equal(h + k, h * h + k * k, 2)
