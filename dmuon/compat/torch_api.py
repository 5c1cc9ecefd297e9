"""Every private PyTorch API dmuon uses, in one place, with the torch versions it was checked on.

dmuon is tested on torch :data:`SUPPORTED_TORCH` (2.11 through 2.15). Each function here wraps one
private API; ``tests/test_compat.py`` resolves every one of them on the installed torch (CI: 2.13;
the GPU machine: 2.11; ``bash .ci/torch-matrix 2.15.0``: 2.15), so a torch update that moves one
fails there by name instead of deep inside a training step.

A torch newer than the range warns at ``import dmuon`` and runs when every private API below still
resolves on it (:func:`private_api_report`); when one is gone, the import warns naming it, installs
nothing, and ``dedicate_params`` raises naming it. A torch older than the range is refused the same
way. :func:`torch_supported` is that rule; :func:`torch_tested` the range alone. Nothing else in dmuon touches a private torch name (the sharded checkpoint code,
owned by the checkpoint issue, uses only DCP's public planner API).

Private APIs and what they are for:

* ``torch.distributed.fsdp._fully_shard._fsdp_init._get_managed_states`` /
  ``_get_managed_modules`` — the one place FSDP2's init sees every ``fully_shard`` call whatever the
  user's import order (:mod:`dmuon.compat.fsdp_patch` wraps them); names in
  :data:`FSDP_INIT_MODULES`.
* ``torch.distributed.fsdp._fully_shard._fsdp_state._get_module_fsdp_state`` and, on the state,
  ``_fsdp_param_groups`` (each group's ``mesh_info.mesh``, ``fsdp_params``) and ``_mp_policy`` —
  which modules ``fully_shard`` took, with which mesh and mixed-precision policy.
* ``FSDPParamGroup.post_backward`` (wrapped per group instance), ``reduce_grads``, and on each
  ``FSDPParam`` ``sharded_param``, ``unsharded_accumulated_grad``, ``unsharded_param.grad`` —
  which FSDP2 params got a gradient on this rank before FSDP2 reduce-scatters (its
  ``set_reduce_scatter_unused_params`` sends a zero for the others).
* ``torch._C._current_graph_task_id`` — whether a hook runs inside a backward pass (activation
  checkpointing re-runs forward there).
* ``torch.autograd.Variable._execution_engine.queue_callback`` — run a function when the current
  backward pass ends (FSDP2 uses it for the same purpose).
* ``torch._C.DisableTorchFunctionSubclass`` and ``torch.Tensor._make_subclass`` — dmuon's tensor
  guards (:mod:`dmuon.stateful.runtime.guard_base`) run an allowed call as on a plain tensor, and
  build a gradient marker sharing a plain tensor's storage.
* ``DTensor._local_tensor`` — the local tensor object a DTensor holds (``to_local()`` returns a
  new view each call): the copies a state dict hands out are watched through it
  (:mod:`dmuon.functional.copy_log`).
* ``distributed_c10d._coalescing_manager(group, device, async_ops=True)`` — the grouped collective
  style's group call (:func:`coalesced_calls`: the backend's ``_start_coalescing`` /
  ``_end_coalescing``, one NCCL group of broadcasts or reduces).
* ``ProcessGroup._get_backend(device).options._timeout`` and
  ``distributed_c10d._set_pg_timeout`` — read a group's timeout (the default group's is the default
  bound of dmuon's own groups) and bound the mesh groups dmuon is given.
* ``DeviceMesh._get_root_mesh`` — the mesh a sub-mesh was sliced from (a dp slice of dmuon's own
  HSDP mesh passed without ``replicate_mesh`` is a mistake, not tensor parallelism).
* ``torch.distributed._composable.replicate`` (its ``state``) — whether torch's composable
  ``replicate`` was applied to a model (dmuon supports ``DistributedDataParallel`` instead).
* ``_ddp_params_and_buffers_to_ignore`` (:data:`DDP_IGNORE_ATTR`), the module attribute
  ``DistributedDataParallel`` reads (``_set_params_and_buffers_to_ignore_for_model`` sets it) — so
  DDP leaves dedicated params alone, and FSDP-mode models refuse DDP.
* ``torch.utils._pytree.tree_leaves`` — the tensors of any forward output, flattened as torch
  flattens it (containers torch and libraries register, e.g. HF ``ModelOutput``).
* :data:`DCP_METADATA_CLASSES` — the classes (``_StorageInfo``, ``_MEM_FORMAT_ENCODING`` and
  ``torch.serialization._get_layout`` among them) a ``torch.distributed.checkpoint`` ``.metadata``
  pickle names: the allow-list with which dmuon reads that file without running code
  (:mod:`dmuon.checkpoint.trust`).
* ``Module._parameters``, ``Module._state_dict_hooks``, ``Module._load_state_dict_pre_hooks`` — a
  module's param slots (a slot may hold a plain tensor or DTensor, set without ``__setattr__``'s
  checks) and its state-dict hooks (a foreign hook that rewrites dedicated entries is named; a
  load pre-hook is dry-run on a copy of the dict before anything loads).
"""
from __future__ import annotations

import datetime
import importlib
import re
import sys
from typing import Any, Callable, Collection, Iterator, Mapping, NamedTuple, Optional

import torch
import torch.nn as nn
from torch.utils import _pytree as torch_pytree

#: The torch releases dmuon is tested on: ``(lowest, highest)`` major.minor, both included (a newer
#: one runs with a warning when :func:`private_api_report` is all True on it).
SUPPORTED_TORCH: tuple[tuple[int, int], tuple[int, int]] = ((2, 11), (2, 15))

#: Modules of FSDP2's init that look up the managed-state collectors (``fsdp_patch`` wraps them).
FSDP_INIT_MODULES: tuple[str, ...] = (
    "torch.distributed.fsdp._fully_shard._fsdp_init",
    "torch.distributed.fsdp._fully_shard._fully_shard",
)
FSDP_STATE_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_state"
#: the module attribute ``DistributedDataParallel``'s constructor reads: names of the params and
#: buffers it leaves alone (``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``
#: sets it)
DDP_IGNORE_ATTR = "_ddp_params_and_buffers_to_ignore"

__all__ = [
    "SUPPORTED_TORCH", "FSDP_INIT_MODULES", "torch_version", "torch_tested", "torch_supported",
    "missing_private_apis", "unsupported_torch_message", "newer_torch_message", "import_warning",
    "fsdp_state", "fsdp_param_groups", "fsdp_managed_params", "wrap_fsdp_post_backward",
    "fsdp_mesh", "fsdp_mp_policy", "in_backward", "queue_backward_callback",
    "torch_function_disabled", "make_tensor_subclass", "held_local", "mesh_root",
    "composable_replicate_applied",
    "DDP_IGNORE_ATTR", "tree_leaves", "module_param_slots", "state_dict_hooks",
    "default_load", "load_strict", "LoadSimulation",
    "simulate_load",
    "coalesced_calls", "default_group_timeout", "group_timeout", "set_group_timeout",
    "private_api_report",
]


def torch_version(version: Optional[str] = None) -> tuple[int, int]:
    """``(major, minor)`` of ``version`` (default: the installed torch), e.g. ``"2.13.0+cpu"``."""
    m = re.match(r"(\d+)\.(\d+)", version or torch.__version__)
    if m is None:  # pragma: no cover - torch always has a numeric version
        raise ValueError(f"cannot parse the torch version {version or torch.__version__!r}")
    return int(m.group(1)), int(m.group(2))


def torch_tested(version: Optional[str] = None) -> bool:
    """Whether ``version`` (default: the installed torch) lies in :data:`SUPPORTED_TORCH`."""
    lo, hi = SUPPORTED_TORCH
    return lo <= torch_version(version) <= hi


def _installed(version: Optional[str]) -> bool:
    return version is None or version == str(torch.__version__)


def torch_supported(version: Optional[str] = None) -> bool:
    """Whether dmuon runs on torch ``version`` (default: the installed torch): a tested release, or
    a newer one on which every wrapped private API resolves (checked for the installed torch only;
    another version string is judged by the range's lower bound)."""
    lo, hi = SUPPORTED_TORCH
    v = torch_version(version)
    if v < lo:
        return False
    if v <= hi or not _installed(version):
        return True
    return not missing_private_apis()


def missing_private_apis() -> list[str]:
    """The private APIs of :func:`private_api_report` that the installed torch lacks."""
    return [name for name, ok in private_api_report().items() if not ok]


def _range() -> str:
    (a, b), (c, d) = SUPPORTED_TORCH
    return f"{a}.{b} through {c}.{d}"


def unsupported_torch_message(what: str) -> str:
    """The message ``import dmuon`` warns with and ``dedicate_params`` raises with on a torch dmuon
    does not run on (older than the range, or newer and missing a wrapped private API)."""
    lo, hi = SUPPORTED_TORCH
    v = torch_version()
    fix = (f"Install a tested torch (e.g. pip install torch=={hi[0]}.{hi[1]}.*); the pure core "
           "dmuon.functional works on any.")
    if v < lo:
        return (f"{what}: dmuon needs torch >= {lo[0]}.{lo[1]} (tested on {_range()}), but torch "
                f"{torch.__version__} is installed. " + fix)
    missing = missing_private_apis() if v > hi else []
    return (f"{what}: torch {torch.__version__} is newer than the releases dmuon is tested on "
            f"({_range()}) and lacks private APIs dmuon wraps in dmuon/compat/torch_api.py: "
            f"{missing} (dmuon hooks FSDP2's init through them so that fully_shard skips dedicated "
            "params, and reads FSDP2's state and autograd's through them). " + fix)


def newer_torch_message() -> str:
    """The warning ``import dmuon`` gives on a torch newer than the range that dmuon runs on."""
    hi = SUPPORTED_TORCH[1]
    return (f"import dmuon: torch {torch.__version__} is newer than the releases dmuon is tested on "
            f"({_range()}). Every private torch API dmuon wraps (dmuon/compat/torch_api.py) "
            "resolves on it, so dmuon runs; if something misbehaves, compare with torch "
            f"{hi[0]}.{hi[1]}.* (bash .ci/torch-matrix <version> runs the tests on any release).")


def import_warning() -> Optional[str]:
    """What ``import dmuon`` warns on the installed torch (``None``: a tested release)."""
    if torch_tested():
        return None
    if torch_supported():
        return newer_torch_message()
    return unsupported_torch_message("import dmuon")


# ------------------------------------------------------------------------------ FSDP2 state
def _state_getter() -> Callable[[nn.Module], Any]:
    mod = importlib.import_module(FSDP_STATE_MODULE)
    return mod._get_module_fsdp_state


def fsdp_state(module: nn.Module) -> Any:
    """The FSDP2 state ``fully_shard`` attached to ``module`` (``None`` if it has none)."""
    try:
        getter = _state_getter()
    except (ImportError, AttributeError):  # pragma: no cover - torch without FSDP2
        return None
    return getter(module)


def fsdp_param_groups(state: Any) -> list[Any]:
    """Every ``FSDPParamGroup`` of an FSDP2 state (torch >= 2.13 may hold several per module, one
    per mesh of ``shard_placement_fn``; older torches one at most)."""
    if state is None:
        return []
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    one = getattr(state, "_fsdp_param_group", None)  # torch 2.11 / 2.12
    return [one] if one is not None else []


def wrap_fsdp_post_backward(group: Any, before: Callable[[list[tuple[Any, bool]]], None]) -> None:
    """Run ``before([(sharded param, has a local gradient), ...])`` at the start of each
    ``FSDPParamGroup.post_backward`` of ``group`` (FSDP2 then reduce-scatters, or, under
    ``set_requires_gradient_sync(False)``, keeps the unsharded gradients). Wrapped once per group
    (the instance attribute FSDP2's own calls go through); a later call replaces ``before``."""
    if getattr(group, "_dmuon_post_backward_before", None) is None:
        run = group.post_backward

        def post_backward(*args: Any) -> Any:
            hook = group._dmuon_post_backward_before
            if hook is not None:  # a local gradient: this backward's, or no_sync's accumulated
                hook([(fp.sharded_param, fp.unsharded_accumulated_grad is not None or getattr(
                    getattr(fp, "_unsharded_param", None), "grad", None) is not None)
                    for fp in group.fsdp_params])
            return run(*args)
        group.post_backward = post_backward
    group._dmuon_post_backward_before = before


def fsdp_managed_params(state: Any) -> Iterator[nn.Parameter]:
    """The original ``nn.Parameter`` objects FSDP2 manages in ``state`` (sharded in place)."""
    for group in fsdp_param_groups(state):
        for fp in getattr(group, "fsdp_params", ()):
            p = getattr(fp, "sharded_param", None)
            if p is not None:
                yield p


def fsdp_mesh(group: Any) -> Any:
    """The DeviceMesh of one ``FSDPParamGroup`` (``None`` if it has none)."""
    return getattr(getattr(group, "mesh_info", None), "mesh", None)


def fsdp_divide_factor(state: Any) -> Optional[float]:
    """The factor FSDP2 divides ``state``'s summed gradients by (``set_gradient_divide_factor``;
    ``None``: its default, the mean over the data-parallel ranks)."""
    for group in fsdp_param_groups(state):
        f = getattr(group, "gradient_divide_factor", None)
        if f is not None:
            return float(f)
    return None


def fsdp_mp_policy(state: Any) -> Any:
    """The ``MixedPrecisionPolicy`` ``fully_shard`` was given for ``state``'s module."""
    return getattr(state, "_mp_policy", None) if state is not None else None


# ------------------------------------------------------------------------------ autograd
def in_backward() -> bool:
    """True inside a backward pass (e.g. activation checkpointing re-running a forward)."""
    return torch._C._current_graph_task_id() != -1


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` once the current backward pass has finished (call from inside a backward)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def torch_function_disabled() -> Any:
    """A context in which tensor subclasses' ``__torch_function__`` is not called
    (``torch._C.DisableTorchFunctionSubclass``): dmuon's guards run an allowed call as on a
    plain tensor."""
    return torch._C.DisableTorchFunctionSubclass()


def make_tensor_subclass(cls: type, data: torch.Tensor) -> torch.Tensor:
    """An instance of tensor subclass ``cls`` sharing ``data``'s storage, without running
    ``cls.__init__`` (``torch.Tensor._make_subclass``: how ``nn.Parameter`` is built)."""
    return torch.Tensor._make_subclass(cls, data)


def held_local(t: torch.Tensor) -> torch.Tensor:
    """The tensor object a write into ``t`` lands in: a DTensor's own local tensor
    (``DTensor._local_tensor``; ``to_local()`` gives a new view each call), else ``t``."""
    return getattr(t, "_local_tensor", t)


# ------------------------------------------------------------------------------ modules, meshes
def module_param_slots(module: nn.Module) -> dict[str, Optional[torch.Tensor]]:
    """``module``'s own param slots, the live dict (``Module._parameters``): what torch sees, and
    where a slot can be given a plain tensor or a DTensor without ``__setattr__``'s checks."""
    return module._parameters


def state_dict_hooks(module: nn.Module) -> Mapping[int, Callable]:
    """``module``'s own ``state_dict`` post-hooks, ``{handle id: hook}``
    (``Module._state_dict_hooks``)."""
    return module._state_dict_hooks


class LoadSimulation(NamedTuple):
    """What a ``load_state_dict`` of a module would see (:func:`simulate_load`)."""

    #: ``{key: value}`` each module would load into its own param or buffer named ``key``
    values: dict[str, Any]
    #: the keys a strict load would report missing / unexpected (where :attr:`judged`)
    missing: list[str]
    unexpected: list[str]
    #: ``missing`` / ``unexpected`` are torch's verdict (no hook of another owner could change it)
    judged: bool


def simulate_load(root: nn.Module, state_dict: Mapping[str, Any], prefix: str,
                  skip_hooks: Collection[int] = ()) -> LoadSimulation:
    """A ``load_state_dict`` of ``root`` (at ``prefix``) run on a copy of ``state_dict``, before
    anything loads, by torch's rule (``nn.Module._load_from_state_dict``): each module, after its
    load pre-hooks (run here on the copy; ``skip_hooks``: handle ids not to run; the root's own
    are running now), takes its params and persistent buffers and, under ``strict``, refuses keys
    naming neither a child nor one of them; then each child its part of the dict. Below a module
    that overrides ``_load_from_state_dict`` or ``set_extra_state`` no key is judged (it answers for
    its keys itself); nothing is judged where the root has a load pre-hook of another owner (it may
    rename keys first) or a module a load post-hook of another owner (it may forgive keys)."""
    judged = not any(hid not in skip_hooks for hid in root._load_state_dict_pre_hooks) and not any(
        not getattr(h, "__module__", "").startswith(("torch.", "dmuon."))
        for m in root.modules() for h in m._load_state_dict_post_hooks.values())
    sim = LoadSimulation({}, [], [], judged)
    meta = getattr(state_dict, "_metadata", {})

    def visit(m: nn.Module, sd: dict, pre: str, judge: bool) -> None:
        if m is not root:
            for hid, hook in list(m._load_state_dict_pre_hooks.items()):
                if hid not in skip_hooks:
                    hook(sd, pre, meta.get(pre[:-1], {}), True, [], [], [])
        local = {k for k, v in m._parameters.items() if v is not None} | {
            k for k, v in m._buffers.items() if v is not None
            and k not in m._non_persistent_buffers_set}
        sim.values.update((pre + k, sd[pre + k]) for k in local if pre + k in sd)
        judge = judge and default_load(m) and type(m).set_extra_state is nn.Module.set_extra_state
        if judge:
            sim.missing.extend(pre + k for k in local if pre + k not in sd)
            for key in sd:
                if key.startswith(pre):
                    head, *rest = key[len(pre):].split(".", 1)
                    if (head not in m._modules) if rest else (head not in local):
                        sim.unexpected.append(key)
        for name, child in m._modules.items():
            if child is not None:
                sub = pre + name + "."
                visit(child, {k: v for k, v in sd.items() if k.startswith(sub)}, sub, judge)

    visit(root, dict(state_dict), prefix, judged)
    return sim


def load_strict(max_depth: int = 64) -> Optional[bool]:
    """The ``strict`` argument of the ``nn.Module.load_state_dict`` call running now (``None``:
    none is; torch passes ``True`` to every module's load hooks and applies ``strict`` only after
    every entry was loaded, so a pre-hook reads it from that call's frame)."""
    code, f = nn.Module.load_state_dict.__code__, sys._getframe(1)
    for _ in range(max_depth):
        if f is None:
            return None
        if f.f_code is code:
            return bool(f.f_locals.get("strict", True))
        f = f.f_back
    return None


def default_load(module: nn.Module) -> bool:
    """Whether ``module`` loads its own entries with ``nn.Module._load_from_state_dict`` (a class
    overriding it may fill or rename entries: its missing keys are its own to report)."""
    return type(module)._load_from_state_dict is nn.Module._load_from_state_dict


def tree_leaves(tree: Any) -> list[Any]:
    """The leaves of ``tree`` as torch flattens it (``torch.utils._pytree``: dicts, lists,
    tuples, named tuples, and the containers torch and libraries register, e.g. HF
    ``ModelOutput``)."""
    return torch_pytree.tree_leaves(tree)


def fsdp_output_grad_tensors(output: Any) -> list[Any]:
    """The tensors requiring grad that FSDP2's post-forward finds in a forward output (where it
    registers its pre-backward hook): its own ``collect_grad_tensors`` (torch >= 2.13: dicts,
    lists, tuples, named tuples, dataclasses), else torch's pytree leaves (older FSDP2)."""
    try:
        from torch.distributed.fsdp._common_utils import collect_grad_tensors
        return list(collect_grad_tensors(output))
    except (ImportError, AttributeError, RuntimeError):
        return [t for t in torch_pytree.tree_leaves(output)
                if isinstance(t, torch.Tensor) and t.requires_grad]


def mesh_root(mesh: Any) -> Any:
    """The DeviceMesh ``mesh`` was sliced from (``DeviceMesh._get_root_mesh``; ``mesh`` itself
    for a root mesh), or ``None`` where this torch or object has none."""
    get_root = getattr(mesh, "_get_root_mesh", None)
    return get_root() if callable(get_root) else None


def composable_replicate_applied(module: nn.Module) -> bool:
    """Whether torch's composable ``replicate`` (``torch.distributed._composable.replicate``)
    was applied to ``module``."""
    try:
        from torch.distributed._composable.replicate import replicate
    except ImportError:  # pragma: no cover
        return False
    try:
        return replicate.state(module) is not None
    except Exception:  # noqa: BLE001 - no composable state on this module
        return False


# ------------------------------------------------------------------------------ process groups
def default_store() -> Any:
    """The default process group's key-value store (the rendezvous ``TCPStore``, behind its
    prefix), or ``None`` when this torch does not expose it."""
    import torch.distributed as dist
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - private API; the caller then skips what needs it
        return None


def default_group() -> Any:
    """The default process group object, or ``None`` (none now: destroyed or never made; or this
    torch does not expose it)."""
    import torch.distributed as dist
    try:
        return dist.distributed_c10d._get_default_group()
    except Exception:  # noqa: BLE001 - private API, or no default group
        return None


def coalesced_calls(group: Any, device: torch.device, parts: int = 2) -> Any:
    """A context in which the ``parts`` collectives issued on ``group`` (``async_op=True``) form one
    group call (NCCL: ``ncclGroupStart`` / ``End``); ``.wait()`` on what it yields waits for all of
    them (``distributed_c10d._coalescing_manager`` with a device: the backend's own coalescing;
    gloo has none). One part, or a backend without NCCL's group calls (gloo, torch's threaded test
    backend, whose coalescing refuses CUDA tensors): a null context yielding ``None``, the parts
    issued one after another."""
    import contextlib

    import torch.distributed as dist
    if parts <= 1 or "nccl" not in str(dist.get_backend(group)):
        return contextlib.nullcontext()
    return dist.distributed_c10d._coalescing_manager(group, device, async_ops=True)


def default_group_timeout(device_type: str) -> Optional[datetime.timedelta]:
    """The default process group's collective timeout for ``device_type`` (``None`` when this
    torch does not expose it)."""
    try:
        return default_group()._get_backend(torch.device(device_type)).options._timeout
    except Exception:  # noqa: BLE001 - private API; callers fall back to torch's default
        return None


def group_timeout(pg: Any, device_type: str) -> Optional[datetime.timedelta]:
    """The collective timeout of process group ``pg`` for ``device_type`` (``None`` if unknown)."""
    try:
        return pg._get_backend(torch.device(device_type)).options._timeout
    except Exception:  # noqa: BLE001 - private API
        return None


def set_group_timeout(pg: Any, timeout: datetime.timedelta) -> bool:
    """Set ``pg``'s collective timeout (gloo: a collective raises after it; NCCL: the watchdog
    aborts); False when this torch cannot."""
    import torch.distributed as dist
    fn = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if fn is None:
        return False
    try:
        fn(timeout, pg)
    except Exception:  # noqa: BLE001 - private API
        return False
    return True


# ------------------------------------------------------------------------------ DCP metadata
#: ``{module: names}`` a DCP ``.metadata`` pickle may name (its dataclasses, torch.Size, layouts,
#: memory formats, the checkpoint id's path); torch dtypes are allowed besides (``torch.<dtype>``)
DCP_METADATA_CLASSES: dict[str, tuple[str, ...]] = {
    "torch.distributed.checkpoint.metadata": (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
    "torch.serialization": ("_get_layout",),
    "torch": ("Size",),
    "collections": ("OrderedDict",),
    "pathlib": ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"),
    "pathlib._local": ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"),
}


def dcp_metadata_global(module: str, name: str) -> Any:
    """The object a DCP ``.metadata`` pickle may name as ``module.name``, or ``None`` when it is
    not on the allow-list (:data:`DCP_METADATA_CLASSES`, and ``torch.<dtype>``)."""
    if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
        return getattr(torch, name)
    if name not in DCP_METADATA_CLASSES.get(module, ()):
        return None
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def _dcp_metadata_api() -> bool:
    return all(dcp_metadata_global(m, n) is not None for m, names in DCP_METADATA_CLASSES.items()
               if not m.startswith("pathlib") for n in names)


def _resolves(check: Callable[[], Any]) -> bool:
    try:
        return bool(check())
    except Exception:  # noqa: BLE001 - a moved private API: the report says False, by name
        return False


def private_api_report() -> dict[str, bool]:
    """``{private API: resolvable on this torch}`` for every API listed in the module docstring
    (``tests/test_compat.py`` requires all True on the installed torch; on a torch newer than
    :data:`SUPPORTED_TORCH` an entry that is False stops dmuon, naming it). Never raises."""
    import torch.distributed as dist

    def init_fn(name: str) -> Callable[[], bool]:
        return lambda: callable(getattr(importlib.import_module(FSDP_INIT_MODULES[0]), name, None))

    def param_groups() -> bool:
        state_cls = getattr(importlib.import_module(FSDP_STATE_MODULE), "FSDPState", None)
        probe = state_cls() if state_cls is not None else None
        return probe is not None and (hasattr(probe, "_fsdp_param_groups")
                                      or hasattr(type(probe), "_fsdp_param_group"))

    checks: dict[str, Callable[[], Any]] = {
        "_fsdp_init._get_managed_states": init_fn("_get_managed_states"),
        "_fsdp_init._get_managed_modules": init_fn("_get_managed_modules"),
        "_fsdp_state._get_module_fsdp_state": lambda: callable(_state_getter()),
        "FSDPState._fsdp_param_groups": param_groups,
        "FSDPParamGroup.post_backward": lambda: callable(getattr(importlib.import_module(
            FSDP_STATE_MODULE.rpartition(".")[0] + "._fsdp_param_group").FSDPParamGroup,
            "post_backward", None)),
        "torch._C._current_graph_task_id": lambda: callable(
            getattr(torch._C, "_current_graph_task_id", None)),
        "Variable._execution_engine.queue_callback": lambda: callable(
            getattr(torch.autograd.Variable._execution_engine, "queue_callback", None)),
        "distributed_c10d._get_default_group": lambda: callable(
            getattr(dist.distributed_c10d, "_get_default_group", None)),
        "distributed_c10d._set_pg_timeout": lambda: callable(
            getattr(dist.distributed_c10d, "_set_pg_timeout", None)),
        "distributed_c10d._coalescing_manager": lambda: callable(
            getattr(dist.distributed_c10d, "_coalescing_manager", None)),
        "torch._C.DisableTorchFunctionSubclass": lambda: callable(
            getattr(torch._C, "DisableTorchFunctionSubclass", None)),
        "torch.Tensor._make_subclass": lambda: callable(getattr(torch.Tensor, "_make_subclass", None)),
        "DTensor._local_tensor": _dtensor_local_api,
        "DeviceMesh._get_root_mesh": _root_mesh_api,
        "_composable.replicate.state": _replicate_state_api,
        "DistributedDataParallel._ddp_params_and_buffers_to_ignore": _ddp_ignore_api,
        "DCP .metadata classes": _dcp_metadata_api,
        "torch.utils._pytree.tree_leaves": lambda: callable(
            getattr(torch_pytree, "tree_leaves", None)),
        **{f"Module.{attr}": (lambda attr=attr: isinstance(getattr(nn.Linear(1, 1), attr, None),
                                                            dict))
           for attr in ("_parameters", "_state_dict_hooks", "_load_state_dict_pre_hooks")},
    }
    return {name: _resolves(check) for name, check in checks.items()}


def _dtensor_local_api() -> bool:
    from torch.distributed.tensor import DTensor
    return hasattr(DTensor, "_local_tensor")  # (a slot)


def _root_mesh_api() -> bool:
    from torch.distributed.device_mesh import DeviceMesh
    return callable(getattr(DeviceMesh, "_get_root_mesh", None))


def _replicate_state_api() -> bool:
    from torch.distributed._composable.replicate import replicate
    return callable(getattr(replicate, "state", None))


def _ddp_ignore_api() -> bool:
    from torch.nn.parallel import DistributedDataParallel
    return callable(getattr(DistributedDataParallel,
                            "_set_params_and_buffers_to_ignore_for_model", None))
