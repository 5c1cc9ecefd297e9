"""Parameter specs: the model facts the owner plan needs, with no ``nn.Module`` attached.

A :class:`ParamSpec` records a parameter's fully-qualified name, shape, dtype (as ``str(torch dtype)``),
the *layer key* (the ``layers.N``-style prefix that groups the matrices one transformer block uses),
the optimizer route (``"muon"`` for dedicated matrices, ``"adamw"`` for the rest) and how many leading
dimensions index independent matrices (``batch_dims``, e.g. 1 for an MoE expert stack ``(E, out, in)``).

:func:`specs_from_named_shapes` builds specs from ``(name, shape, dtype)`` triples or from
``model.named_parameters()``-like ``(name, tensor)`` pairs, so the same code serves a live model, a meta
model, a Hugging Face ``config.json`` (see :mod:`dmuon.tools.presets`) and tests.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from dmuon.functional.matrix_view import Batch, MatrixView, as_view

__all__ = [
    "ROUTES",
    "ParamSpec",
    "layer_key_from_name",
    "default_muon_predicate",
    "specs_from_named_shapes",
    "dtype_from_str",
]

ROUTES = ("muon", "adamw")

# A layer container segment followed by an index: ``layers.3``, ``blocks.0``, ``h.11``, ``layer.2``,
# ``resblocks.5``, or the flattened spelling ``layers_3`` (torch.fx / scripted names). The segment must
# start the name or follow a dot, so ``sublayers.2`` or ``fh.3`` do not match.
_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|layer|blocks|block|resblocks|h)[._](\d+)(?=\.|$)")


@dataclass(frozen=True)
class ParamSpec:
    """Immutable description of one parameter.

    Attributes:
      name: fully-qualified parameter name (``model.named_parameters()`` spelling).
      shape: the full (unsharded) shape.
      dtype: ``str(torch dtype)``, e.g. ``"torch.bfloat16"``.
      layer_key: the prefix naming the block the parameter belongs to (``"model.layers.3"``), or
        ``None`` for parameters outside any block (embeddings, final norm, head).
      route: ``"muon"`` (dedicated: planned, orthogonalized by its owner) or ``"adamw"``.
      batch_dims: leading dimensions that index independent matrices (see ``as_matrix_shape``).
      view: any other matrix view (:mod:`dmuon.functional.matrix_view`); ``None``: ``Batch(batch_dims)``.
        A ``Batch(k)`` view is stored as ``batch_dims=k`` (one spelling; equal fingerprints).

    Raises:
      ValueError: on an unknown route, a negative size, or a ``"muon"`` spec that is not a matrix
        (fewer than two dimensions left after ``batch_dims``).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    layer_key: Optional[str]
    route: str
    batch_dims: int = 0
    view: Optional[MatrixView] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if self.view is not None:  # one canonical spelling: Batch(k) is batch_dims=k
            if not isinstance(self.view, MatrixView):
                raise ValueError(f"ParamSpec {self.name!r}: view must be a MatrixView, got {self.view!r}")
            if self.batch_dims:
                raise ValueError(f"ParamSpec {self.name!r}: give view= or batch_dims=, not both "
                                 "(batch_dims=k is view=Batch(k))")
            if isinstance(self.view, Batch):
                object.__setattr__(self, "batch_dims", self.view.dims)
                object.__setattr__(self, "view", None)
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"ParamSpec.name must be a non-empty str, got {self.name!r}")
        if self.route not in ROUTES:
            raise ValueError(f"ParamSpec {self.name!r}: route must be one of {ROUTES}, got {self.route!r}")
        if any(d < 0 for d in self.shape):
            raise ValueError(f"ParamSpec {self.name!r}: shape {self.shape} has a negative size")
        if self.route == "muon":
            try:
                self.matrix_view.blocks(self.shape)
            except ValueError as e:
                raise ValueError(
                    f"ParamSpec {self.name!r} is routed to Muon but is not a matrix: {e}. Fix the "
                    "predicate so it rejects this parameter (it then goes to AdamW), or choose its "
                    "matrix view (batch_dims / dmuon.functional.matrix_view)."
                ) from None
        dtype_from_str(self.dtype)  # validates

    @property
    def matrix_view(self) -> MatrixView:
        """The view NS, the shape scale and the cost model use: ``view``, else ``Batch(batch_dims)``."""
        return self.view if self.view is not None else Batch(self.batch_dims)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def itemsize(self) -> int:
        return dtype_from_str(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of the full parameter in its own dtype."""
        return self.numel * self.itemsize


def dtype_from_str(dtype: str | torch.dtype) -> torch.dtype:
    """``"torch.bfloat16"`` / ``"bfloat16"`` / ``torch.bfloat16`` -> ``torch.bfloat16``.

    Raises:
      ValueError: if the string does not name a torch dtype.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    attr = str(dtype).removeprefix("torch.")
    d = getattr(torch, attr, None)
    if not isinstance(d, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}: not a torch dtype; write it as str(torch.float32) "
                         "== 'torch.float32' (or 'float32', or the torch.dtype itself)")
    return d


def layer_key_from_name(name: str) -> Optional[str]:
    """The block prefix of a parameter name, up to and including the block index.

    Recognizes the usual container names followed by an index: ``layers.N``, ``layer.N``,
    ``blocks.N``, ``block.N``, ``resblocks.N``, ``h.N`` and the flattened ``layers_N`` spelling. The
    *first* (outermost) match wins, so nested blocks belong to their enclosing layer.

    Examples:
      ``"model.layers.3.mlp.up_proj.weight" -> "model.layers.3"``,
      ``"transformer.h.0.attn.c_attn.weight" -> "transformer.h.0"``,
      ``"layers_7.attention.wq.weight" -> "layers_7"``, ``"model.embed_tokens.weight" -> None``.

    Returns:
      the prefix, or ``None`` when the name contains no block index.
    """
    m = _LAYER_RE.search(name)
    if m is None:
        return None
    return name[: m.end()].lstrip(".")


# MoE routers: a module named ``gate`` / ``router`` (or ``*_gate`` / ``*_router``, e.g. Qwen2-MoE's
# ``shared_expert_gate``) owning the weight; ``gate_proj`` / ``gate_up_proj`` are not routers.
_ROUTER_RE = re.compile(r"(?:^|\.)\w*(?:gate|router)\.weight$")


def default_muon_predicate(name: str, p: Any) -> bool:
    """Default routing (names only): Muon for the 2-D weights and the 3-D MoE expert stacks (a
    name containing ``experts``), except embeddings (``embed``, ``wte``, ``wpe``), output heads
    (``lm_head``) and MoE routers (a ``gate`` / ``router`` module's weight, e.g.
    ``mlp.gate.weight`` of shape ``(E, H)``); everything else (norms, biases, routers, ...) goes
    to AdamW. Given this predicate, ``dedicate_params`` also looks at the modules: an
    ``nn.Embedding``'s weight (tied ones too) and a likely output head go to AdamW whatever their
    names (:mod:`dmuon.functional.module_routes`)."""
    lowered = name.lower()
    if any(tag in lowered for tag in ("embed", "lm_head", "wte", "wpe")):
        return False
    if _ROUTER_RE.search(lowered):
        return False
    nd = len(tuple(p.shape))
    return nd == 2 or (nd == 3 and "experts" in lowered)


def _meta_tensor(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


def specs_from_named_shapes(
    named: Iterable[tuple[Any, ...]],
    predicate: Optional[Callable[[str, Any], bool]] = None,
    *,
    layer_key_fn: Optional[Callable[[str], Optional[str]]] = None,
    batch_dims_fn: Optional[Callable[[str, tuple[int, ...]], int]] = None,
    view_fn: Optional[Callable[[str, tuple[int, ...]], Any]] = None,
    skip_frozen: bool = True,
) -> tuple[ParamSpec, ...]:
    """Build :class:`ParamSpec` s from named shapes or named tensors.

    Args:
      named: ``(name, shape, dtype)`` triples (``dtype`` a ``torch.dtype`` or its ``str``), or
        ``(name, tensor)`` pairs such as ``model.named_parameters()`` (meta tensors are fine).
      predicate: ``predicate(name, p) -> bool`` selects the Muon params; ``p`` is the tensor for pairs
        and a meta tensor of the given shape/dtype for triples, so ``p.ndim``, ``p.shape``,
        ``p.numel()`` work either way. Default :func:`default_muon_predicate`.
      layer_key_fn: ``name -> layer key or None``; default :func:`layer_key_from_name`.
      batch_dims_fn: ``(name, shape) -> int`` leading batch dims of a Muon param; default 0.
      view_fn: ``(name, shape) -> MatrixView | int | None`` the matrix view of a Muon param (an
        int ``k``: ``Batch(k)``; ``None``: ``batch_dims_fn``'s); give one of the two functions.
      skip_frozen: drop tensors with ``requires_grad == False`` (pairs only): they are not optimized.

    Returns:
      the specs, in input order (the plan itself does not depend on that order).

    Raises:
      ValueError: on a duplicate name, a malformed entry, or a non-matrix param chosen by the predicate.
    """
    if batch_dims_fn is not None and view_fn is not None:
        raise ValueError("give view_fn or batch_dims_fn, not both (batch_dims=k is view Batch(k))")
    predicate = default_muon_predicate if predicate is None else predicate
    layer_key_fn = layer_key_from_name if layer_key_fn is None else layer_key_fn
    out: list[ParamSpec] = []
    seen: set[str] = set()
    for entry in named:
        if len(entry) == 2 and isinstance(entry[1], torch.Tensor):
            name, p = entry
            if skip_frozen and not p.requires_grad:
                continue
            shape, dtype = tuple(int(d) for d in p.shape), p.dtype
        elif len(entry) == 3:
            name, shape, dtype = entry
            shape, dtype = tuple(int(d) for d in shape), dtype_from_str(dtype)
            p = _meta_tensor(shape, dtype)
        else:
            raise ValueError(
                f"expected (name, shape, dtype) triples or (name, tensor) pairs, got {entry!r}")
        if name in seen:
            raise ValueError(f"duplicate parameter name {name!r}; names must be unique")
        seen.add(name)
        route = "muon" if predicate(name, p) else "adamw"
        bd = int(batch_dims_fn(name, shape)) if (batch_dims_fn is not None and route == "muon") else 0
        vw = view_fn(name, shape) if (view_fn is not None and route == "muon") else None
        out.append(ParamSpec(name=name, shape=shape, dtype=str(dtype), layer_key=layer_key_fn(name),
                             route=route, batch_dims=bd,
                             view=None if vw is None else as_view(vw)))
    return tuple(out)
