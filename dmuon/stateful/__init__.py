"""The acting layer: everything that owns mutable things, in wings.

* :mod:`~dmuon.stateful.runtime` — ``dedicate_params``, the root state of a model, its hook
  groups, hooks, storage, process groups and the executor that runs the step program's schedules;
  the one agreement helper (decide on every rank, raise on every rank) and the tensor guards;
* :mod:`~dmuon.stateful.optimizer` — ``dmuon.Muon`` and what its ``step()`` uses (checks, the NS
  hook, telemetry);
* :mod:`~dmuon.stateful.modes` — DDP mode, tensor parallelism, deferred dedication, meta-device
  init;
* :mod:`~dmuon.stateful.checkpoint` — state dicts (dmuon's full dicts and torch's protocol) and
  their bucketed transfers (the file-level manager, ``save_sharded`` / ``load_sharded``, is
  :mod:`dmuon.checkpoint`, above this layer: nothing here imports it);
* :mod:`~dmuon.stateful.extras` — clipping, QK-clip, ``verify_step``.

Torch compatibility (private torch names, the ``fully_shard`` patch) is :mod:`dmuon.compat`.
Dependency rule: the acting layer calls the pure core (:mod:`dmuon.functional`,
:mod:`dmuon.newton_schulz`, :mod:`dmuon.kernels`) and :mod:`dmuon.compat`; nothing there imports
it back.
"""
