"""Run a callback right after a given module is imported (or now, if it already is).

dmuon teaches third-party frameworks (Accelerate, HF ``Trainer``) about dmuon models without making
``import dmuon`` import them: :func:`when_imported` calls ``callback(module)`` immediately when
``name`` is in ``sys.modules``, otherwise once, right after the module's code has run. The
mechanism is the standard import protocol (a ``sys.meta_path`` finder, PEP 451): the finder asks
the other finders for the real spec and wraps its loader so that ``exec_module`` is followed by the
callbacks; every other attribute is delegated to the real loader. A callback that raises is logged
and never breaks the user's import.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys
import threading
from types import ModuleType
from typing import Any, Callable

logger = logging.getLogger(__name__)

_lock = threading.RLock()
_pending: dict[str, list[Callable[[ModuleType], None]]] = {}
_busy: set[str] = set()


def _run(name: str, module: ModuleType, callbacks: list[Callable[[ModuleType], None]]) -> None:
    for cb in callbacks:
        try:
            cb(module)
        except Exception:  # noqa: BLE001 - an integration problem must not break the import
            logger.exception("dmuon: post-import hook %r for module %s failed", cb, name)


class _Loader(importlib.abc.Loader):
    """Delegates to the real loader; runs the pending callbacks after ``exec_module``."""

    def __init__(self, real: Any, name: str):
        self._real = real
        self._name = name

    def create_module(self, spec):  # noqa: D102
        return self._real.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:  # noqa: D102
        self._real.exec_module(module)
        with _lock:
            callbacks = _pending.pop(self._name, [])
        _run(self._name, module, callbacks)

    def __getattr__(self, item: str) -> Any:
        return getattr(self._real, item)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):  # noqa: D102
        with _lock:
            if fullname not in _pending or fullname in _busy:
                return None
            _busy.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        except (ImportError, ValueError):
            return None
        finally:
            with _lock:
                _busy.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _Loader(spec.loader, fullname)
        return spec


_finder = _Finder()


def when_imported(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call ``callback(module)`` now if ``name`` is imported, else right after it is imported."""
    module = sys.modules.get(name)
    if module is not None:
        _run(name, module, [callback])
        return
    with _lock:
        _pending.setdefault(name, []).append(callback)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
