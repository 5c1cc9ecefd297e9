"""dmuon: distributed Muon for PyTorch FSDP2/HSDP by dedicated ownership.

``dmuon.functional`` is the pure core (orthogonalization, Muon/AdamW with explicit state,
owner planning, communication schedules); the stateful wrapper (``dedicate_params``, ``Muon``,
state-dict API) lives in ``dmuon.stateful`` and its public names are re-exported here.
"""

__version__ = "0.1.0"

from dmuon import functional  # noqa: E402,F401
