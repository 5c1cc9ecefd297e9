"""The patch that makes every ``fully_shard`` skip dedicated params: install, remove, verify.

Contract (the seeds'): after ``import dmuon``, every ``fully_shard`` call skips the parameters
:func:`dmuon.dedicate_params` marked with ``_dedicated_owner_rank``, whatever the order in which
user code imported ``fully_shard``.

How: FSDP2 collects the parameters a ``fully_shard`` call manages in
``_fsdp_init._get_managed_states(modules, ignored_params)`` and the modules in
``_get_managed_modules(root_modules, ignored_params, ...)`` (torch 2.11 - 2.15; both looked up as
module globals of the modules in :data:`dmuon.compat.torch_api.FSDP_INIT_MODULES` at call time).
User code may hold ``fully_shard`` by name from before ``import dmuon``, so wrapping the public
function would not be enough; the patch wraps those two collectors instead, adding every parameter
that carries ``_dedicated_owner_rank`` to ``ignored_params`` — exactly what
``fully_shard(..., ignored_params=...)`` does. torch's composable ``replicate`` shares FSDP2's init
in these releases, so it skips dedicated params too.

Lifecycle:

* :func:`install_fully_shard_patch` — the one place that installs it (``import dmuon`` calls it on a
  supported torch; ``dedicate_params`` calls it again, idempotently). It records the original
  functions.
* :func:`remove_fully_shard_patch` — restores torch's original functions exactly (the same objects);
  later ``fully_shard`` calls manage dedicated params like any other. Models already prepared keep
  working only if they were sharded while the patch was in place.
* :func:`check_not_taken_over` — run by ``dmuon.Muon(model)`` and by the first forward: a dedicated
  param that FSDP2 replaced by a DTensor (the patch was removed, or a torch update moved the hook
  points so it silently stopped taking effect) raises, naming the patch and the torch version,
  instead of a shape error deep inside the first matmul.
"""
from __future__ import annotations

import functools
import importlib
import logging
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.nn as nn

from dmuon.compat.spmd_mesh import keep_spmd_types
from dmuon.compat.torch_api import (FSDP_INIT_MODULES, module_param_slots, torch_supported,
                                   unsupported_torch_message)

logger = logging.getLogger(__name__)

DEDICATED_ATTR = "_dedicated_owner_rank"
#: on a module: the names of its param slots a deferred ``dedicate_params`` selected
#: (:mod:`dmuon.stateful.modes.deferred`); ``fully_shard`` skips the params found there
PENDING_SLOTS_ATTR = "_dmuon_pending_slots"
_WRAPPED_FLAG = "_dmuon_skip_dedicated"
#: ``(module name, function name) -> torch's original function`` while the patch is installed
_ORIGINALS: dict[tuple[str, str], Callable] = {}

__all__ = ["DEDICATED_ATTR", "PENDING_SLOTS_ATTR", "is_dedicated", "install_fully_shard_patch",
           "remove_fully_shard_patch", "is_installed", "check_not_taken_over"]


def is_dedicated(param: Any) -> bool:
    """True when ``param`` was dedicated to an owner rank by ``dedicate_params``."""
    return getattr(param, DEDICATED_ATTR, None) is not None


def _with_dedicated(ignored: set | None, modules: Iterable[nn.Module], recurse: bool) -> set | None:
    extra = {p for m in modules for p in m.parameters(recurse=recurse) if is_dedicated(p)}
    for m in modules:  # a deferred dedication's slots (dmuon.stateful.modes.deferred): whatever is there
        for sub in (m.modules() if recurse else (m,)):
            slots = sub.__dict__.get(PENDING_SLOTS_ATTR, ())
            for leaf, p in module_param_slots(sub).items():
                if leaf in slots and p is not None:
                    extra.add(p)
                    keep_spmd_types(sub, leaf, p)  # to_empty drops them (compat/spmd_mesh.py)
    if not extra:
        return ignored
    return set(ignored or ()) | extra


def _skipping_dedicated(fn: Callable, recurse: bool) -> Callable:
    """``fn(modules, ignored_params, ...)`` with the dedicated params of ``modules`` (their own:
    ``recurse=False``, for ``_get_managed_states``; everything below them: ``recurse=True``, for
    ``_get_managed_modules``) added to ``ignored_params``."""
    @functools.wraps(fn)
    def wrapper(modules, ignored_params=None, *args, **kwargs):
        return fn(modules, _with_dedicated(ignored_params, modules, recurse), *args, **kwargs)

    setattr(wrapper, _WRAPPED_FLAG, True)
    return wrapper


#: the collectors the patch wraps: ``name -> (recurse, required)``
_TARGETS: Mapping[str, tuple[bool, bool]] = {
    "_get_managed_states": (False, True),
    "_get_managed_modules": (True, False),
}


def install_fully_shard_patch() -> None:
    """Install (idempotently) the hook that makes ``fully_shard`` skip dedicated params.

    Raises:
      RuntimeError: this torch is outside :data:`dmuon.compat.torch_api.SUPPORTED_TORCH`, or its
        FSDP2 init has no ``_get_managed_states`` (nothing is changed then).
    """
    if not torch_supported():
        raise RuntimeError(unsupported_torch_message("dmuon cannot patch fully_shard"))
    found: list[tuple[Any, str, str, bool]] = []
    for mod_name in FSDP_INIT_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        for name, (recurse, _) in _TARGETS.items():
            if getattr(mod, name, None) is not None:
                found.append((mod, mod_name, name, recurse))
    missing = [n for n, (_, required) in _TARGETS.items() if required
               and not any(f[2] == n for f in found)]
    if missing:
        raise RuntimeError(
            f"dmuon cannot make fully_shard skip dedicated parameters on torch {torch.__version__}: "
            f"{missing} not found in {', '.join(FSDP_INIT_MODULES)}. As a workaround pass "
            "ignored_params={p for p in model.parameters() if getattr(p, "
            f"'{DEDICATED_ATTR}', None) is not None}} to every fully_shard call.")
    for mod, mod_name, name, recurse in found:
        fn = getattr(mod, name)
        if getattr(fn, _WRAPPED_FLAG, False):
            continue
        _ORIGINALS[(mod_name, name)] = fn
        setattr(mod, name, _skipping_dedicated(fn, recurse))
    logger.debug("dmuon: fully_shard patch installed on %s", sorted(_ORIGINALS))


def remove_fully_shard_patch() -> None:
    """Restore torch's original FSDP2 collectors exactly (no-op if the patch is not installed).

    After this, ``fully_shard`` manages dedicated params like any other (a later ``dmuon.Muon``
    on a model sharded that way raises, see :func:`check_not_taken_over`); ``import dmuon`` does
    not reinstall it, :func:`install_fully_shard_patch` (or ``dedicate_params``) does."""
    for (mod_name, name), fn in list(_ORIGINALS.items()):
        setattr(importlib.import_module(mod_name), name, fn)
        del _ORIGINALS[(mod_name, name)]


def is_installed() -> bool:
    """True when both FSDP2 collectors found on this torch are wrapped."""
    mod = importlib.import_module(FSDP_INIT_MODULES[0])
    return all(getattr(getattr(mod, name, None), _WRAPPED_FLAG, False)
               for name in _TARGETS if getattr(mod, name, None) is not None)


def check_not_taken_over(model: nn.Module, params: Mapping[str, nn.Parameter], what: str) -> None:
    """Raise if FSDP2 took over a dedicated param (``model``'s attribute is no longer the param
    ``dedicate_params`` marked, or it is a DTensor).

    Raises:
      RuntimeError: naming the params, the patch and the torch version.
    """
    from torch.distributed.tensor import DTensor

    bad = []
    for n, p in params.items():
        try:
            cur = model.get_parameter(n)
        except AttributeError:
            cur = None
        if cur is not p or isinstance(cur, DTensor):
            bad.append(n)
    if not bad:
        return
    state = "installed" if is_installed() else "NOT installed"
    raise RuntimeError(
        f"{what}: {len(bad)} dedicated params ({bad[:4]}{' ...' if len(bad) > 4 else ''}) are no "
        "longer the params dedicate_params prepared: FSDP2 took them over (fully_shard sharded "
        "them instead of skipping them), or they were replaced (torch.func.functional_call and "
        "parametrizations swap them during a call: run one ordinary forward of the model first, "
        f"and call dmuon.Muon(model) outside such a call). dmuon's fully_shard patch is {state} "
        f"on torch {torch.__version__}. Call fully_shard only after `import dmuon` and "
        "dmuon.dedicate_params (and never after dmuon.compat.fsdp_patch.remove_fully_shard_patch"
        "()), or pass ignored_params={p for p in model.parameters() if getattr(p, "
        f"'{DEDICATED_ATTR}', None) is not None}} to every fully_shard call.")
