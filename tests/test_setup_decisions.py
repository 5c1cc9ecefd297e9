"""The pure decisions ``dedicate_params`` and the modes take (no process group): the selection and
its checks, the options' values, DDP mode's grid."""
from __future__ import annotations

import pytest
import torch

from dmuon.functional.dedicate_options import check_data_parallel, split_settings
from dmuon.functional.selection import check_materialized, select_params
from dmuon.functional.setup_check import ddp_grid


def _named():
    return [("w", torch.zeros(4, 3)), ("b", torch.zeros(4)), ("v", torch.zeros(2, 2))]


def test_select_params_picks_matrices_and_refuses_bad_predicates():
    got = select_params(_named(), lambda n, p: p.ndim == 2, "Net")
    assert list(got) == ["w", "v"]
    with pytest.raises(TypeError, match="predicate must be a callable"):
        select_params(_named(), None, "Net")
    with pytest.raises(ValueError, match="'b' of shape \\(4,\\), which is not a matrix"):
        select_params(_named(), lambda n, p: True, "Net")
    with pytest.raises(ValueError, match="matched no trainable parameter of Net"):
        select_params(_named(), lambda n, p: False, "Net")
    with pytest.raises(RuntimeError, match="predicate raised KeyError: 'x' for param 'w'"):
        select_params(_named(), lambda n, p: {}["x"], "Net")
    mixed = [("w", torch.zeros(4, 3)), ("m", torch.zeros(4, 3, device="meta"))]
    with pytest.raises(ValueError, match="some selected params are on the meta device"):
        select_params(mixed, lambda n, p: True, "Net")


def test_check_materialized_names_meta_params():
    check_materialized({"w": torch.zeros(2, 2)})
    with pytest.raises(RuntimeError, match="\\['m'\\] are still on the meta device"):
        check_materialized({"w": torch.zeros(2, 2), "m": torch.zeros(2, 2, device="meta")})


def test_option_values():
    assert check_data_parallel("ddp") == "ddp"
    with pytest.raises(ValueError, match="data_parallel must be one of"):
        check_data_parallel("DDP")
    assert split_settings(3) == (3, None) and split_settings({}) == (2, None)
    assert split_settings({"a": 4, "b": 2}) == (4, {"a": 4, "b": 2})
    with pytest.raises(ValueError, match="split_ns must be an int >= 1"):
        split_settings(0)


def test_ddp_grid_is_one_shard_of_world_replicas():
    assert ddp_grid(((0, 1, 2),)) == ((0,), (1,), (2,))
    with pytest.raises(ValueError, match="2-D / HSDP layout of 2 x 2"):
        ddp_grid(((0, 1), (2, 3)))


def test_boundary_groups_put_tied_params_across_boundaries_in_the_root_group():
    from dmuon.functional.buckets import ROOT_GROUP, boundary_groups
    aliases = {"layers.0.a.weight": ["layers.0.a.weight"],
               "layers.1.b.weight": ["layers.1.b.weight"],
               "embed.weight": ["embed.weight", "layers.1.head.weight"],   # tied across layers
               "top.weight": ["top.weight"]}
    order = ["", "embed", "layers", "layers.0", "layers.0.a", "layers.1", "layers.1.b", "top"]
    g = boundary_groups(aliases, None, order)
    assert g.order == (ROOT_GROUP, "layers.0", "layers.1")
    assert g.names(ROOT_GROUP) == ("embed.weight", "top.weight")
    # a boundary predicate on module paths: the lowest accepted ancestor
    g = boundary_groups(aliases, lambda path: path in ("layers.1", "layers.0.a", "layers"), order)
    assert g.as_mapping() == {"layers.0.a.weight": "layers.0.a", "layers.1.b.weight": "layers.1",
                              "embed.weight": ROOT_GROUP, "top.weight": ROOT_GROUP}
    assert g.order == (ROOT_GROUP, "layers.0.a", "layers.1")


def test_deferral_needs_every_rank_and_disjoint_equal_dp_groups():
    from dmuon.functional.setup_check import deferral_agreed
    ok = [(None, (0, 2), True), (None, (1, 3), True), (None, (0, 2), True), (None, (1, 3), True)]
    assert deferral_agreed(ok)
    assert not deferral_agreed([*ok[:3], (None, (1, 3), False)])             # one rank won't
    assert not deferral_agreed([*ok[:3], (("ValueError", "x"), (1, 3), True)])  # one failed
    assert not deferral_agreed([(None, (0, 1), True), (None, (0, 1), True),
                                (None, (0, 1), True), (None, (0, 1), True)])  # not a split
    assert not deferral_agreed([(None, (1, 3), True), (None, (0, 2), True),
                                (None, (1, 3), True), (None, (0, 2), True)])  # own rank missing


def test_tp_views_replace_the_default_view_only():
    from dmuon.functional.matrix_view import Batch, Heads, Sliced
    from dmuon.functional.policy import Decision
    from dmuon.functional.tp_plan import with_tp_views
    dec = {"a": Decision("muon", Batch(0), "default"), "b": Decision("muon", Batch(0), "default")}
    out = with_tp_views(dec, {"a": Sliced(0, 2)})
    assert out["a"].view == Sliced(0, 2) and out["a"].source == "tensor parallel"
    assert out["b"] == dec["b"] and dec["a"].view == Batch(0)
    dec["a"] = Decision("muon", Heads(2, "rows"), "rule 0: a")
    with pytest.raises(NotImplementedError, match="'a' is tensor-parallel, and its matrix view"):
        with_tp_views(dec, {"a": Sliced(0, 2)})


def test_tp_decisions_refuse_ddp_and_meta_with_tp_slices_only():
    from dmuon.functional.matrix_view import Batch, Sliced
    from dmuon.functional.policy import Decision
    from dmuon.functional.tp_setup import tp_decisions
    dec = {"a": Decision("muon", Batch(0), "default")}
    kw = dict(fix="FIX", error=NotImplementedError)
    out = tp_decisions(dec, {"a": Sliced(1, 2)}, data_parallel="fsdp", on_meta=False, **kw)
    assert out["a"].view == Sliced(1, 2) and out["a"].source == "tensor parallel"
    assert tp_decisions(dec, {}, data_parallel="ddp", on_meta=True, **kw) == dec  # no TP slice
    with pytest.raises(NotImplementedError, match="with data_parallel='ddp' are not .* FIX"):
        tp_decisions(dec, {"a": Sliced(1, 2)}, data_parallel="ddp", on_meta=False, **kw)
    with pytest.raises(NotImplementedError, match="on the meta device"):
        tp_decisions(dec, {"a": Sliced(1, 2)}, data_parallel="fsdp", on_meta=True, **kw)


def test_names_by_object_groups_a_tied_params_names():
    from dmuon.functional.selection import names_by_object
    a, b = object(), object()
    got = names_by_object([("x.w", a), ("y", b), ("z.w", a)])
    assert got == {id(a): ["x.w", "z.w"], id(b): ["y"]}


def test_meta_init_window_checks():
    from dmuon.functional.meta_init_check import init_window_problems, same_device
    cpu = torch.device("cpu")
    assert same_device(None, cpu) and same_device("cpu", cpu) and not same_device("meta", cpu)
    assert same_device("cuda", torch.device("cuda", 1))
    assert not same_device("cuda:0", torch.device("cuda", 1))
    assert init_window_problems([], []) == []
    got = init_window_problems(["a", "b", "c", "d", "e"], ["buf"])
    assert got == ["dedicated params never reached by model.to_empty(device=...): "
                   "['a', 'b', 'c', 'd'] ...", "params / buffers still on the meta device: ['buf']"]


def test_tp_layouts_of_reads_dtensor_metadata_and_refuses_bad_layouts():
    from types import SimpleNamespace

    from torch.distributed.tensor import Replicate, Shard

    from dmuon.functional.tp_setup import tp_layouts_of, tp_mesh_ranks

    class _Shard(Shard):  # a subclass (as _StridedShard): interleaved slices
        pass

    def mesh(ranks):
        return SimpleNamespace(ndim=1, size=lambda: len(ranks), mesh=torch.tensor(ranks))

    def dt(shape, pl, m):
        return SimpleNamespace(placements=pl, device_mesh=m, shape=torch.Size(shape),
                               stride=lambda: (shape[1], 1))

    m = mesh([1, 3])
    a, b = dt((4, 6), (Shard(1),), m), dt((8, 2), (Shard(0),), m)
    kw = dict(shard_type=Shard, fix="FIX", error=NotImplementedError)
    got = tp_layouts_of({"a": a, "b": b}, {}, **kw)
    assert (got["a"].dim, got["a"].parts, got["a"].shape, got["b"].dim) == (1, 2, (4, 6), 0)
    assert tp_mesh_ranks(got) == (1, 3) and tp_mesh_ranks({}) is None
    with pytest.raises(NotImplementedError, match="'a' is a DTensor .* it is tied.* FIX"):
        tp_layouts_of({"a": a}, {id(a): ["a", "c"]}, **kw)
    with pytest.raises(NotImplementedError, match="interleaves the slices"):
        tp_layouts_of({"a": dt((4, 6), (_Shard(1),), m)}, {}, **kw)
    with pytest.raises(NotImplementedError, match="not a row- or column-sharded"):
        tp_layouts_of({"a": dt((4, 6), (Replicate(),), m)}, {}, **kw)
    with pytest.raises(NotImplementedError, match="different TP meshes"):
        tp_layouts_of({"a": a, "b": dt((8, 2), (Shard(0),), mesh([0, 2]))}, {}, **kw)


def test_matrix_settings_collect_the_specs_and_decisions_per_matrix():
    from dmuon.functional.matrix_settings import matrix_settings
    from dmuon.functional.matrix_view import Batch
    from dmuon.functional.policy import Decision
    from dmuon.functional.specs import specs_from_named_shapes
    named = [("e", (2, 4, 3), torch.float32), ("w", (4, 3), torch.float32)]
    specs = specs_from_named_shapes(named, lambda n, p: True,
                                    view_fn=lambda n, shape: Batch(int(n == "e")))
    dec = {"e": Decision("muon", Batch(1), "rule 0: e", lr_mult=0.5),
           "w": Decision("muon", Batch(0), "default", master_dtype=torch.float64)}
    got = matrix_settings(dec, specs, ["e", "w"])
    assert got.views == {"e": Batch(1), "w": Batch(0)}
    assert got.master_dtypes == {"w": torch.float64} and got.param_dtypes == {}
    assert got.reduce_dtypes == {}
    assert got.hp_mults == {"e": (0.5, 1.0), "w": (1.0, 1.0)}


def test_ddp_mode_follows_ddps_no_sync_without_undoing_dmuons():
    from dmuon.functional.ddp_sync import follow_ddp_sync
    assert follow_ddp_sync(False, True, False) == (False, True)    # DDP's no_sync pauses
    assert follow_ddp_sync(True, False, True) == (True, False)     # and DDP resumes its pause
    assert follow_ddp_sync(True, False, False) == (False, False)   # dmuon.no_sync's pause stays
    assert follow_ddp_sync(False, False, False) == (False, False)  # both paused: dmuon's
    assert follow_ddp_sync(True, True, False) == (True, False)     # both syncing: unchanged
