"""``dmuon.DedicateOptions``: how ``dedicate_params`` dedicates, beyond its seed arguments (pure
data, checked when built; the modes it names are fixed for the model's life).

``dedicate_params(model, mesh, predicate, *, replicate_mesh, hook_boundary_predicate,
reshard_after_forward, options)``: the per-param policy, the dtypes, the data-parallel backend,
the collectives' timeout, split Newton–Schulz and the collective style are options of one object,
so the call the seeds show stays the call users write. Their former spelling as keyword arguments
of ``dedicate_params`` works for one release with a ``DeprecationWarning``
(:func:`fold_deprecated`). The values are checked here (:func:`check_options`:
:func:`check_data_parallel`, :func:`split_settings` and the collectives'
:func:`dmuon.functional.collectives.check_choice`),
called by ``dedicate_params`` on every rank with the verdict agreed (a bad value on one rank
raises on all, never a hang).
"""
from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Union

from dmuon.functional.collectives import check_choice

__all__ = ["DedicateOptions", "DATA_PARALLEL_MODES", "fold_deprecated", "check_data_parallel",
           "split_settings", "check_options"]

#: the values of ``DedicateOptions(data_parallel=...)``
DATA_PARALLEL_MODES = ("fsdp", "ddp")


@dataclass(frozen=True)
class DedicateOptions:
    """How ``dedicate_params`` dedicates.

    Attributes:
      policy: a :class:`dmuon.functional.policy.ParamPolicy`: per-name rules (first match wins)
        that override the predicate's route, the matrix view, the lr / weight-decay multipliers
        and the param / reduce / master dtypes (:class:`dmuon.functional.policy.Rule`); what no
        rule sets keeps the defaults (``batch_dims``, then
        :func:`dmuon.functional.policy.default_view`: MoE expert stacks per expert, GPT-2
        ``Conv1D`` transposed, conv kernels flattened, other >=3-D Muon params an error). Its
        rules join the plan fingerprint (the same on every rank).
      mp_policy: a ``MixedPrecisionPolicy`` for the dedicated params (``param_dtype`` = dtype of
        the gathered copies, ``reduce_dtype`` = dtype of the gradient reduce). Default: the
        policy ``fully_shard`` got for the innermost module holding each param (found at the
        first forward); none: the param's dtype. A ``policy`` rule's ``param_dtype`` /
        ``reduce_dtype`` overrides it for the params it matches.
      batch_dims: ``(name, shape) -> int`` leading batch dims of a matrix: ``k > 0`` is the view
        ``Batch(k)`` (a ``0`` keeps the default view of a 2-D param, flattens a >=3-D one).
      data_parallel: how the rest of the model is made data parallel afterwards. ``"fsdp"``
        (default): ``fully_shard`` (FSDP2; HSDP with a 2-D mesh or ``replicate_mesh``).
        ``"ddp"``: ``DistributedDataParallel(model)``; ``mesh`` is the 1-D mesh of the DDP ranks,
        every rank keeps every matrix whole, each gradient is averaged to its owner, the owner
        steps it, the new value is broadcast back (:mod:`dmuon.stateful.modes.ddp`);
        ``reshard_after_forward`` does not apply (nothing is gathered).
      timeout: collective timeout of the process groups that move the dedicated params (default:
        the default group's). A rank that never reaches one of their collectives makes the
        waiting ranks raise ``RuntimeError`` naming the dmuon operation, hook group and ranks
        after at most this long (gloo; NCCL: its watchdog).
      split_ns: split Newton–Schulz (:mod:`dmuon.functional.split_exec`). An int ``k``: the plan
        may spread the NS of a matrix over up to ``k`` ranks of one node where that lowers its
        largest rank cost (``plan_owners(max_split=k)``; ``dmuon plan --max-split k``); 1
        (default): never. A mapping ``{name: k}``: split exactly these matrices ``k`` ways. Not
        with TP, ``data_parallel="ddp"``, a variant chain or lr / wd multipliers on the split
        matrices (each raises).
      collectives: how a hook group's matrices move over the shard axis
        (:mod:`dmuon.functional.collectives`): ``"per_owner"`` (default: one broadcast / reduce
        per owner column's bucket), ``"per_bucket"`` (one padded all-gather / reduce-scatter per
        hook group and dtype), ``"grouped"`` (the per-owner broadcasts / reduces of each phase,
        HSDP publish included, as one NCCL group call: all-gather-v / reduce-v, nothing padded,
        bitwise equal to per owner), ``"sharded"`` (each rank keeps ``1/G`` of a hook group's
        gathered copy in the compute dtype; the gathers are one all-gather of those parts, a
        refresh makes them current after the masters change; bitwise equal to per owner; asked
        for only: ``auto`` never picks it) or ``"auto"`` (per group, whichever the cost model
        projects faster; the choice and its reason are in ``program.groups[key].collectives`` /
        ``.collectives_reason``). ``"auto"`` and ``"grouped"`` stay per owner under TP and DDP;
        ``"per_bucket"`` and ``"sharded"`` there raise (``"sharded"`` at ``G = 1``: per owner).
      dp_mesh_dims: torch's ``DataParallelMeshDims`` when ``fully_shard`` gets the full SPMD mesh
        with it (torchtitan 0.3's default): pass ``dedicate_params`` that mesh, and the same
        ``dp_mesh_dims`` here; its shard / replicate names are the data-parallel axes, the other
        axes of size > 1 model (TP) axes (:mod:`dmuon.functional.spmd_mesh`).
    """

    policy: Any = None
    mp_policy: Any = None
    batch_dims: Optional[Callable[[str, tuple[int, ...]], int]] = None
    data_parallel: str = "fsdp"
    timeout: Optional[datetime.timedelta] = None
    split_ns: Union[int, Mapping[str, int]] = 1
    collectives: str = "per_owner"
    dp_mesh_dims: Any = None


def fold_deprecated(options: Optional[DedicateOptions],
                    deprecated: Mapping[str, Any]) -> tuple[DedicateOptions, list[str]]:
    """``options`` with the former keyword arguments of ``dedicate_params`` (``deprecated``)
    folded in, and one deprecation message per argument used.

    Raises:
      TypeError: an unknown argument, or ``options`` that is not a :class:`DedicateOptions`.
      ValueError: an argument and ``options`` set the same field to different values.
    """
    if options is None:
        options = DedicateOptions()
    if not isinstance(options, DedicateOptions):
        raise TypeError(f"dedicate_params: options must be a dmuon.DedicateOptions, got "
                        f"{type(options).__name__}")
    fields = {f.name: f.default for f in dataclasses.fields(DedicateOptions)}
    unknown = sorted(set(deprecated) - set(fields))
    if unknown:
        raise TypeError(f"dedicate_params() got unexpected keyword arguments {unknown}")
    notes, change = [], {}
    for k, v in deprecated.items():
        mine = getattr(options, k)
        if mine is not fields[k] and mine != fields[k] and mine is not v:
            raise ValueError(f"dedicate_params: {k} given both as an argument (deprecated) and in "
                             f"options, with different values; pass options only")
        change[k] = v
        notes.append(f"dedicate_params({k}=...) is deprecated: pass "
                     f"options=dmuon.DedicateOptions({k}=...)")
    return (dataclasses.replace(options, **change) if change else options), notes


def check_data_parallel(data_parallel: Any) -> str:
    """Validate ``DedicateOptions(data_parallel=...)``.

    Raises:
      ValueError: not one of :data:`DATA_PARALLEL_MODES`."""
    if data_parallel not in DATA_PARALLEL_MODES:
        raise ValueError(f"dedicate_params: data_parallel must be one of {DATA_PARALLEL_MODES} "
                         f"(\"fsdp\": the model is then fully_shard-ed, FSDP2 / HSDP; \"ddp\": it is "
                         f"then wrapped in DistributedDataParallel), got {data_parallel!r}")
    return data_parallel


def split_settings(split_ns: Any) -> tuple[int, Optional[dict[str, int]]]:
    """``(max_split, force_split)`` of ``DedicateOptions(split_ns=...)`` (``plan_owners``'
    arguments).

    Raises:
      ValueError: neither an int >= 1 nor a mapping."""
    if isinstance(split_ns, Mapping):
        force = {str(k): v for k, v in split_ns.items()}
        return max([2, *[v for v in force.values() if isinstance(v, int)]]), force or None
    if isinstance(split_ns, bool) or not isinstance(split_ns, int) or split_ns < 1:
        raise ValueError(f"dedicate_params: split_ns must be an int >= 1 (the most ranks one "
                         f"matrix's Newton–Schulz may be split over; 1: never) or a mapping "
                         f"{{param name: k}}, got {split_ns!r}")
    return split_ns, None


def check_options(options: DedicateOptions) -> tuple[int, Optional[dict[str, int]], str]:
    """The checks of ``options`` that need no model and no peers: ``(max_split, force_split,
    collectives)``.

    Raises:
      ValueError: a bad ``data_parallel``, ``split_ns`` or ``collectives``."""
    check_data_parallel(options.data_parallel)
    max_split, force_split = split_settings(options.split_ns)
    return max_split, force_split, check_choice(options.collectives, options.data_parallel)
