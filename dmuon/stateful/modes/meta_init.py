"""Meta-device construction: ``dedicate_params`` on a model built under ``torch.device("meta")``.
Until the init window closes (collective: ``dmuon.Muon(model)``, the first forward or a state-dict
call) every dedicated param is a :class:`DedicatedUninit`: the master itself on its owner column,
storage-less elsewhere (writes are no-ops there, reads raise). The owner's values are *the* initial
values.

Design notes: docs/design/modes.md, "dmuon.stateful.modes.meta_init".
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn as nn

from dmuon.compat.torch_api import module_param_slots
from dmuon.functional.meta_init_check import init_window_problems, same_device
from dmuon.functional.schedule import publish_schedule
from dmuon.stateful.runtime.agree import agree
from dmuon.stateful.runtime.errors import DedicatedParamError, from_dtensor_api, tp_error
from dmuon.functional.guard_rules import first_instance
from dmuon.stateful.runtime.guard_base import (ATTRIBUTE_CALLS, DATA, PASS_ON, TorchGuard,
                                               call_plain, full_shape_query)

logger = logging.getLogger(__name__)

__all__ = ["DedicatedUninit", "MetaInit", "replace_params", "empty_param", "device_of_mesh"]

#: tensors made from one (shape / dtype only): on meta on a rank without the matrix, so that init
#: code building a scratch (torchtitan's fused-QKV init: new_empty, init, cat, copy_) stays free
_FACTORIES = frozenset({"new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided",
                        "empty_like", "zeros_like", "ones_like", "full_like", "rand_like",
                        "randn_like"})


def _from_to_empty() -> bool:
    """Whether the ``empty_like`` being handled is ``Module.to_empty``'s (its lambda in
    ``torch.nn.modules.module``), not init code asking for a scratch tensor."""
    f = sys._getframe(2)
    for _ in range(4):  # from the guard's dispatch: its __torch_function__, then torch's caller
        if f is None:
            return False
        if f.f_globals.get("__name__") == "torch.nn.modules.module":
            return True
        f = f.f_back
    return False


@dataclass(eq=False)
class _Info:
    """What a :class:`DedicatedUninit` knows about itself."""

    name: str
    shape: tuple[int, ...]
    holds: bool                      # this rank has the master (the owner's column)
    device: torch.device
    owner: int
    materialized: bool = False       # to_empty reached it


class DedicatedUninit(TorchGuard, nn.Parameter):
    """The class of a dedicated param of a meta-built model until the init window closes: every
    call runs on a rank that holds the matrix; elsewhere shape queries answer the full shape,
    writes are no-ops and value reads raise."""

    _guard_allowed = ATTRIBUTE_CALLS
    _guard_no_op_conversions = False

    @classmethod
    def _guard_special(cls, name: str, func: Callable, args: tuple, kwargs: dict) -> Any:
        me = next((a for a in list(args) + list(kwargs.values())
                   if isinstance(a, DedicatedUninit)), None)
        info: Optional[_Info] = getattr(me, "_dmuon_uninit", None)
        if info is None:  # pragma: no cover - a stray subclass instance
            return call_plain(func, args, kwargs)
        if name not in cls._guard_allowed:
            if from_dtensor_api():  # TP after dedicate_params: raise on holders and others alike
                raise tp_error(info.name, info.owner)
        if name == "empty_like" and args and args[0] is me and _from_to_empty():
            if not same_device(kwargs.get("device"), info.device) or \
                    kwargs.get("dtype", me.dtype) != me.dtype:
                raise DedicatedParamError(
                    f"dmuon: model.to_empty(device={kwargs.get('device')}) would move the "
                    f"dedicated param {info.name!r}, whose master dedicate_params placed on "
                    f"{info.device} (the mesh's device). Call to_empty with that device.")
            info.materialized = True
            return call_plain(torch.Tensor.detach, (me,), {})  # its own data: no new storage
        if info.holds:
            return call_plain(func, args, kwargs)
        # a rank without the matrix: metadata is the full shape, writes are no-ops
        out = full_shape_query(name, func, args, kwargs, me, info.shape)
        if out is not PASS_ON:
            return out
        if name in ("__get__", DATA):  # .data: a local tensor whose writes are no-ops
            if getattr(getattr(func, "__self__", None), "__name__", "") == "is_meta":
                return True
            return call_plain(func, args, kwargs)
        if name in cls._guard_allowed:
            return PASS_ON
        if name in _FACTORIES and args and args[0] is me:  # scratch "like" it: on meta here
            return call_plain(func, args, {**kwargs, "device": "meta"})
        if getattr(func, "__module__", "") == "torch.nn.init" or (
                name.endswith("_") and not name.startswith("_") and args and args[0] is me):
            return me  # an init function or an in-place write: nothing lives here to write
        return PASS_ON

    @classmethod
    def _guard_error(cls, name: str, func: Callable, args: tuple,
                     kwargs: dict) -> DedicatedParamError:
        info: _Info = first_instance(DedicatedUninit, args, kwargs)._dmuon_uninit
        return DedicatedParamError(
            f"dmuon: torch's {name!r} read the values of the dedicated param {info.name!r} during "
            f"meta-device init on a rank that does not hold it (owner: rank {info.owner}; its "
            "values exist only on the owner's shard column). Init code may write dedicated "
            "params (torch.nn.init functions, in-place ops: no-ops here) but not read them; "
            "derive such values after dmuon.Muon(model), from dmuon.get_model_state_dict.")


def device_of_mesh(mesh: Any) -> torch.device:
    """The device dmuon allocates a meta-built model's masters on: the mesh's (CUDA: current)."""
    kind = str(mesh.device_type)
    if kind == "cpu":
        return torch.device("cpu")
    mod = getattr(torch, kind, None)
    index = mod.current_device() if mod is not None and hasattr(mod, "current_device") else None
    return torch.device(kind, index)


def replace_params(model: nn.Module, chosen: Mapping[str, nn.Parameter],
                   make: Callable[[nn.Parameter], nn.Parameter]) -> dict[str, nn.Parameter]:
    """Put ``make(p)`` in place of every param ``p`` of ``chosen``, in every module that holds it
    (tied params stay one object); returns ``{name: new param}``. Meta-device init: ``make`` is
    :func:`empty_param`; tensor parallelism: a ``DTensor``'s local slice."""
    new: dict[int, nn.Parameter] = {}
    out: dict[str, nn.Parameter] = {}
    for n, p in chosen.items():
        if id(p) not in new:
            new[id(p)] = make(p)
        out[n] = new[id(p)]
    old = {id(p): p for p in chosen.values()}
    for mod in model.modules():
        slots = module_param_slots(mod)
        for k, v in list(slots.items()):
            if v is not None and id(v) in new and v is old[id(v)]:
                slots[k] = new[id(v)]
    return out


def empty_param(p: nn.Parameter, device: torch.device) -> nn.Parameter:
    """A new zero-size ``nn.Parameter`` on ``device`` for the meta param ``p`` (its dtype,
    ``requires_grad`` and user attributes; torchtitan sets none)."""
    q = nn.Parameter(torch.empty(0, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
    for k, v in vars(p).items():
        setattr(q, k, v)
    return q


@dataclass(eq=False)
class MetaInit:
    """The open init window of a meta-built dedicated model (``st.meta_init``).

    Attributes:
      infos: ``{name: _Info}``.  temps: ``{name: param-dtype tensor}`` for held matrices whose
      master is wider than the param (copied into the master at the close).
    """

    infos: dict[str, _Info]
    temps: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def open(cls, st: Any) -> "MetaInit":
        """Make every dedicated param of ``st`` a :class:`DedicatedUninit`."""
        infos: dict[str, _Info] = {}
        temps: dict[str, torch.Tensor] = {}
        for n, p in st.params.items():
            holds = n in st.masters
            info = _Info(n, tuple(st.shape[n]), holds, st.device, st.owner_rank[n])
            if holds:
                m = st.masters[n]
                if m.dtype == st.orig_dtype[n]:
                    p.data = m
                else:
                    temps[n] = torch.empty(m.shape, dtype=st.orig_dtype[n], device=st.device)
                    p.data = temps[n]
            if type(p) is not nn.Parameter:
                p.__class__ = nn.Parameter
            p._dmuon_uninit = info
            p.__class__ = DedicatedUninit
            infos[n] = info
        return cls(infos, temps)

    def problems(self, model: nn.Module, dedicated: set) -> list[str]:
        """This rank's reasons the window cannot close (no collective)."""
        late = [n for n, i in self.infos.items() if not i.materialized]
        left = [n for n, p in model.named_parameters() if p not in dedicated
                and (p.to_local() if hasattr(p, "to_local") else p).is_meta]
        left += [n for n, b in model.named_buffers() if b is not None and b.is_meta]
        return init_window_problems(late, left)

    def finish(self, st: Any, what: str) -> None:
        """Close ``st``'s init window (collective on every rank): the init's values into the
        masters (each replica's too), the params back to placeholders.

        Raises:
          RuntimeError: on every rank, when any rank has a param or buffer left on meta or a
            dedicated param ``to_empty`` never reached; nothing changes then (the window stays
            open).
        """
        model = st.model_ref()
        mine = self.problems(model, set(st.params.values())) if model is not None else []
        agree(mine, what="meta-init close agreement", via=st.mesh_groups, error=lambda detail: (
            RuntimeError(
                f"{what}: the model was built on the meta device and is not materialized "
                f"({detail}). After dedicate_params and fully_shard, call model.to_empty("
                "device=...) and the model's init (model.init_weights(), or each module's "
                "reset_parameters()) on every rank, before dmuon.Muon(model), the first forward "
                "or a state-dict call.")))
        # temporaries into the masters, published over each column (HSDP); then placeholders
        with torch.no_grad():
            for n, t in self.temps.items():
                st.masters[n].copy_(t)
        self.temps.clear()
        if st.R > 1:
            layout = st.storage.master_layout
            sched = publish_schedule(layout, [k for k in st.hook_groups.order
                                              if k in layout.groups])
            if len(sched):
                st.executor.launch(sched, st.storage.master_buffers).wait()
        for p in st.params.values():
            p.__dict__.pop("_dmuon_uninit", None)
            p.__class__ = nn.Parameter
        st.storage.set_placeholder_dtypes(st.orig_dtype)
        st.meta_init = None
        logger.info("dmuon: meta-device init closed; %d dedicated masters held here",
                    len(st.masters))
