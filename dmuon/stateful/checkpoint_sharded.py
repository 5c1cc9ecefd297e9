"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP): no rank ever holds the model.

Each rank hands DCP only what it already stores:

* FSDP2 params and their AdamW moments as DTensors (its local shards; replicas in HSDP are
  written once, DCP de-duplicates them);
* each dedicated matrix (in the param's dtype) and its Muon momentum as a plain tensor on its
  owner rank only (``"master"`` too when the master is wider than the param);
* counters, hyper-parameters and the caller's ``extra`` values as small objects.

The checkpoint's logical layout is the full format of ``get_model_state_dict`` /
``get_optimizer_state_dict``: ``{"model": {fqn: T}, "optim": {"fsdp2": ..., "dedicated": ...,
"adamw_step", "muon_step", "num_steps", "param_groups"}, "extra": {...}}``, so
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save(dir, "full.pt")`` turns it into one
``torch.save`` file that ``set_model_state_dict`` / ``set_optimizer_state_dict`` (any topology, or a
plain ``model.load_state_dict(full["model"])``) read.

Loading at any ``(shard, replicate)`` shape: every rank asks DCP for exactly the pieces it will
store — the overlap of its new FSDP2 shards with the saved ones (DCP re-shards), the whole matrices
of its new owner column (masters) and the momentum of the matrices it now owns. The checkpoint's
metadata is checked against the model on every rank before any collective.
"""
from __future__ import annotations

import math
import os
from typing import Any, Mapping, NamedTuple, Optional

import torch
import torch.nn as nn

from dmuon.functional.state_dict_check import check_state_dict
from dmuon.stateful.optimizer_state_dict import (
    _COUNTERS, _MOMENTS, check_optimizer, current_states, dtensor_like, fresh_states,
    install_states, load_hparams, saved_counters,
)
from dmuon.stateful.state import get_state, local_tensor
from dmuon.stateful.state_dict import (
    agree, dedicated_names_by_key, expected_entries, module_entries, tied_groups,
)

__all__ = ["save_sharded", "load_sharded", "ShardedSaveResult", "ShardedLoadResult"]


class ShardedSaveResult(NamedTuple):
    """``bytes_written``: tensor bytes this rank wrote (after DCP's de-duplication);
    ``bytes_local``: tensor bytes this rank offered (its shards and owned matrices)."""

    bytes_written: int
    bytes_local: int


class ShardedLoadResult(NamedTuple):
    """``extra``: the loaded ``extra`` values; ``bytes_requested``: tensor bytes this rank asked
    for (exactly what it stores); ``bytes_read``: bytes of the saved chunks it read to get them
    (saved shards overlapping its own; never more than those)."""

    extra: dict
    bytes_requested: int
    bytes_read: int


def _local_bytes(tree: Any) -> int:
    if isinstance(tree, Mapping):
        return sum(_local_bytes(v) for v in tree.values())
    if isinstance(tree, torch.Tensor):
        t = local_tensor(tree)
        return t.numel() * t.element_size()
    return 0


def _planners():
    from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
    from torch.distributed.checkpoint.planner import LoadItemType

    class CountingSavePlanner(DefaultSavePlanner):
        bytes_written = 0

        def finish_plan(self, new_plan):
            total = 0
            for item in new_plan.items:
                td = item.tensor_data
                if td is not None:
                    size = torch._utils._element_size(td.properties.dtype)
                    total += math.prod(td.chunk.sizes) * size
            self.bytes_written = total
            return super().finish_plan(new_plan)

    class CountingLoadPlanner(DefaultLoadPlanner):
        bytes_requested = 0
        bytes_read = 0

        def create_local_plan(self):
            plan = super().create_local_plan()
            req, chunks = 0, {}
            for ri in plan.items:
                if ri.type != LoadItemType.TENSOR:
                    continue
                tmd = self.metadata.state_dict_metadata[ri.storage_index.fqn]
                size = torch._utils._element_size(tmd.properties.dtype)
                req += math.prod(ri.lengths) * size
                off = tuple(ri.storage_index.offset)
                for c in tmd.chunks:
                    if tuple(c.offsets) == off:
                        chunks[(ri.storage_index.fqn, off)] = math.prod(c.sizes) * size
            self.bytes_requested, self.bytes_read = req, sum(chunks.values())
            return plan

    return CountingSavePlanner, CountingLoadPlanner


def _model_entries(model: nn.Module, rt, for_load: bool, skip: frozenset = frozenset()):
    """``({key: tensor}, post)``: this rank's model pieces; ``post`` = ``[(master, tmp)]`` copies
    to run after a load (a master wider than the param's dtype is loaded through a buffer)."""
    ded = dedicated_names_by_key(model, rt)
    out: dict[str, Any] = {}
    post = []
    seen: dict[str, torch.Tensor] = {}
    for k, v in module_entries(model).items():
        if k in skip:
            continue
        n = ded.get(k)
        if n is None:
            out[k] = v
            continue
        if for_load:
            if n not in rt.masters:
                continue
            if n in seen:  # a tied dedicated matrix: load one name only
                continue
            m = rt.masters[n]
            if m.dtype == rt.orig_dtype[n]:
                out[k] = m
            else:
                out[k] = torch.empty(rt.shape[n], dtype=rt.orig_dtype[n], device=rt.device)
                post.append((m, out[k]))
            seen[n] = out[k]
        elif rt.rank == rt.owner_rank[n]:
            if n not in seen:
                seen[n] = rt.masters[n].detach().to(rt.orig_dtype[n])
            out[k] = seen[n]
    return out, post


def _optim_entries(optimizer, rt, states, for_load: bool, masters_in_ckpt=frozenset()):
    ms, st = states
    fsdp2 = {n: {k: dtensor_like(src[n], p) for k, src in zip(_MOMENTS, (st.mu, st.nu))}
             for n, p in optimizer.adamw_named_params}
    dedicated: dict[str, dict[str, torch.Tensor]] = {}
    for n in rt.names:
        entry = {}
        if n in rt.owned_names:
            entry["momentum_buffer"] = ms.momentum[n]
        wide = rt.master_dtype[n] != rt.orig_dtype[n]
        if for_load and n in masters_in_ckpt and n in rt.masters:
            entry["master"] = rt.masters[n]
        elif not for_load and wide and n in rt.owned_names:
            entry["master"] = rt.masters[n]
        if entry:
            dedicated[n] = entry
    out: dict[str, Any] = {"fsdp2": fsdp2, "dedicated": dedicated}
    if for_load:
        out.update({k: 0 for k in _COUNTERS})
        out["param_groups"] = ()
    else:
        out.update(saved_counters(optimizer, st))
        # a tuple is one DCP object (a list of dicts would be split into leaves)
        out["param_groups"] = tuple(out["param_groups"])
    return out


@torch.no_grad()
def save_sharded(checkpoint_id: str | os.PathLike, model: nn.Module, optimizer: Any = None, *,
                 extra: Optional[Mapping[str, Any]] = None,
                 storage_writer: Any = None) -> ShardedSaveResult:
    """Collective: write a sharded checkpoint with DCP; each rank writes only what it owns.

    Args:
      checkpoint_id: a directory (DCP's ``FileSystemWriter``), or any id ``storage_writer`` takes.
      model: a model prepared by ``dedicate_params`` (and ``fully_shard``).
      optimizer: its ``dmuon.Muon`` (optional: model only).
      extra: small picklable values to store too (e.g. ``{"step": 100}``), same on every rank.
      storage_writer: a DCP ``StorageWriter`` (default: the file system).

    Returns:
      :class:`ShardedSaveResult` (bytes this rank wrote / offered).
    """
    import torch.distributed.checkpoint as dcp

    rt = get_state(model, "dmuon.save_sharded(path, model, optimizer)")
    if optimizer is not None:
        check_optimizer(model, optimizer, "dmuon.save_sharded")
    rt.drain()
    sd: dict[str, Any] = {"model": _model_entries(model, rt, for_load=False)[0]}
    if optimizer is not None:
        sd["optim"] = _optim_entries(optimizer, rt, current_states(optimizer), for_load=False)
    if extra:
        sd["extra"] = dict(extra)
    save_planner, _ = _planners()
    planner = save_planner()
    dcp.save(sd, checkpoint_id=checkpoint_id, storage_writer=storage_writer, planner=planner)
    return ShardedSaveResult(planner.bytes_written, _local_bytes(sd))


def _read_metadata(checkpoint_id, storage_reader):
    from torch.distributed.checkpoint import FileSystemReader
    reader = storage_reader if storage_reader is not None else FileSystemReader(checkpoint_id)
    return reader, reader.read_metadata().state_dict_metadata


def _check_metadata(md: Mapping[str, Any], model: nn.Module, rt, optimizer, strict: bool):
    """Problems of the checkpoint's metadata against the model (and optimizer); no collective."""
    exp = {k: shape for k, (shape, _) in expected_entries(model, rt).items()}
    given = {k[len("model."):]: tuple(getattr(m, "size", ()) or ()) for k, m in md.items()
             if k.startswith("model.")}
    check = check_state_dict(given, exp, tied_groups(model))
    problems = [f"model: {p}" for p in check.problems(strict)]
    if optimizer is not None:
        if not any(k.startswith("optim.") for k in md):
            problems.append("the checkpoint has no optimizer state (saved without optimizer?); "
                            "pass optimizer=None to load the model only")
        else:
            want = {f"optim.fsdp2.{n}.{m}": tuple(p.shape) for n, p in optimizer.adamw_named_params
                    for m in _MOMENTS}
            want.update({f"optim.dedicated.{n}.momentum_buffer": rt.shape[n] for n in rt.names})
            for key, shape in want.items():
                if key not in md:
                    problems.append(f"missing {key}")
                elif tuple(md[key].size) != tuple(shape):
                    problems.append(f"{key}: shape {tuple(md[key].size)}, expected {tuple(shape)}")
    return problems, check


@torch.no_grad()
def load_sharded(checkpoint_id: str | os.PathLike, model: nn.Module, optimizer: Any = None, *,
                 strict: bool = True, storage_reader: Any = None) -> ShardedLoadResult:
    """Collective: load a :func:`save_sharded` checkpoint at any topology (each rank reads only the
    pieces it stores).

    Args:
      checkpoint_id: the checkpoint directory (or what ``storage_reader`` takes).
      model: a model prepared by ``dedicate_params`` (and ``fully_shard``), any mesh shape.
      optimizer: its ``dmuon.Muon`` to restore too (optional).
      strict: model keys missing from the checkpoint are errors (``False``: keep their values).
      storage_reader: a DCP ``StorageReader`` (default: the file system).

    Returns:
      :class:`ShardedLoadResult` (the ``extra`` values saved, bytes requested / read here).

    Raises:
      ValueError: on every rank, before any tensor moves, when the checkpoint does not match the
        model (missing / wrong-shape entries are listed).
    """
    import torch.distributed.checkpoint as dcp

    what = "dmuon.load_sharded"
    rt = get_state(model, f"{what}(path, model, optimizer)")
    if optimizer is not None:
        check_optimizer(model, optimizer, what)
    rt.drain()
    reader, md = _read_metadata(checkpoint_id, storage_reader)
    problems, check = _check_metadata(md, model, rt, optimizer, strict)
    agree(rt, problems, what)
    present = {k for k in check.source.values()}
    absent = frozenset(k for k in module_entries(model) if k not in present)
    masters = frozenset(n for n in rt.names if f"optim.dedicated.{n}.master" in md) \
        if optimizer is not None else frozenset()
    skip = absent | frozenset(k for k, n in dedicated_names_by_key(model, rt).items() if n in masters)
    model_sd, post = _model_entries(model, rt, for_load=True, skip=skip)
    sd: dict[str, Any] = {"model": {check.source[k]: v for k, v in model_sd.items()}}
    states = None
    if optimizer is not None:
        states = fresh_states(optimizer)
        sd["optim"] = _optim_entries(optimizer, rt, states, for_load=True, masters_in_ckpt=masters)
    extra_keys = [k[len("extra."):] for k in md if k.startswith("extra.")]
    if extra_keys:
        sd["extra"] = {k: None for k in extra_keys}
    _, load_planner = _planners()
    planner = load_planner()
    dcp.load(sd, checkpoint_id=checkpoint_id, storage_reader=reader, planner=planner)
    for master, tmp in post:
        master.copy_(tmp)
    if optimizer is not None:
        load_hparams(optimizer, sd["optim"]["param_groups"])
        install_states(optimizer, states, sd["optim"])
    rt.masters_changed()
    return ShardedLoadResult(dict(sd.get("extra", {})), planner.bytes_requested, planner.bytes_read)
