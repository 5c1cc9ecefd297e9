"""torch's own ``model.state_dict()`` / ``model.load_state_dict()`` on a dmuon model: true. Each
dedicated matrix is a ``Shard(0)`` DTensor on the shard mesh (as FSDP2 shows its params), so DCP
and torch's checkpoint tools work; both calls are collective, and a load is checked on every rank
before anything is written (:class:`StateDictError` on every rank otherwise).

Design notes: docs/design/checkpoint.md, "dmuon.stateful.checkpoint.torch_state_dict".
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.nn as nn

from dmuon.compat.fsdp_patch import is_dedicated
from dmuon.compat.torch_api import held_local, load_strict, simulate_load, state_dict_hooks
from dmuon.functional.copy_log import MODEL, unloaded_copies
from dmuon.functional.module_paths import ancestors
from dmuon.functional.selection import canonical_names, names_by_object
from dmuon.functional.state_dict_check import (assign_problems, check_state_dict, dtype_changes,
                                               live_views, load_refusal, rewritten_entries,
                                               strict_key_problems, value_problems,
                                               view_problems)
from dmuon.stateful.runtime.agree import agree as agree_problems
from dmuon.stateful.runtime.guards import saving_state_dict
from dmuon.stateful.modes.tensor_parallel import refuse_tp
from dmuon.stateful.checkpoint.transfer import replicated, transfer_of

logger = logging.getLogger(__name__)

__all__ = ["StateDictError", "register_state_dict_hooks", "dtensor_rows", "distribute_like",
           "layout_problem", "log_narrowing", "agree", "check_unloaded"]


class StateDictError(ValueError):
    """A state dict does not fit the model (names, shapes, dtypes, values); raised on every rank
    before anything changed."""


def agree(st, problems: list[str], what: str, payload: Any = None, *,
          route: str = "model") -> list[Any]:
    """Collective: raise :class:`StateDictError` on every rank if any rank's dict does not fit
    (:func:`~dmuon.functional.state_dict_check.load_refusal` of ``route`` names the ranks, the
    problems and the fix; :func:`dmuon.stateful.runtime.agree.agree`). Returns every rank's
    ``payload``."""
    return agree_problems(problems, what=f"{what} agreement", via=st.mesh_groups, payload=payload,
                          error=lambda detail: StateDictError(load_refusal(what, detail, route)))


def dtensor_rows(full: torch.Tensor, mesh: Any) -> Any:
    """``full`` (the same on every rank of ``mesh``) as a ``Shard(0)`` DTensor on ``mesh``: this
    rank keeps its rows; no communication. ``mesh=None`` (DDP mode: every rank holds every
    matrix whole, as DDP's params): ``full`` itself."""
    if mesh is None:
        return full
    from torch.distributed.tensor import Shard, distribute_tensor
    return distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)


def distribute_like(full: torch.Tensor, like: Any) -> Any:
    """``full`` (the same on every rank) as a DTensor laid out like the FSDP2 param ``like``, as
    ``distribute_tensor`` slices it (no communication); ``full`` itself when ``like`` is a plain
    tensor."""
    if not hasattr(like, "device_mesh"):
        return full
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)


def log_narrowing(notes: list) -> None:
    """Log (info) each of a load's precision ``notes`` (``value_problems``') whose value is rounded
    to a narrower dtype."""
    for key, have, want in notes:
        if torch.finfo(have).bits > torch.finfo(want).bits:
            logger.info("dmuon: %s narrows from %s to %s on load", key, have, want)


def layout_problem(value: Any, st) -> Optional[str]:
    """What is wrong with a DTensor ``value`` that holds neither dmuon's rows (of ``st``'s shard
    mesh) nor the whole tensor on every rank (``None``: nothing)."""
    if not hasattr(value, "to_local") or replicated(value):
        return None
    from torch.distributed.tensor import Shard
    if tuple(value.placements) == (Shard(0),) and value.device_mesh.size() == st.G:
        return None
    return (f"a DTensor with placements {tuple(value.placements)} on a mesh of "
            f"{value.device_mesh.size()} ranks; dmuon expects the rows of its own state_dict() "
            f"(Shard(0) over {st.G} ranks), a replicated DTensor or a plain full tensor")


def check_unloaded(st, kinds: list, what: str, refuse: bool = False) -> None:
    """While state-dict copies of ``kinds`` were written, not loaded (``dcp.load`` alone): raise
    on every rank (``refuse``, collective: an export would mix old and loaded values), else warn."""
    written = st.state_dict_copies.written(kinds)
    if refuse:
        agree_problems([unloaded_copies(written, what)] if written else [],
                       what=f"{what} copies", via=st.mesh_groups, error=RuntimeError)
    elif written:  # (a new state dict: maybe the target of the load that repairs it)
        logger.warning("%s. This dict holds that mix: load into it (dcp.load, then "
                       "load_state_dict) to repair it; do not save it", unloaded_copies(
                           written, f"dmuon: {what}"))


def log_dtype_changes(what: str, notes: list) -> None:
    """One log line per kind of precision change of a load (``notes`` of
    :func:`~dmuon.functional.state_dict_check.value_problems`; :func:`dtype_changes`)."""
    for warn, line in dtype_changes(what, notes):
        (logger.warning if warn else logger.info)(line)


class _Hooks:
    """The state-dict hooks of one dedicated model (the root's, and each owning module's)."""

    def __init__(self, model: nn.Module, st):
        self.st = st
        self.transfer = transfer_of(st)
        self.model = model
        # {param path: name}, each tied alias
        self.keys = canonical_names(model.named_parameters(remove_duplicate=False), st.params)
        self.staged: Optional[dict[str, Any]] = None
        # filled by the root pre-save hook, put in by each owning module's post-hook
        self.rows: Optional[dict[str, Any]] = None
        self.stand_ins: dict[str, tuple] = {}  # raw pass: key -> (meta stand-in, name)
        self.late: set[str] = set()  # load: keys an ancestor's pre-hook produces (checked early)
        self.own_hooks: set[int] = set()  # ids of the owner modules' hooks below
        self.handles: list = []  # every hook's handle (dmuon.release removes them)
        self.owned_by: dict[str, list[tuple[str, str]]] = {}  # module path -> [(attr, name)]
        for k, n in self.keys.items():
            path, _, attr = k.rpartition(".")
            self.owned_by.setdefault(path, []).append((attr, n))

    def check(self, key: str, n: str, value: Any, notes: list) -> list[str]:
        """:func:`~dmuon.functional.state_dict_check.value_problems` of ``value`` for dedicated
        matrix ``n``; a DTensor must hold dmuon's rows or the whole matrix (no collective)."""
        st = self.st
        return value_problems(key, value, st.shape[n], st.orig_dtype[n], notes=notes,
                              layout=layout_problem(value, st))

    # ------------------------------------------------------------------ save
    @torch.inference_mode(False)  # the copies keep version counters (the copy log reads them)
    def pre_save(self, module, prefix, keep_vars) -> None:
        self.rows, self.stand_ins = None, {}
        st = self.st
        if not st.raw_state_dict:
            refuse_tp(st, "model.state_dict() (torch's own, also under torch.distributed."
                      "checkpoint; use dmuon.get_model_state_dict, which gives full tensors)")
            st.join("model.state_dict()", drain=True)
            check_unloaded(st, [MODEL], "model.state_dict()")
            self.rows = {n: dtensor_rows(t.to(st.orig_dtype[n]).clone(), st.shard_mesh)
                         for n, t in self.transfer.full_masters()}  # (no TP: refused above)
            st.state_dict_copies.handed_out(MODEL, self.rows.items(), held_local)
        saving_state_dict(+1)

    def owner_post_save(self, module, state_dict, prefix, local_metadata, path: str) -> None:
        """Post-hook of a module holding dedicated params: put their entries in (the rows, or a
        meta stand-in in dmuon's raw pass) before any ancestor's post-hook reads them."""
        for attr, n in self.owned_by[path]:
            key = prefix + attr
            if key not in state_dict:
                continue
            if self.rows is not None:
                state_dict[key] = self.rows[n]
            elif saving_state_dict() and self.st.raw_state_dict:
                t = torch.empty(self.st.shape[n], dtype=self.st.orig_dtype[n], device="meta")
                self.stand_ins[key] = (t, n)
                state_dict[key] = t

    def post_save(self, module, state_dict, prefix, local_metadata) -> None:
        saving_state_dict(-1)
        rows, self.rows = self.rows, None
        stand_ins, self.stand_ins = self.stand_ins, {}
        if self.st.raw_state_dict:
            self._restore_placeholders(state_dict, prefix, stand_ins)
            return
        for k, n in self.keys.items():
            if prefix + k in state_dict:
                state_dict[prefix + k] = rows[n]

    def _restore_placeholders(self, state_dict, prefix: str, stand_ins: dict) -> None:
        """dmuon's raw pass: the placeholders back in, under the key each stand-in has now (a
        hook may rename an entry, as ``checkpoint_wrapper``'s do); raise :class:`StateDictError`
        (the same on every rank) where a submodule's state-dict hook rewrote one."""
        lost, at = [], names_by_object(state_dict.items())
        for key, (t, n) in stand_ins.items():
            for k in at.get(id(t), ()):
                state_dict[k] = self.st.params[n]
            if id(t) not in at:
                lost.append(key[len(prefix):])
        if lost:
            k = lost[0]
            raise StateDictError(rewritten_entries(len(lost), k, self._rewriter(k)))

    def _rewriter(self, key: str) -> str:
        """The nearest module above ``key`` (its owner, then the owner's ancestors) with a
        state-dict post-hook of its own, as ``'name' (Class)``."""
        for sub in ancestors(key):
            m = self.model.get_submodule(sub)
            if any(h not in self.own_hooks for h in state_dict_hooks(m)):
                return f"module {sub!r} ({type(m).__name__})"
        return f"a module on {key.rpartition('.')[0]!r}"

    # ------------------------------------------------------------------ load
    def pre_load(self, module, state_dict, prefix, local_metadata, strict, missing_keys,
                 unexpected_keys, error_msgs) -> None:
        st = self.st
        refuse_tp(st, "model.load_state_dict(sd) (use dmuon.set_model_state_dict)")
        st.join("model.load_state_dict(sd)", always=True)
        st.wait_publish()  # an earlier step's publish lands before the load, never over it
        problems, views, notes, absent, staged = [], [], [], [], {}
        for k, n in self.keys.items():
            key = prefix + k
            if key not in state_dict:
                absent.append(k)
                continue
            v = state_dict[key]
            problems += self.check(key, n, v, notes)
            staged.setdefault(n, v)
            state_dict[key] = st.params[n]  # the placeholder: torch's own copy_ is a no-op
        self.late, fsdp_keys = set(), []
        for name, p in module.named_parameters(remove_duplicate=False):
            key = prefix + name
            if is_dedicated(p) or key not in state_dict:
                continue
            v = state_dict[key]
            fsdp_keys.append(key)
            mine = value_problems(key, v, tuple(p.shape), p.dtype, notes=notes)
            problems += mine
            views += live_views({key: v}, [p])
            if not mine and hasattr(p, "to_local") and not hasattr(v, "to_local"):
                state_dict[key] = distribute_like(v.to(device=p.device, dtype=p.dtype), p)
        # the entries the modules' load pre-hooks produce (a wrapper's renames), on a copy
        sim = simulate_load(module, state_dict, prefix, {h.id for h in self.handles})
        for k in (k for k in absent if prefix + k in sim.values):
            problems += self.check(prefix + k, self.keys[k], sim.values[prefix + k], notes)
            self.late.add(prefix + k)
        if sim.judged and load_strict():  # (torch passes its hooks True, applies strict after)
            problems += strict_key_problems(sim.missing, sim.unexpected)
        buffers = {prefix + k: tuple(b.shape)
                   for k, b in module.named_buffers(remove_duplicate=False)}
        problems += check_state_dict({k: tuple(v.shape) for k, v in state_dict.items() if
                                      k in buffers and isinstance(v, torch.Tensor)}, buffers).wrong
        problems += assign_problems(local_metadata.get("assign_to_params_buffers", False),
                                    not st.is_current(0), fsdp_keys)  # generation 0: no Muon yet
        agree(st, view_problems(problems, views), "model.load_state_dict on a dmuon model",
              route="torch")
        log_dtype_changes("model.load_state_dict", notes)
        self.staged = staged

    def owner_pre_load(self, module, state_dict, prefix, *rest, path: str) -> None:
        """Load pre-hook of a module holding dedicated params: stage an entry an ancestor's
        pre-hook produced (checked by the root's simulated load) and put the placeholder in its
        place."""
        if self.staged is None:
            return
        for attr, n in self.owned_by[path]:
            key = prefix + attr
            if key not in self.late or key not in state_dict:
                continue
            v = state_dict[key]
            notes: list = []
            problems = self.check(key, n, v, notes)
            log_narrowing(notes)
            if problems:  # the simulated load passed: the hook gave another value this time
                raise StateDictError(f"model.load_state_dict: {problems[0]} (a state-dict hook "
                                     "produced another value than in dmuon's check)")
            self.staged.setdefault(n, v)
            state_dict[key] = self.st.params[n]

    def post_load(self, module, incompatible_keys) -> None:
        self.late = set()
        staged, self.staged = self.staged, None
        if not staged:
            return
        st = self.st
        with torch.no_grad():  # a model dict holds the params' values: rounded to their dtype
            for n, t in self.transfer.to_owners(staged, lambda n: staged[n].to(st.orig_dtype[n])):
                st.masters[n].copy_(t)
        st.masters_changed(loaded=MODEL, keys=staged)  # (strict=False: what it held)


def register_state_dict_hooks(model: nn.Module, st) -> _Hooks:
    """Install the save and load hooks on ``model`` (the root) and its owning modules."""
    h = _Hooks(model, st)
    # torch marks public hooks with an attribute: plain functions, not bound methods
    h.handles = [model.register_state_dict_pre_hook(lambda *a: h.pre_save(*a)),
                 model.register_state_dict_post_hook(lambda *a: h.post_save(*a)),
                 model.register_load_state_dict_pre_hook(lambda *a: h.pre_load(*a)),
                 model.register_load_state_dict_post_hook(lambda *a: h.post_load(*a))]
    for path in h.owned_by:
        if not path:  # held by the root itself: its own hooks above see the entry
            continue
        m = model.get_submodule(path)
        r1 = m.register_state_dict_post_hook(lambda *a, _p=path: h.owner_post_save(*a, path=_p))
        r2 = m.register_load_state_dict_pre_hook(
            lambda *a, _p=path: h.owner_pre_load(*a, path=_p))
        h.own_hooks.update((r1.id, r2.id))
        h.handles += [r1, r2]
    return h
