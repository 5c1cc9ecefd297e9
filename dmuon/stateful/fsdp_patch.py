"""Make every ``fully_shard`` call skip parameters dedicated by :func:`dmuon.dedicate_params`.

FSDP2 (``torch.distributed.fsdp.fully_shard``) collects the parameters it manages in
``torch.distributed.fsdp._fully_shard._fsdp_init._get_managed_states(modules, ignored_params)``
(torch 2.11 - 2.14). User code may have imported ``fully_shard`` by name *before* ``import
dmuon``, so wrapping the public function is not enough; instead we wrap the managed-state
collector where FSDP2's init looks it up (a module global of ``_fsdp_init``, and of
``_fully_shard`` when a torch version imports it by name there). The wrapper adds every
parameter carrying ``_dedicated_owner_rank`` to ``ignored_params``. The module-discovery helper
``_get_managed_modules`` is wrapped the same way when present, so a module whose parameters
are all dedicated is treated exactly as with ``fully_shard(..., ignored_params=...)``.

Installation is idempotent; a missing hook point raises ``RuntimeError`` naming the torch
version, never a silent no-op.

Hook point by version: torch 2.13.0 and 2.14.1 (tested) call both collectors from
``_fsdp_init._get_modules_and_states`` (``_get_managed_states(modules, ignored_params=None)``,
``_get_managed_modules(root_modules, ignored_params=None, is_composable_fn=None,
get_state_fn=None)``); that helper came with pytorch PR #173580 (merged 2026-01-28, before the
2.11 branch cut). Earlier layouts imported both by name into ``_fully_shard`` and called them from
``fully_shard`` with the same two leading arguments; both layouts are patched.
"""
from __future__ import annotations

import functools
import importlib
import logging
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

logger = logging.getLogger(__name__)

DEDICATED_ATTR = "_dedicated_owner_rank"
_WRAPPED_FLAG = "_dmuon_skip_dedicated"
_INIT_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_init"
_CALLER_MODULES = (
    "torch.distributed.fsdp._fully_shard._fsdp_init",
    "torch.distributed.fsdp._fully_shard._fully_shard",
)


def is_dedicated(param: Any) -> bool:
    """True when ``param`` was dedicated to an owner rank by ``dedicate_params``."""
    return getattr(param, DEDICATED_ATTR, None) is not None


def _dedicated_in(modules: Iterable[nn.Module], recurse: bool) -> set[nn.Parameter]:
    found: set[nn.Parameter] = set()
    for module in modules:
        for param in module.parameters(recurse=recurse):
            if is_dedicated(param):
                found.add(param)
    return found


def _with_dedicated(ignored: set | None, modules: Iterable[nn.Module], recurse: bool) -> set | None:
    extra = _dedicated_in(modules, recurse)
    if not extra:
        return ignored
    return set(ignored or ()) | extra


def _skipping_dedicated(recurse: bool) -> Callable[[Callable], Callable]:
    """Wrapper factory for FSDP2's ``_get_managed_states(modules, ignored_params, ...)``
    (``recurse=False``: the modules' own params) and ``_get_managed_modules(root_modules,
    ignored_params, ...)`` (``recurse=True``: everything below the roots): both get the dedicated
    params added to ``ignored_params``."""
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(modules, ignored_params=None, *args, **kwargs):
            return fn(modules, _with_dedicated(ignored_params, modules, recurse), *args, **kwargs)

        setattr(wrapper, _WRAPPED_FLAG, True)
        return wrapper
    return wrap


def _patch_name(name: str, wrap: Callable[[Callable], Callable], required: bool) -> int:
    patched = 0
    for mod_name in _CALLER_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        fn = getattr(mod, name, None)
        if fn is None:
            continue
        if not getattr(fn, _WRAPPED_FLAG, False):
            setattr(mod, name, wrap(fn))
        patched += 1
    if required and patched == 0:
        raise RuntimeError(
            f"dmuon cannot make fully_shard skip dedicated parameters on torch {torch.__version__}: "
            f"'{name}' was not found in {', '.join(_CALLER_MODULES)}. dmuon supports torch 2.11-2.14; "
            "as a workaround pass ignored_params={p for p in model.parameters() if "
            f"getattr(p, '{DEDICATED_ATTR}', None) is not None}} to every fully_shard call."
        )
    return patched


def install_fully_shard_patch() -> None:
    """Install (idempotently) the hook that makes ``fully_shard`` skip dedicated parameters.

    Raises:
      RuntimeError: FSDP2's init path has no ``_get_managed_states`` in this torch version.
    """
    try:
        importlib.import_module(_INIT_MODULE)
    except ImportError as exc:  # pragma: no cover - torch without FSDP2
        raise RuntimeError(
            f"dmuon needs FSDP2 (torch>=2.11); importing {_INIT_MODULE} failed on torch "
            f"{torch.__version__}: {exc}"
        ) from exc
    _patch_name("_get_managed_states", _skipping_dedicated(recurse=False), required=True)
    _patch_name("_get_managed_modules", _skipping_dedicated(recurse=True), required=False)


def is_installed() -> bool:
    """True when the ``fully_shard`` hook is in place."""
    mod = importlib.import_module(_INIT_MODULE)
    return bool(getattr(getattr(mod, "_get_managed_states", None), _WRAPPED_FLAG, False))
