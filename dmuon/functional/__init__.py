"""The pure functional core of dmuon: no ``torch.distributed``, no globals, explicit state.

What this package exports is what the README's "The functional core" section shows:

* optimizers as explicit-state transformations: :mod:`muon`, :mod:`adamw` (``init`` / ``update``
  with NamedTuple states) and the composable transforms they are built from (:mod:`transforms`:
  ``chain``, ``partition`` and the stages);
* :func:`newton_schulz` (the iteration itself lives in :mod:`dmuon.newton_schulz`);
* the owner plan and the communication as data: :func:`plan_owners`, :func:`bucket_layout`,
  :func:`unshard_schedule`, :func:`reduce_schedule`, :func:`publish_schedule`,
  :func:`step_traffic`, :func:`simulate`;
* matrix views and the per-param policy: :class:`Batch`, :class:`Heads`, :class:`Split`,
  :class:`Transposed` (:mod:`matrix_view`), :class:`ParamPolicy`, :class:`Rule` (:mod:`policy`),
  :func:`hf_rules`; QK-clip: :mod:`qk_clip`.
"""
from dmuon.functional import adamw, muon, qk_clip, transforms
from dmuon.functional.hf_policy import hf_rules
from dmuon.functional.matrix_view import Batch, Heads, Split, Transposed
from dmuon.functional.policy import ParamPolicy, Rule
from dmuon.functional.buckets import bucket_layout
from dmuon.functional.plan import plan_owners
from dmuon.functional.schedule import publish_schedule, reduce_schedule, unshard_schedule
from dmuon.functional.program import StepProgram, step_program, step_traffic
from dmuon.functional.simulate import simulate
from dmuon.newton_schulz.iteration import newton_schulz

__all__ = [
    "adamw", "muon", "transforms", "newton_schulz", "plan_owners", "bucket_layout",
    "unshard_schedule", "reduce_schedule", "publish_schedule", "step_traffic", "simulate",
    "StepProgram", "step_program",
    "Batch", "Heads", "Split", "Transposed", "ParamPolicy", "Rule", "hf_rules", "qk_clip",
]
