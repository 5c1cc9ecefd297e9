"""What the owners' driver (``dmuon.Muon(transform=...)``) refuses in a chain, decided before
anything changes (pure), on the chain's state over meta tensors (:func:`meta_state`): a transform
that is neither a ``Transform`` nor a function of the hyper-parameters, a quantity a
tensor-parallel slice's owner cannot serve (a stage written in the optax form only runs out of
place and needs the whole matrix), a state field of a shape or dtype the checkpoint formats cannot
hold, a stored momentum option without a momentum stage, a fixed chain whose hyper-parameters
changed, a variant's state on a path that carries Muon's momentum only."""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch

from dmuon.functional import transforms as T
from dmuon.functional import variants
from dmuon.functional.stages.leaves import default_views, in_place_form, in_place_refusal
from dmuon.functional.state_fields import LAYOUTS
from dmuon.functional.tree import get_path

__all__ = ["is_muon", "meta_state", "check_transform", "check_built_chain", "check_chain",
           "check_fields", "check_stored_field", "check_fixed_hparams", "refuse_variant"]


def is_muon(transform: Any) -> bool:
    """Whether ``transform`` is Muon itself (``None``, the default, or ``variants.muon(...)``)."""
    return transform is None or (isinstance(transform, variants.Variant)
                                 and transform.name == "muon")


def meta_state(chain: Any, views: Mapping[str, Any], shapes: Mapping[str, Sequence[int]],
               dtypes: Mapping[str, torch.dtype]) -> Any:
    """``chain``'s initial state over meta tensors (no memory) of ``shapes`` / ``dtypes``, in
    ``shapes``' order, under the default ``views``: its fields' shapes and dtypes."""
    with default_views(views):
        return chain.init({n: torch.empty(tuple(s), dtype=dtypes[n], device="meta")
                           for n, s in shapes.items()})


def check_transform(transform: Any) -> None:
    """Raise ``TypeError`` unless ``transform`` is a ``Transform`` or a function of the
    hyper-parameters."""
    if not (isinstance(transform, T.Transform) or callable(transform)):
        raise TypeError(f"dmuon.Muon: transform must be a dmuon.functional.transforms."
                        f"Transform or a function MuonHParams -> Transform (e.g. dmuon."
                        f"functional.variants.normuon()), got {type(transform).__name__}")


def check_built_chain(chain: Any) -> None:
    """Raise ``TypeError`` unless ``transform(hparams)`` returned a ``Transform``."""
    if not isinstance(chain, T.Transform):
        raise TypeError(f"dmuon.Muon: transform(hparams) must return a Transform, got "
                        f"{type(chain).__name__}")


def _tp_lacks(layouts: Mapping[str, Any]) -> dict[str, list[str]]:
    """``{quantity: [matrices]}`` an owner of a TP slice cannot serve: every slice lacks the whole
    matrix, a column slice (``dim == 1``) its whole rows too."""
    lacks: dict[str, list[str]] = {}
    for n, lay in layouts.items():
        lacks.setdefault("whole_matrix", []).append(n)
        if lay.dim == 1:
            lacks.setdefault("whole_rows", []).append(n)
    return lacks


def check_chain(chain: T.Transform, fixed: bool, hp_mults: Mapping[str, tuple],
                tp_layouts: Mapping[str, Any]) -> None:
    """Raise what the owners cannot run ``chain`` with: a fixed chain with the policy's
    ``lr_mult`` / ``wd_mult``; a quantity (``chain.needs``, a stage written in the optax form only
    needing the whole matrix: :func:`~dmuon.functional.stages.leaves.in_place_form`) a TP slice's
    owner lacks; a chain whose in-place run would fail part way
    (:func:`~dmuon.functional.stages.leaves.in_place_refusal`)."""
    chain = in_place_form(chain)
    refusal = in_place_refusal(chain)
    if refusal is not None:
        raise ValueError(f"dmuon.Muon: the transform cannot run in place: {refusal}")
    if fixed and any(m != (1.0, 1.0) for m in hp_mults.values()):
        raise ValueError("dmuon.Muon: the policy sets lr_mult / wd_mult, but a fixed Transform "
                         "carries its own learning rate; pass a function hparams -> Transform")
    lacks = _tp_lacks(tp_layouts)
    bad = {q: lacks[q] for q in chain.needs if q in lacks}
    if bad:
        q, ns = next(iter(bad.items()))
        raise ValueError(
            f"dmuon.Muon: the transform needs {q!r} of each matrix, which the owner of a "
            f"tensor-parallel slice does not hold ({len(ns)} matrices, e.g. {ns[:3]}: "
            f"{'row and column' if q == 'whole_matrix' else 'column'} slices). Leave those "
            "matrices out of TP, or use a stage that works on sums "
            "(Leaves.sum_partials: 'row_sums', 'matrix_sums')"
            + ("; a stage written in the optax form only (no update_) sees each matrix whole, "
               "so it needs it: give such a stage an in-place form "
               "(dmuon.functional.stages.stage) to run it on slices." if q == "whole_matrix"
               else "."))


def check_fields(fields: Sequence[Any], state: Any, shape: Mapping[str, Sequence[int]],
                 master_dtype: Mapping[str, torch.dtype]) -> None:
    """Raise ``ValueError`` for a state field (:func:`~dmuon.functional.state_fields.state_fields`
    of ``state``) of an unknown layout, of a shape its layout does not allow, or of a dtype the
    master does not hold."""
    for f in fields:
        if f.layout not in LAYOUTS:
            raise ValueError(f"dmuon.Muon: state field {f.key!r} has layout {f.layout!r}; "
                             f"one of {LAYOUTS}")
        for n, t in get_path(state, f.path).items():
            shp, numel = tuple(shape[n]), 1
            for d in shp:
                numel *= d
            ok = tuple(t.shape) == shp if f.layout == "param" else \
                (t.ndim == 1 and t.numel() <= numel)
            wide = master_dtype[n]
            fits = t.dtype.is_floating_point and (t.dtype == wide or torch.finfo(
                t.dtype).bits < torch.finfo(wide).bits)
            if not (ok and fits):
                raise ValueError(
                    f"dmuon.Muon: state field {f.key!r} of {n!r} is {tuple(t.shape)} "
                    f"{t.dtype}; a {f.layout!r} field must be "
                    + ("the param's shape " + str(shp) if f.layout == "param"
                       else f"1-D with at most {numel} values")
                    + f", floating, in a dtype the master ({wide}) holds")


def check_stored_field(stored_field: Optional[Any], dtype: torch.dtype, offload: bool) -> None:
    """Raise ``ValueError`` when ``momentum_dtype`` / ``offload_state`` ask for a stored momentum
    (``dtype``, ``offload``) but the chain has no momentum stage (``stored_field`` ``None``)."""
    if stored_field is None:
        raise ValueError(
            f"dmuon.Muon: momentum_dtype={dtype}, offload_state="
            f"{offload} apply to the momentum stage's buffers, and this "
            "transform= has no momentum stage (no 'momentum_buffer' state field); nothing "
            "would be stored differently. Drop those options, or add T.trace_momentum(...) "
            "to the chain.")


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable: not the same
        return False


def check_fixed_hparams(hparams: Sequence[Any], built_with: Sequence[Any]) -> None:
    """Raise ``RuntimeError`` when a fixed chain's ``MuonHParams`` (``built_with``) differ from
    ``param_groups[0]``'s now (``hparams``; a tensor is the same only as itself)."""
    if not all(_same(a, b) for a, b in zip(hparams, built_with)):
        raise RuntimeError(
            "dmuon.Muon.step: param_groups[0]'s Muon hyper-parameters changed (an lr "
            "scheduler?), but the transform is a fixed Transform with its own; nothing was "
            "updated. Pass a function hparams -> Transform (e.g. dmuon.functional.variants."
            "normuon()) so the chain is built from param_groups[0] each step, or schedule "
            "inside the chain.")


def refuse_variant(custom: bool, what: str) -> None:
    """Raise ``NotImplementedError`` where a path (``what``) carries Muon's momentum only, not a
    variant's fields, if the optimizer runs a chain other than Muon itself (``custom``: its owner
    driver's; the same on every rank, which all build the optimizer with the same ``transform``)."""
    if custom:
        raise NotImplementedError(
            f"{what} does not carry the state of a dmuon.Muon(transform=...) variant yet; nothing "
            "was changed. Use Muon.state_dict() / load_state_dict (torch's protocol, DCP) or "
            "dmuon.get_optimizer_state_dict / set_optimizer_state_dict, which save and restore "
            "the variant's state by name at any topology.")
