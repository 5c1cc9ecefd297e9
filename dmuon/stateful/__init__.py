"""The acting layer: everything that owns mutable things, in wings that depend one way (lowest
first; ``tests/test_layout.py`` checks every import, lazy ones included):

* :mod:`~dmuon.stateful.runtime` — a model's state, hook groups, hooks, storage, gradient ledger,
  process groups and the executor that runs the step program's schedules; the agreement helper
  (decide on every rank, raise on every rank) and the tensor guards;
* :mod:`~dmuon.stateful.modes` — DDP mode, tensor parallelism, meta-device init, deferred
  dedication;
* :mod:`~dmuon.stateful.checkpoint` — the model's state dicts (dmuon's full dicts, torch's
  protocol) and their bucketed transfers;
* :mod:`~dmuon.stateful.optimizer` — ``dmuon.Muon``: the one owner driver of every chain, its
  storage policies, checks, telemetry and state dicts;
* :mod:`~dmuon.stateful.extras` — clipping, QK-clip;
* :mod:`~dmuon.stateful.setup` — ``dedicate_params`` and ``release``.

Above them and never imported by them: the file-level checkpoint manager
(:mod:`dmuon.checkpoint`) and verify mode (:mod:`dmuon.verify`). The acting layer calls the pure
core (:mod:`dmuon.functional`, :mod:`dmuon.newton_schulz`, :mod:`dmuon.kernels`) and
:mod:`dmuon.compat`; nothing there imports it back.
"""
