"""torchtitan (0.3.0) integration: ``dmuon.Muon`` as torchtitan's optimizer container.

torchtitan has no optimizer plugin registry (its names are a fixed table) and builds the optimizer
after parallelizing, from ``config.optimizer.build(model_parts=...)``; every component is
selected by its ``Config`` class. So the hook is the config: set

    config.optimizer = DMuonOptimizersContainer.Config(lr=0.02, adamw_lr=8e-4)

in the job config (Python config files / ``ConfigManager`` overrides), and call
``dedicate_params`` inside the model's ``parallelize_fn`` before its ``fully_shard`` calls, with
what ``fully_shard`` gets. Under torchtitan 0.3's default ``parallelism.spmd_backend=
"spmd_types"`` (and ``"full_dtensor"``) that is the full SPMD mesh and ``dp_mesh_dims``::

    spmd_mesh, dp_mesh_dims = torchtitan.distributed.full_dtensor.resolve_fsdp_mesh(parallel_dims)
    dmuon.dedicate_params(model, spmd_mesh, predicate,
                          options=dmuon.DedicateOptions(dp_mesh_dims=dp_mesh_dims))

(tensor parallelism there: ``"full_dtensor"`` or ``"partial_dtensor"``; under ``"spmd_types"``
TP slices are plain tensors and ``dmuon.Muon`` refuses them, naming the fix). Under
``"partial_dtensor"`` pass ``parallel_dims.get_mesh("fsdp")`` (plus ``replicate_mesh=`` for
HSDP). docs/integrations/torchtitan-spmd.md has the details.

:class:`DMuonOptimizersContainer` is an ``OptimizersContainer`` holding one ``dmuon.Muon`` over
the (single) model part, so torchtitan's training loop, lr schedulers (one ``LambdaLR`` over both of
Muon's param groups), metrics and ``CheckpointManager`` use it unchanged. Its ``state_dict`` is
torchtitan's flat, name-keyed layout (``state.{fqn}.{name}``, ``param_groups.{fqn}.{key}``) built
from ``Muon.state_dict()`` (dedicated momentum as ``Shard(0)`` DTensor rows, AdamW moments laid out
like FSDP2's params: DCP saves and re-shards them at any topology); it never runs torchtitan's
zero-gradient ``init_optim_state`` step on dmuon.Muon (whose state exists from construction).
Loading goes through ``Muon.load_state_dict``: validated on every rank before anything changes.

Needs torchtitan (the ``torchtitan`` test extra); importing this module without it raises.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import logging

import torch.distributed as dist
import torch.nn as nn

try:
    from torchtitan.components.optimizer import OptimizersContainer
except ImportError as e:  # pragma: no cover - exercised only without torchtitan
    raise ImportError("dmuon.integrations.torchtitan needs torchtitan (pip install "
                      "torchtitan==0.3.0, or dmuon's 'torchtitan' extra)") from e

from dmuon.stateful.optimizer.muon import Muon

logger = logging.getLogger(__name__)

__all__ = ["DMuonOptimizersContainer"]


class DMuonOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` with one ``dmuon.Muon`` (see the module docstring).

    Raises:
      NotImplementedError: more than one model part (pipeline parallelism).
      RuntimeError: the model part was not prepared by ``dmuon.dedicate_params``.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        lr: float = 0.02
        """Muon's learning rate (the dedicated matrices)."""
        momentum: float = 0.95
        nesterov: bool = True
        weight_decay: float = 0.0
        """Muon's decoupled weight decay."""
        ns_steps: int = 5
        adamw_lr: float = 8e-4
        """AdamW's learning rate (every other trainable param)."""
        adamw_betas: tuple[float, float] = (0.9, 0.95)
        adamw_eps: float = 1e-8
        adamw_weight_decay: float = 0.1
        muon_kwargs: dict[str, Any] = field(default_factory=dict)
        """Further keyword arguments of ``dmuon.Muon`` (e.g. ``ns_dtype``, ``adjust_lr_fn``)."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        if len(model_parts) != 1:
            raise NotImplementedError(
                f"DMuonOptimizersContainer: {len(model_parts)} model parts (pipeline "
                "parallelism) are not supported; dmuon needs the whole model on one mesh.")
        self.model_parts = list(model_parts)
        muon = Muon(model_parts[0], lr=config.lr, momentum=config.momentum,
                    nesterov=config.nesterov, weight_decay=config.weight_decay,
                    ns_steps=config.ns_steps, adamw_lr=config.adamw_lr,
                    adamw_betas=tuple(config.adamw_betas), adamw_eps=config.adamw_eps,
                    adamw_weight_decay=config.adamw_weight_decay, **config.muon_kwargs)
        self.optimizers = [muon]
        table = muon.routing_table()  # where every param went, logged once (rank 0)
        if table is not None and (not dist.is_initialized() or dist.get_rank() == 0):
            logger.info("%s", table)
        all_params = [p for g in muon.param_groups for p in g["params"]]
        self._validate_params(all_params)
        self._post_init(all_params)

    @property
    def muon(self) -> Muon:
        return self.optimizers[0]

    def state_dict(self) -> dict[str, Any]:
        """Collective: ``Muon.state_dict()`` in torchtitan's flat name-keyed layout."""
        sd = self.muon.state_dict()
        flat: dict[str, Any] = {}
        for g in sd["param_groups"]:
            names = g["param_names"]
            for pid, name in zip(g["params"], names):
                for k, v in sd["state"].get(pid, {}).items():
                    flat[f"state.{name}.{k}"] = v
                for k, v in g.items():
                    if k not in ("params", "param_names"):
                        flat[f"param_groups.{name}.{k}"] = v
        return flat

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Collective: load :meth:`state_dict`'s layout into ``Muon.load_state_dict`` (which
        validates everything on every rank before anything changes).

        Raises:
          KeyError: on every rank, when an entry of this optimizer is missing (the same keys
            are checked on every rank), naming it.
        """
        tmpl = self.muon.state_dict()  # the entries to expect, with their param names
        missing: list[str] = []

        def pick(key: str) -> Any:
            if key not in state_dict:
                missing.append(key)
                return None
            return state_dict[key]

        state: dict[int, dict[str, Any]] = {}
        groups: list[dict[str, Any]] = []
        for g in tmpl["param_groups"]:
            names = g["param_names"]
            for pid, name in zip(g["params"], names):
                if pid in tmpl["state"]:
                    state[pid] = {k: pick(f"state.{name}.{k}") for k in tmpl["state"][pid]}
            groups.append({k: (v if k in ("params", "param_names") or not names
                               else pick(f"param_groups.{names[0]}.{k}"))
                           for k, v in g.items()})
        if missing:
            raise KeyError(
                f"DMuonOptimizersContainer.load_state_dict: {len(missing)} entries missing from "
                f"the checkpoint, e.g. {missing[:4]}; was it saved by this container for this "
                "model?")
        self.muon.load_state_dict({"state": state, "param_groups": groups})

    def step(self, closure: Optional[Any] = None) -> None:
        if closure is not None:
            raise ValueError("DMuonOptimizersContainer.step does not take a closure")
        self.muon.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)


