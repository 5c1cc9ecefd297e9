"""The pure functional core of dmuon: no ``torch.distributed``, no globals, explicit state.

What this package exports is what the README's "The functional core" section shows (loaded on
first use, so that ``import dmuon.functional.muon`` does not load the simulator or the planner):

* optimizers as explicit-state transformations: :mod:`muon`, :mod:`adamw` (``init`` / ``update``
  with NamedTuple states) and the composable transforms they are built from (:mod:`transforms`:
  ``chain``, ``partition`` and the stages); Muon's variants as chains (:mod:`variants`: NorMuon,
  Muon-Hyperball);
* :func:`newton_schulz` (the iteration itself lives in :mod:`dmuon.newton_schulz`);
* the owner plan and the communication as data: :func:`specs_from_named_shapes`,
  :func:`plan_owners`, :func:`bucket_layout`,
  :func:`unshard_schedule`, :func:`reduce_schedule`, :func:`publish_schedule`,
  :func:`step_program` (:class:`StepProgram`: every phase of a step, one traffic count),
  :func:`step_traffic`, :func:`simulate`; the step as pure phases (:mod:`phases`: gather,
  reduce, the owner's accounting, publish; the runtime calls them too), their compositions
  (:mod:`step`: ``rank_step``, ``world_step``, ``forward_gather``), the owner's update
  (:mod:`owner_step`), trees in and out of buckets (:mod:`packing`), vector params' replicated
  path (:mod:`replicated`), the simulator's checks (:mod:`order_check`, :mod:`memory_model`),
  split Newton–Schulz (:mod:`split_ns`) and the stages (:mod:`stages`);
  the collective style of a hook group (one per owner or one per bucket) and its cost:
  :func:`choose_style`, :class:`LinkCost` (:mod:`collectives`);
* matrix views and the per-param policy: :class:`Batch`, :class:`Heads`, :class:`Split`,
  :class:`Transposed` (:mod:`matrix_view`), :class:`ParamPolicy`, :class:`Rule` (:mod:`policy`),
  :func:`hf_rules`; QK-clip: :mod:`qk_clip`.
"""
from __future__ import annotations

import importlib
import sys
import types
from typing import Any

#: public name -> the module that defines it (modules: the module itself)
_EXPORTS: dict[str, str] = {
    "adamw": "dmuon.functional.adamw", "muon": "dmuon.functional.muon",
    "transforms": "dmuon.functional.transforms", "qk_clip": "dmuon.functional.qk_clip",
    "newton_schulz": "dmuon.newton_schulz.iteration",
    "plan_owners": "dmuon.functional.plan", "bucket_layout": "dmuon.functional.buckets",
    "unshard_schedule": "dmuon.functional.schedule",
    "reduce_schedule": "dmuon.functional.schedule",
    "publish_schedule": "dmuon.functional.schedule",
    "step_traffic": "dmuon.functional.program", "StepProgram": "dmuon.functional.program",
    "step_program": "dmuon.functional.program", "simulate": "dmuon.functional.simulate",
    "Batch": "dmuon.functional.matrix_view", "Heads": "dmuon.functional.matrix_view",
    "Split": "dmuon.functional.matrix_view", "Transposed": "dmuon.functional.matrix_view",
    "ParamPolicy": "dmuon.functional.policy", "Rule": "dmuon.functional.policy",
    "hf_rules": "dmuon.functional.hf_policy", "variants": "dmuon.functional.variants",
    "choose_style": "dmuon.functional.collectives", "LinkCost": "dmuon.functional.collectives",
    "collectives": "dmuon.functional.collectives", "phases": "dmuon.functional.phases",
    "step": "dmuon.functional.step", "owner_step": "dmuon.functional.owner_step",
    "packing": "dmuon.functional.packing", "replicated": "dmuon.functional.replicated",
    "order_check": "dmuon.functional.order_check",
    "memory_model": "dmuon.functional.memory_model", "split_ns": "dmuon.functional.split_ns",
    "stages": "dmuon.functional.stages",
    "specs_from_named_shapes": "dmuon.functional.specs",
    # a research loop's step at any shard size (docs/functional: "Research loops")
    "forward_gather": "dmuon.functional.step", "rank_step": "dmuon.functional.step",
    "world_step": "dmuon.functional.step",
    "replicated_program": "dmuon.functional.replicated",
    "replicated_step": "dmuon.functional.replicated",
}
#: names that are modules (``owner_step`` is the module: importing ``dmuon.functional.owner_step``
#: binds the package attribute to it, so a function of that name could not stay exported)
_MODULES = {"adamw", "muon", "transforms", "qk_clip", "variants", "collectives", "phases", "step",
            "owner_step", "packing", "replicated", "order_check", "memory_model", "split_ns",
            "stages"}


class _Package(types.ModuleType):
    """This package's module type: importing a submodule binds it as the package's attribute of
    its name, unless that name is exported as something else (``simulate``: the function, not the
    module ``dmuon.functional.simulate``), so a name means one thing whatever was imported first."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _EXPORTS and name not in _MODULES and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dmuon.functional' has no attribute {name!r}")
    mod = importlib.import_module(_EXPORTS[name])
    value = mod if name in _MODULES else getattr(mod, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = [
    "adamw", "muon", "transforms", "newton_schulz", "plan_owners", "bucket_layout",
    "unshard_schedule", "reduce_schedule", "publish_schedule", "step_traffic", "simulate",
    "StepProgram", "step_program", "choose_style", "LinkCost",
    "Batch", "Heads", "Split", "Transposed", "ParamPolicy", "Rule", "hf_rules", "qk_clip",
    "variants", "collectives", "phases", "step", "owner_step", "packing", "replicated",
    "order_check", "memory_model", "split_ns", "stages", "specs_from_named_shapes",
    "forward_gather", "rank_step", "world_step", "replicated_program", "replicated_step",
]
