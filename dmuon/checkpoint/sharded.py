"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP): no rank ever holds the model;
saves are atomic, loads validated and transactional.

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

**Atomic saves** (publish by rename): ``save_sharded(path, ...)`` writes into a fresh sibling
directory ``<path>.partial-<save id>``; once every rank's DCP write returned, each rank reads back
and checksums (CRC-32) the files it wrote (:mod:`~dmuon.checkpoint.checksum_pass`: waited for while
it moves, agreed), then rank 0 writes ``dmuon-complete.json`` (the save id, each file's size and
CRC, dmuon's version) into it and publishes it: the old ``path`` becomes ``<path>.1`` (older ones
shift up to ``<path>.<keep_last - 1>``, the rest are deleted; ``keep_last=1`` deletes it) and the new
directory becomes ``path``. A rank killed while writing leaves ``path`` as it was (the partial
directory is never read); a crash between the two renames leaves no ``path``, and
:func:`load_sharded` names ``<path>.1``. A directory without the marker, or whose files do not
match it (truncated, flipped bytes, a file from another save), is refused on load.

**Validated, transactional loads**: every rank checks the checkpoint's metadata against the model
(names, full shapes, floating dtypes for floating params), the ranks split the files among them
and verify each one's size and CRC, DCP reads into *staged* tensors (new buffers shaped like this
rank's pieces: one extra copy of its local state at most), the staged values are checked for
NaN/Inf (``check_finite``), and the verdicts are agreed across ranks; only then are the model's
pieces and the optimizer's state replaced. Any failure raises :class:`CheckpointError` (an
``Exception``; DCP's own ``CheckpointException`` is a ``BaseException``) on every rank, naming
the files / keys and ranks, with model and optimizer exactly as before.
"""
from __future__ import annotations

import io
import math
import os
import uuid
from typing import Any, Mapping, NamedTuple, Optional

import torch
import torch.nn as nn

import torch.distributed as dist

from dmuon.checkpoint.checksum_pass import not_agreed, save_checksums, verify_files
from dmuon.checkpoint.files import (CheckpointError, agree_errors, agree_same, complete_or_raise,
                                    publish, write_marker)
from dmuon.checkpoint.save_safety import (agree_failure, claim_partial, discard_partial,
                                          finish_publish, run_step, sweep_partials,
                                          target_problems)
from dmuon.checkpoint.trust import load_bytes, safe_reader, value_problems
from dmuon.functional.copy_log import MODEL, OPTIMIZER
from dmuon.functional.load_scalars import load_problems
from dmuon.functional.optimizer_format import SKIPPED
from dmuon.functional.owner_checks import refuse_variant
from dmuon.functional.selection import tied_names
from dmuon.functional.state_dict_check import all_finite, check_state_dict
from dmuon.compat.wrappers import unwrapping_model
from dmuon.stateful.checkpoint.torch_state_dict import check_unloaded, log_dtype_changes
from dmuon.stateful.checkpoint.optimizer_state_dict import (
    _MOMENTS, check_optimizer, dtensor_like, hparam_groups, load_optimizer_state, muon_step,
)
from dmuon.stateful.modes.tensor_parallel import refuse_tp
from dmuon.stateful.runtime.state import get_state, local_tensor
from dmuon.stateful.checkpoint.state_dict import (
    dedicated_names_by_key, expected_entries, module_entries,
)

__all__ = ["save_sharded", "load_sharded", "ShardedSaveResult", "ShardedLoadResult",
           "CheckpointError"]


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
                    size = td.properties.dtype.itemsize
                    total += math.prod(td.chunk.sizes) * size
            self.bytes_written = total
            return super().finish_plan(new_plan)

    class CountingLoadPlanner(DefaultLoadPlanner):
        bytes_requested = 0
        bytes_read = 0

        def load_bytes(self, read_item, value):
            # weights_only (DCP's own planner unpickles with weights_only=False: any code);
            # handed on re-serialized, so DCP's placing of the value is unchanged
            obj = load_bytes(value, read_item.dest_index.fqn)
            buf = io.BytesIO()
            torch.save(obj, buf)
            buf.seek(0)
            return super().load_bytes(read_item, buf)

        def create_local_plan(self):
            plan = super().create_local_plan()
            req, chunks = 0, {}
            for ri in plan.items:
                if ri.type != LoadItemType.TENSOR:
                    continue
                tmd = self.metadata.state_dict_metadata[ri.storage_index.fqn]
                size = tmd.properties.dtype.itemsize
                req += math.prod(ri.lengths) * size
                off = tuple(ri.storage_index.offset)
                for c in tmd.chunks:
                    if tuple(c.offsets) == off:
                        chunks[(ri.storage_index.fqn, off)] = math.prod(c.sizes) * size
            self.bytes_requested, self.bytes_read = req, sum(chunks.values())
            return plan

    return CountingSavePlanner, CountingLoadPlanner


def checkpoint_momentum(optimizer: Any) -> dict[str, torch.Tensor]:
    """``{name: momentum}`` of the owned matrices for a checkpoint (exact; see
    :meth:`~dmuon.stateful.optimizer.state_storage.MomentumStorage.values`); ``{}`` without a
    momentum stage."""
    owner = optimizer._owner
    if owner.stored_field is None:
        return {}
    return owner.value_of("momentum_buffer", optimizer.dedicated_state.owned_masters())


def install_momentum(optimizer: Any, values: Mapping[str, torch.Tensor],
                     saved_dtype: Optional[str], what: str) -> None:
    """Install checkpoint momentum ``values`` (full matrices this rank owns, any float dtype)
    into the optimizer's chain state (converted to its ``momentum_dtype``, with a logged note when
    the checkpoint's differs)."""
    if optimizer._owner.stored_field is not None:
        optimizer._owner.load({"momentum_buffer": dict(values)}, None, saved_dtype, what)


def _save_entries(model: nn.Module, rt, optimizer) -> dict[str, Any]:
    """What this rank hands DCP: FSDP2's DTensors, the dedicated matrices (param dtype) and
    momentum it owns, a wider master where there is one, counters and hparams."""
    entries = module_entries(model)  # one state-dict pass
    ded = dedicated_names_by_key(model, rt, entries)
    model_sd: dict[str, Any] = {}
    seen: dict[str, torch.Tensor] = {}
    for k, v in entries.items():
        n = ded.get(k)
        if n is None:
            model_sd[k] = v
        elif rt.rank == rt.owner_rank[n]:
            if n not in seen:
                seen[n] = rt.masters[n].detach().to(rt.orig_dtype[n])
            model_sd[k] = seen[n]
    out: dict[str, Any] = {"model": model_sd}
    if optimizer is None:
        return out
    st = optimizer.adamw_state
    fsdp2 = {n: {k: dtensor_like(src[n], p) for k, src in zip(_MOMENTS, (st.mu, st.nu))}
             for n, p in optimizer.adamw_named_params}
    dedicated: dict[str, dict[str, torch.Tensor]] = {}
    mom = checkpoint_momentum(optimizer)  # fp32: the live buffers; else exact bf16 copies
    for n in rt.owned_names:
        dedicated[n] = {"momentum_buffer": mom[n]}
        if rt.master_dtype[n] != rt.orig_dtype[n]:
            dedicated[n]["master"] = rt.masters[n]
    out["optim"] = {"fsdp2": fsdp2, "dedicated": dedicated,
                    "adamw_step": int(st.step) if st is not None else 0,
                    # torch's per-param AdamW counts (one DCP object; none skipped: no entry)
                    **({SKIPPED: tuple(sorted(optimizer.adamw_skipped.items()))}
                       if optimizer.adamw_skipped else {}),
                    "muon_step": muon_step(optimizer),
                    "num_steps": int(optimizer.num_steps),
                    # a tuple is one DCP object (a list of dicts would be split into leaves)
                    "param_groups": tuple(hparam_groups(optimizer))}
    return out


def _bcast(rt, obj: Any, what: str) -> Any:
    box = [obj]
    rt.mesh_groups.control_collective(what, lambda g: dist.broadcast_object_list(box, src=0,
                                                                                 group=g))
    return box[0]


@torch.no_grad()
@unwrapping_model
def save_sharded(checkpoint_id: str | os.PathLike, model: nn.Module, optimizer: Any = None, *,
                 extra: Optional[Mapping[str, Any]] = None, keep_last: int = 1,
                 storage_writer: Any = None) -> ShardedSaveResult:
    """Collective: write a sharded checkpoint with DCP, atomically (see the module docstring);
    each rank writes only what it owns. When it returns on every rank, ``checkpoint_id`` holds the
    complete checkpoint.

    Args:
      checkpoint_id: the checkpoint directory (on a file system every rank sees).
      model: a model prepared by ``dedicate_params`` (and ``fully_shard``).
      optimizer: its ``dmuon.Muon`` (optional: model only).
      extra: small values to store too (e.g. ``{"step": 100}``), same on every rank: what
        ``torch.load(weights_only=True)`` reads (numbers, strings, lists, tuples, dicts, tensors,
        dtypes, and classes registered with ``torch.serialization.add_safe_globals``), since
        loads run no code; anything else is refused before anything is written.
      keep_last: keep this many checkpoints: the previous ones as ``<path>.1`` ... (default 1).
      storage_writer: a DCP ``StorageWriter`` for the partial directory (default: the file
        system; it must write to the path it is given).

    Returns:
      :class:`ShardedSaveResult` (bytes this rank wrote / offered).
    """
    import torch.distributed.checkpoint as dcp

    rt = get_state(model, "dmuon.save_sharded(path, model, optimizer)")
    refuse_tp(rt, "dmuon.save_sharded (use dmuon.get_model_state_dict / "
              "get_optimizer_state_dict, which give full tensors)")
    rt.join("dmuon.save_sharded(path, model, optimizer)", always=True)
    check_unloaded(rt, [MODEL, OPTIMIZER] if optimizer is not None else [MODEL],
                   "dmuon.save_sharded", refuse=True)
    if optimizer is not None:
        check_optimizer(model, optimizer, "dmuon.save_sharded")
        refuse_variant(optimizer._owner.custom, "dmuon.save_sharded")
    rt.drain()
    path = os.path.abspath(os.fspath(checkpoint_id))
    what = "dmuon.save_sharded"
    agree_same(rt, path, what, "the ranks passed different paths", "a checkpoint is one folder "
               "every rank writes into: pass every rank the same path, on a file system they share")
    save_id = _bcast(rt, uuid.uuid4().hex[:12] if rt.rank == 0 else None, "save id")
    tmp = f"{path}.partial-{save_id}"
    # before anything is written (save_safety.py): values a load could not read without running
    # code; a path that is a link, a file or a folder of something else; then the stale partials
    problems = value_problems("extra", extra or {})
    if rt.rank == 0:
        problems += target_problems(path)
        if not problems:  # other jobs' saves in progress are left; ours is claimed, owned
            finish_publish(path)  # a crash between a publish's renames: it becomes path
            sweep_partials(path)
            problems += claim_partial(tmp)
    try:
        agree_errors(rt, problems, what)
    except CheckpointError:
        if rt.rank == 0:
            discard_partial(tmp, path)
        raise
    sd = _save_entries(model, rt, optimizer)
    if extra:
        sd["extra"] = dict(extra)
    sd["dmuon"] = {"save_id": save_id}
    save_planner, _ = _planners()
    planner = save_planner()
    own, raised = run_step(lambda: dcp.save(sd, checkpoint_id=tmp, storage_writer=storage_writer,
                                            planner=planner), f"DCP save into {tmp}", rt.rank)
    kept = f"The checkpoint at {path!r} is unchanged; the partial folder was removed."
    err = agree_failure(rt, own, raised, what, kept)
    records: dict = {}
    if err is None:  # each rank checksums the files it wrote, waited for while it moves
        err, records = save_checksums(rt, tmp, what, kept)
    if err is None:  # rank 0 marks and publishes; every rank learns how that went
        own, raised = (run_step(lambda: (write_marker(tmp, save_id, records),
                                         publish(path, tmp, keep_last)),
                                f"publishing {tmp} as {path}", 0) if rt.rank == 0
                       else (None, False))
        err = agree_failure(rt, own, raised, what, kept)
    if err is not None:
        if rt.rank == 0:
            discard_partial(tmp, path)
        raise err
    return ShardedSaveResult(planner.bytes_written, _local_bytes(sd))


def _read_metadata(rt, checkpoint_id: str, marker: dict, storage_reader):
    """The reader (dmuon's safe one unless the caller gave one) and the metadata's entries,
    agreed on every rank (a refused file raises :class:`CheckpointError` on all)."""
    reader = storage_reader if storage_reader is not None else safe_reader(
        checkpoint_id, {f: v["size"] for f, v in marker.get("files", {}).items()})
    md, paths, errors = None, {}, []
    try:
        meta = reader.read_metadata()
        md, paths = meta.state_dict_metadata, meta.planner_data or {}
    except CheckpointError as e:
        errors.append(str(e))
    agree_errors(rt, errors, "dmuon.load_sharded")
    return reader, md, paths


def _pairs(v: Any) -> bool:
    """``v`` is a tuple / list of ``(name, count)`` pairs (how the skip counts are saved)."""
    return isinstance(v, (tuple, list)) and all(isinstance(x, (tuple, list)) and len(x) == 2
                                                for x in v)


def _extra_skeleton(md: Mapping[str, Any], paths: Mapping[str, Any]) -> dict:
    """The saved ``extra`` values' nesting (DCP flattens nested dicts to dotted keys; its
    metadata keeps each key's path), ``None`` at each leaf, for DCP to load into."""
    out: dict = {}
    for key in (k for k in md if k.startswith("extra.")):
        path = paths.get(key)
        *inner, leaf = path[1:] if path and path[0] == "extra" else (key[len("extra."):],)
        node = out
        for part in inner:
            node = node.setdefault(part, {})
        node[leaf] = None
    return out


def _check_metadata(md: Mapping[str, Any], model: nn.Module, rt, optimizer, strict: bool,
                    notes: list):
    """Problems of the checkpoint's metadata against the model (and optimizer); no collective.
    ``notes`` collects the model entries saved in another float precision."""
    entries = module_entries(model, detach=False)  # one state-dict pass
    exp = expected_entries(entries, rt, dedicated_names_by_key(model, rt, entries))
    given = {k[len("model."):]: tuple(getattr(m, "size", ()) or ()) for k, m in md.items()
             if k.startswith("model.")}
    check = check_state_dict(given, {k: shape for k, (shape, _) in exp.items()},
                             tied_names(entries.items()))
    problems = [f"model: {p}" for p in check.problems(strict)]
    for k, src in check.source.items():
        saved = getattr(getattr(md.get("model." + src), "properties", None), "dtype", None)
        if saved is not None and exp[k][1].is_floating_point and not saved.is_floating_point:
            problems.append(f"model.{src}: saved as {saved}, cannot load into a {exp[k][1]} param")
        elif saved is not None and saved.is_floating_point and saved != exp[k][1]:
            notes.append((f"model.{src}", saved, exp[k][1]))
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


def _staged_like(t: Any) -> Any:
    """A new tensor laid out like ``t`` (a DTensor: a new local piece, same spec)."""
    if hasattr(t, "to_local"):
        return dtensor_like(torch.empty_like(t.to_local()), t)
    return torch.empty_like(t)


def _nonfinite(tree: Any, prefix: str = "") -> list[str]:
    out = []
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            out += _nonfinite(v, f"{prefix}{k}.")
    elif isinstance(tree, torch.Tensor):
        t = local_tensor(tree)
        if not all_finite(t):
            out.append(f"{prefix[:-1]}: non-finite values (NaN/Inf)")
    return out


@torch.no_grad()
@unwrapping_model
def load_sharded(checkpoint_id: str | os.PathLike, model: nn.Module, optimizer: Any = None, *,
                 strict: bool = True, check_finite: bool = True,
                 storage_reader: Any = None) -> ShardedLoadResult:
    """Collective: load a :func:`save_sharded` checkpoint at any topology, validated and
    transactional (see the module docstring); each rank reads only the pieces it stores.

    Args:
      checkpoint_id: the checkpoint directory.
      model: a model prepared by ``dedicate_params`` (and ``fully_shard``), any mesh shape.
      optimizer: its ``dmuon.Muon`` to restore too (optional).
      strict: model keys missing from the checkpoint are errors (``False``: keep their values).
      check_finite: refuse NaN / Inf values (default).
      storage_reader: a DCP ``StorageReader`` (default: the file system).

    Returns:
      :class:`ShardedLoadResult` (the ``extra`` values saved, bytes requested / read here).

    Raises:
      CheckpointError: on every rank, with model and optimizer unchanged: no complete checkpoint
        at the path (the message names the last complete one), a file missing, truncated or
        corrupt, the metadata not matching the model, non-finite values, a DCP read error.
    """
    import torch.distributed.checkpoint as dcp

    what = "dmuon.load_sharded"
    rt = get_state(model, f"{what}(path, model, optimizer)")
    refuse_tp(rt, what)
    rt.join(f"{what}(path, model, optimizer)", always=True)
    if optimizer is not None:
        check_optimizer(model, optimizer, what)
        refuse_variant(optimizer._owner.custom, what)
    rt.drain()
    path = os.path.abspath(os.fspath(checkpoint_id))
    errors: list[str] = []
    if rt.rank == 0:  # a crash between a publish's renames: its complete checkpoint becomes path
        try:
            finish_publish(path)
        except OSError as e:
            errors.append(f"{what}: could not finish the interrupted publish of {path!r}: {e}")
    agree_errors(rt, errors, what)  # (and every rank reads path after it)
    marker: dict = {}
    try:
        marker = complete_or_raise(path)
    except CheckpointError as e:
        errors.append(str(e))
    agree_errors(rt, errors, what)
    agree_same(rt, marker.get("save_id"), what, "the ranks opened different checkpoints (their "
               "save ids)", "every rank must load the same one: pass every rank the same path")
    errors = verify_files(rt, path, marker)  # split by size; waited for while every pass moves
    try:
        agree_errors(rt, errors, f"{what} (checksum pass)")
    except RuntimeError as e:
        raise not_agreed(e, what, "Nothing was changed on any rank.", errors) from None
    reader, md, paths = _read_metadata(rt, path, marker, storage_reader)
    notes: list = []
    problems, check = _check_metadata(md, model, rt, optimizer, strict, notes)
    agree_errors(rt, problems, what)
    log_dtype_changes(what, notes)
    # stage: DCP reads into new buffers shaped like this rank's pieces
    entries = module_entries(model)  # one state-dict pass
    ded = dedicated_names_by_key(model, rt, entries)
    wide = {n for n in rt.names if f"optim.dedicated.{n}.master" in md} \
        if optimizer is not None else set()
    live: dict[str, Any] = {}     # key -> the live tensor it replaces
    staged: dict[str, Any] = {}   # saved key -> the new buffer DCP reads into
    done: set[str] = set()
    for k, v in entries.items():
        if k not in check.source:
            continue
        n = ded.get(k)
        if n is None:
            live[k] = v
            staged[check.source[k]] = _staged_like(v)
        elif n in rt.masters and n not in done and n not in wide:  # (a wide master: below)
            done.add(n)
            live[k] = rt.masters[n]
            staged[check.source[k]] = torch.empty(rt.shape[n], dtype=rt.orig_dtype[n],
                                                  device=rt.device)
    sd: dict[str, Any] = {"model": staged}
    if optimizer is not None:
        adamw = optimizer.adamw_named_params
        sd["optim"] = {
            "fsdp2": {n: {m: _staged_like(dtensor_like(local_tensor(p), p)) for m in _MOMENTS}
                      for n, p in adamw},
            "dedicated": {n: {"momentum_buffer": torch.empty(rt.shape[n], dtype=rt.master_dtype[n],
                                                             device=rt.device)}
                          for n in rt.owned_names},
            "adamw_step": 0, "muon_step": 0, "num_steps": 0, "param_groups": (),
            **({SKIPPED: ()} if f"optim.{SKIPPED}" in md else {})}
        for n in wide:
            if n in rt.masters:
                sd["optim"]["dedicated"].setdefault(n, {})["master"] = torch.empty(
                    rt.shape[n], dtype=rt.master_dtype[n], device=rt.device)
    if extra := _extra_skeleton(md, paths):
        sd["extra"] = extra
    _, load_planner = _planners()
    planner = load_planner()
    own, raised = run_step(lambda: dcp.load(sd, checkpoint_id=path, storage_reader=reader,
                                            planner=planner), f"DCP read of {path}", rt.rank)
    err = agree_failure(rt, own, raised, what, "Nothing was changed on any rank.")
    if err is not None:
        raise err
    errors = (_nonfinite(sd["model"], "model.") + (
        _nonfinite(sd["optim"], "optim.") if optimizer is not None else [])) if check_finite else []
    if optimizer is not None:  # counters, storage dtypes, hyper-parameters (before any install)
        skipped = sd["optim"].get(SKIPPED, ())
        sd["optim"][SKIPPED] = dict(skipped) if _pairs(skipped) else skipped
        errors += [f"optim.{p}" for p in load_problems(sd["optim"], optimizer.param_groups)]
    agree_errors(rt, errors, what)
    # install (the first writes to live state)
    if optimizer is not None:
        o = sd["optim"]
        # AdamW pieces and counters through the one load path (re-checked there); the momentum
        # of every matrix was read by its new owner, which installs it after
        load_optimizer_state(optimizer, {
            "fsdp2": o["fsdp2"], "dedicated": {}, "param_groups": list(o["param_groups"]),
            **{k: o[k] for k in ("adamw_step", "muon_step", "num_steps", SKIPPED)}},
            what=what, check_finite=False)
        saved = next((g.get("momentum_dtype") for g in o["param_groups"]
                      if g.get("name") == "muon"), None)
        install_momentum(optimizer, {n: o["dedicated"][n]["momentum_buffer"]
                                     for n in rt.owned_names}, saved, what)
        optimizer.refresh_state_views()
    for k, t in live.items():
        src = staged[check.source[k]]
        if hasattr(t, "to_local"):
            t.to_local().copy_(src.to_local())
        else:
            t.copy_(src.to(t.dtype))
    masters_wide = sd.get("optim", {}).get("dedicated", {}) if optimizer is not None else {}
    for n, e in masters_wide.items():
        if "master" in e and n in rt.masters:
            rt.masters[n].copy_(e["master"])
    rt.masters_changed(loaded=MODEL, keys={ded[k] for k in check.source if k in ded})
    return ShardedLoadResult(dict(sd.get("extra", {})), planner.bytes_requested, planner.bytes_read)
