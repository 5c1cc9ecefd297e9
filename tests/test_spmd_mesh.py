"""dmuon.functional.spmd_mesh (pure, no processes): the data-parallel axes of a full SPMD mesh
come from ``dp_mesh_dims``' names, not from the mesh's number of dims or ranks; a dedicated
matrix's placements on it say whether and where it is TP-sliced; FSDP2's recorded
``dp_mesh_dims`` must match what dmuon was given; a plain param's spmd_types annotations
(torchtitan 0.3's default backend) read as the same placements."""
from __future__ import annotations

import pytest

from dmuon.functional.spmd_mesh import (DPAxes, SpmdTypes, dp_axes, fsdp_dims_problem, names_of,
                                        spmd_slicing, spmd_types_kinds)


def test_axes_by_name_not_by_rank_count():
    # a 2-D (dp_shard, tp) mesh: one shard axis, TP a model axis (not HSDP's replicate)
    ax = dp_axes(("dp_shard", "tp"), (2, 2), "dp_shard", None)
    assert (ax.shard, ax.replicate, ax.model) == (("dp_shard",), (), ("tp",))
    assert ax.size(ax.shard) == 2 and ax.size(ax.replicate) == 1
    # torchtitan's 4-D dense mesh: size-1 axes are no model axes; shard+replicate named
    ax = dp_axes(("dp_replicate", "dp_shard", "cp", "tp"), (2, 2, 1, 2), "dp_shard",
                 "dp_replicate")
    assert (ax.shard, ax.replicate, ax.model) == (("dp_shard",), ("dp_replicate",), ("tp",))
    assert ax.dp == ("dp_shard", "dp_replicate")
    # several shard names flatten in the given order (dp_shard x cp)
    ax = dp_axes(("dp_shard", "cp", "tp"), (2, 2, 1), ("dp_shard", "cp"), None)
    assert ax.shard == ("dp_shard", "cp") and ax.size(ax.shard) == 4 and ax.model == ()
    assert names_of(None) == () and names_of("a") == ("a",) and names_of(["a", "b"]) == ("a", "b")


@pytest.mark.parametrize("names, sizes, shard, rep, words", [
    (None, (2, 2), "dp", None, "named dims"),
    (("dp", "tp"), (2, 2), None, None, "names no axis"),
    (("dp", "tp"), (2, 2), "fsdp", None, "not dims of the mesh"),
    (("dp", "tp"), (2, 2), "dp", "dp", "more than once"),
    (("dp", "tp"), (2, 2), None, "dp", "no shard axis"),
])
def test_bad_dims_say_how_to_fix(names, sizes, shard, rep, words):
    with pytest.raises(ValueError, match=words):
        dp_axes(names, sizes, shard, rep)


AX = DPAxes(("dp_shard",), ("dp_replicate",), ("tp",),
            (("dp_replicate", 2), ("dp_shard", 2), ("cp", 1), ("tp", 2)))
NAMES = ("dp_replicate", "dp_shard", "cp", "tp")
R = ("R", None)


def test_slicing_from_placements():
    assert spmd_slicing("w", (8, 4), NAMES, (R, R, R, R), AX) is None        # whole
    assert spmd_slicing("w", (8, 4), NAMES, (R, R, R, ("S", 0)), AX) == ("tp", 0)  # colwise
    assert spmd_slicing("w", (8, 4), NAMES, (R, R, R, ("S", -1)), AX) == ("tp", 1)  # rowwise
    # a Shard on a size-1 axis slices nothing
    assert spmd_slicing("w", (8, 4), NAMES, (R, R, ("S", 0), R), AX) is None


@pytest.mark.parametrize("kinds, words", [
    ((R, ("S", 0), R, R), "data-parallel axis 'dp_shard'"),
    ((R, R, R, ("Partial", None)), "Partial on the model axis"),
    ((R, R, R, ("_StridedShard", None)), "_StridedShard"),
])
def test_unsupported_placements_named(kinds, words):
    with pytest.raises(ValueError, match=words):
        spmd_slicing("layers.0.w", (8, 4), NAMES, kinds, AX)


def test_two_model_axes_refused():
    ax = DPAxes(("dp",), (), ("tp", "ep"), (("dp", 2), ("tp", 2), ("ep", 2)))
    with pytest.raises(ValueError, match="several model axes"):
        spmd_slicing("w", (8, 4), ("dp", "tp", "ep"), (R, ("S", 0), ("S", 1)), ax)


def test_fsdp_recorded_dims_checked():
    given = (("dp_shard",), ())
    assert fsdp_dims_problem(given, [("layers.0", given), ("", given)]) is None
    assert fsdp_dims_problem(None, [("layers.0", None)]) is None   # no dp_mesh_dims anywhere
    msg = fsdp_dims_problem(None, [("layers.0", given)])          # fully_shard got them, dmuon not
    assert "dedicate_params got none" in msg and "resolve_fsdp_mesh" in msg
    msg = fsdp_dims_problem(given, [("layers.0", (("dp_shard",), ("dp_replicate",)))])
    assert "differ" in msg and "layers.0" in msg


def test_spmd_meshes_slices_the_named_axes():
    from types import SimpleNamespace

    from dmuon.functional.spmd_mesh import spmd_meshes
    mesh = SimpleNamespace(mesh_dim_names=("dp_replicate", "dp_shard", "tp"),
                           mesh=SimpleNamespace(shape=(2, 2, 2)))
    dims = SimpleNamespace(shard="dp_shard", replicate="dp_replicate")
    cut = lambda m, names: ("sub", tuple(names))  # noqa: E731
    shard, rep, axes, err = spmd_meshes(mesh, None, dims, sub_mesh=cut)
    assert err is None and shard == ("sub", ("dp_shard",)) and rep == ("sub", ("dp_replicate",))
    assert axes.model == ("tp",)
    assert spmd_meshes(mesh, "r", None, sub_mesh=cut) == (mesh, "r", None, None)  # no dims: as given
    _, _, axes, err = spmd_meshes(mesh, "r", dims, sub_mesh=cut)  # both: returned, not raised
    assert axes is None and isinstance(err, ValueError) and "not both" in str(err)


def test_spmd_layouts_of_full_mesh_dtensors():
    """Dedicated DTensors on a full (dp_shard 2, tp 2) mesh: a colwise one is a TP layout whose
    group is the TP sub-mesh (its ranks for the grids), a replicated one a whole view; without
    axes the same params are refused naming dp_mesh_dims; annotated plain params too."""
    from types import SimpleNamespace

    import torch
    from torch.distributed.tensor import Replicate, Shard

    from dmuon.functional.tp_setup import spmd_layouts_of, tp_mesh_ranks

    class FakeMesh:  # what spmd_layouts_of reads of a DeviceMesh
        def __init__(self, ranks, names):
            self.mesh, self.mesh_dim_names = torch.tensor(ranks), names
            self.ndim = self.mesh.ndim

        def size(self):
            return self.mesh.numel()

        def __getitem__(self, axis):  # this rank's (rank 0's) slice along ``axis``
            i = self.mesh_dim_names.index(axis)
            return FakeMesh(self.mesh.select(1 - i, 0).tolist(), (axis,))

    mesh = FakeMesh
    full = mesh([[0, 1], [2, 3]], ("dp_shard", "tp"))
    axes = dp_axes(("dp_shard", "tp"), (2, 2), "dp_shard", None)

    def dt(shape, pl):
        return SimpleNamespace(placements=pl, device_mesh=full, shape=torch.Size(shape),
                               stride=lambda: (shape[1], 1))
    col, whole = dt((8, 4), (Replicate(), Shard(0))), dt((8, 4), (Replicate(), Replicate()))
    kw = dict(shard_type=Shard, replicate_type=Replicate, fix="FIX", error=NotImplementedError)
    layouts, views = spmd_layouts_of({"col": col, "whole": whole}, {}, axes, **kw)
    assert set(layouts) == {"col"} and set(views) == {"whole"}
    lay = layouts["col"]
    assert (lay.dim, lay.parts, lay.shape, lay.mesh) == (0, 2, (8, 4), full)
    assert lay.placements == (Replicate(), Shard(0)) and tp_mesh_ranks(layouts) == (0, 1)
    assert views["whole"].parts == 1 and views["whole"].mesh is full
    with pytest.raises(ValueError, match="no dp_mesh_dims"):
        spmd_layouts_of({"col": col}, {}, None, **kw)
    with pytest.raises(ValueError, match="spmd_types annotations"):
        spmd_layouts_of({}, {}, None, plain=["w"], annotated=["w"], **kw)
    with pytest.raises(ValueError, match="cannot tell a TP slice"):
        spmd_layouts_of({}, {}, axes, plain=["w"], **kw)
    # a plain param with spmd_types annotations (torchtitan 0.3): a local layout (the forward
    # computes on the plain slice) with the placements they mean; an unannotated one still refused
    typed = {"up": (object(), ((_DP, _TP), (("mesh_tp",), ()), (4, 4)))}
    layouts, views = spmd_layouts_of({}, {}, axes, plain=["up"], annotated=["up"], typed=typed,
                                     spmd_mesh=full, **kw)
    lay = layouts["up"]
    assert lay.local and not views and (lay.dim, lay.parts, lay.shape, lay.mesh) == (0, 2, (8, 4),
                                                                                    full)
    assert lay.placements == (Replicate(), Shard(0)) and tp_mesh_ranks(layouts) == (0, 1)
    with pytest.raises(ValueError, match="without spmd_types annotations"):
        spmd_layouts_of({}, {}, axes, plain=["up", "w"], annotated=["up"], typed=typed,
                        spmd_mesh=full, **kw)


# torchtitan 0.3's annotations on a (dp_shard 2, tp 2) mesh: its flattened dp axis ("mesh_dp",
# the same ranks as dp_shard) and its tp axis; the local tensor of a TP slice
_AX = dp_axes(("dp_shard", "tp"), (2, 2), "dp_shard", None)
_DP, _TP = ("mesh_dp", "R", "dp_shard", 2), ("mesh_tp", "V", "tp", 2)


def test_spmd_types_read_as_placements():
    """colwise (V on tp, PartitionSpec(tp, None)) is Shard(0) on tp, rowwise Shard(1); the full
    shape is the local one times the TP degree on that dim; R / I on tp is whole."""
    col = SpmdTypes((_DP, _TP), (("mesh_tp",), ()), (384, 256))
    kinds, full = spmd_types_kinds("w1", col, ("dp_shard", "tp"), _AX)
    assert kinds == [("R", None), ("S", 0)] and full == (768, 256)
    assert spmd_slicing("w1", full, ("dp_shard", "tp"), kinds, _AX) == ("tp", 0)
    row = SpmdTypes((_DP, _TP), ((), ("mesh_tp",)), (256, 384))
    kinds, full = spmd_types_kinds("w2", row, ("dp_shard", "tp"), _AX)
    assert spmd_slicing("w2", full, ("dp_shard", "tp"), kinds, _AX) == ("tp", 1)
    assert full == (256, 768)
    for letter in "RI":
        whole = SpmdTypes((_DP, ("mesh_tp", letter, "tp", 2)), None, (8, 4))
        kinds, full = spmd_types_kinds("w", whole, ("dp_shard", "tp"), _AX)
        assert spmd_slicing("w", full, ("dp_shard", "tp"), kinds, _AX) is None and full == (8, 4)


@pytest.mark.parametrize("axes, spec, words", [
    ((_DP, _TP), None, "PartitionSpec None"),  # V, and no spec says which dim
    ((_DP, _TP), (("mesh_dp", "mesh_tp"), ()), "alone on one tensor dim"),
    ((_DP, _TP), (("mesh_tp",), ("mesh_tp",)), "alone on one tensor dim"),
    ((_DP, ("mesh_cp", "V", None, 2)), None, "not a dim of the mesh"),
    ((_DP,), None, "no type on the model axis 'tp'"),
])
def test_spmd_types_dmuon_cannot_map_named(axes, spec, words):
    with pytest.raises(ValueError, match=words) as e:
        spmd_types_kinds("layers.0.w", SpmdTypes(axes, spec, (8, 4)), ("dp_shard", "tp"), _AX)
    assert "layers.0.w" in str(e.value) and "AdamW" in str(e.value)


def test_spmd_types_partial_and_dp_slices_refused():
    """P on the TP axis, or V on a data-parallel axis, map to placements spmd_slicing refuses."""
    part = SpmdTypes((_DP, ("mesh_tp", "P", "tp", 2)), None, (8, 4))
    kinds, full = spmd_types_kinds("w", part, ("dp_shard", "tp"), _AX)
    with pytest.raises(ValueError, match="has P on the model axis"):
        spmd_slicing("w", full, ("dp_shard", "tp"), kinds, _AX)
    on_dp = SpmdTypes((("mesh_dp", "V", "dp_shard", 2), ("mesh_tp", "R", "tp", 2)),
                      (("mesh_dp",), ()), (8, 4))
    kinds, full = spmd_types_kinds("w", on_dp, ("dp_shard", "tp"), _AX)
    with pytest.raises(ValueError, match="data-parallel axis"):
        spmd_slicing("w", full, ("dp_shard", "tp"), kinds, _AX)
