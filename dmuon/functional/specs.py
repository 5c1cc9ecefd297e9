"""Parameter specs: the model facts the owner plan needs, with no ``nn.Module`` attached.

A :class:`ParamSpec` records a parameter's fully-qualified name, shape, dtype (as ``str(torch dtype)``),
the *layer key* (the ``layers.N``-style prefix that groups the matrices one transformer block uses),
the optimizer route (``"muon"`` for dedicated matrices, ``"adamw"`` for the rest) and how many leading
dimensions index independent matrices (``batch_dims``, e.g. 1 for an MoE expert stack ``(E, out, in)``).

:func:`specs_from_named_shapes` builds specs from ``(name, shape, dtype)`` triples or from
``model.named_parameters()``-like ``(name, tensor)`` pairs, so the same code serves a live model, a meta
model, a Hugging Face ``config.json`` (see :mod:`dmuon.functional.presets`) and tests.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from dmuon.functional.matrix_shape import as_matrix_shape

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

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"ParamSpec.name must be a non-empty str, got {self.name!r}")
        if self.route not in ROUTES:
            raise ValueError(f"ParamSpec {self.name!r}: route must be one of {ROUTES}, got {self.route!r}")
        if any(d < 0 for d in self.shape):
            raise ValueError(f"ParamSpec {self.name!r}: shape {self.shape} has a negative size")
        if self.route == "muon":
            try:
                as_matrix_shape(self.shape, self.batch_dims)
            except ValueError as e:
                raise ValueError(
                    f"ParamSpec {self.name!r} is routed to Muon but is not a matrix: {e}. Fix the "
                    "predicate so it rejects this parameter (it then goes to AdamW), or set batch_dims."
                ) from None
        dtype_from_str(self.dtype)  # validates

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


def default_muon_predicate(name: str, p: Any) -> bool:
    """Default routing: 2-D weights except embeddings and output heads go to Muon."""
    lowered = name.lower()
    if any(tag in lowered for tag in ("embed", "lm_head", "wte", "wpe")):
        return False
    return len(tuple(p.shape)) == 2


def _meta_tensor(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


def specs_from_named_shapes(
    named: Iterable[tuple[Any, ...]],
    predicate: Optional[Callable[[str, Any], bool]] = None,
    *,
    layer_key_fn: Optional[Callable[[str], Optional[str]]] = None,
    batch_dims_fn: Optional[Callable[[str, tuple[int, ...]], int]] = None,
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
      skip_frozen: drop tensors with ``requires_grad == False`` (pairs only): they are not optimized.

    Returns:
      the specs, in input order (the plan itself does not depend on that order).

    Raises:
      ValueError: on a duplicate name, a malformed entry, or a non-matrix param chosen by the predicate.
    """
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
        out.append(ParamSpec(name=name, shape=shape, dtype=str(dtype), layer_key=layer_key_fn(name),
                             route=route, batch_dims=bd))
    return tuple(out)
