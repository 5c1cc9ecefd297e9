"""dmuon: distributed Muon for PyTorch FSDP2/HSDP by dedicated ownership.

``import dmuon`` makes every later ``fully_shard`` call skip the params that
:func:`dedicate_params` marked (they carry ``_dedicated_owner_rank``), whatever the order in which
user code imported ``fully_shard`` (:mod:`dmuon.stateful.fsdp_patch`: how, and how to remove it).
It also teaches accelerate / HF ``Trainer``, when they are imported, about dmuon-prepared models
(:mod:`dmuon.integrations`). Nothing else changes torch. On a torch outside the supported range
(:data:`dmuon.stateful.compat.SUPPORTED_TORCH`) the import warns and installs nothing;
``dedicate_params`` then raises, and the pure core ``dmuon.functional`` works as anywhere.

Public API (the stateful wrapper, see SPEC §2):
  ``dedicate_params``, ``Muon``, ``no_sync``, ``wait_all_replicate_broadcasts``,
  ``get_model_state_dict`` / ``set_model_state_dict``, ``get_optimizer_state_dict`` /
  ``set_optimizer_state_dict``, ``read_state_dict``, ``save_sharded`` / ``load_sharded``
  (torch.distributed.checkpoint, never gathered, any topology), ``clip_grad_norm_``,
  ``verify_step`` (checks one step against single-device Muon/AdamW on the real mesh).
The pure core is ``dmuon.functional``.
"""

__version__ = "0.1.0"

from dmuon import functional  # noqa: E402,F401
from dmuon.stateful.dedicate import dedicate_params  # noqa: E402
from dmuon.stateful.fsdp_patch import install_fully_shard_patch as _install_fully_shard_patch  # noqa: E402
from dmuon.stateful.grad_clip import clip_grad_norm_, clip_grad_value_  # noqa: E402
from dmuon.stateful.no_sync import no_sync, wait_all_replicate_broadcasts  # noqa: E402
from dmuon.stateful.optimizer import Muon  # noqa: E402
from dmuon.stateful.optimizer_state_dict import get_optimizer_state_dict, set_optimizer_state_dict  # noqa: E402
from dmuon.stateful.checkpoint_sharded import load_sharded, save_sharded  # noqa: E402
from dmuon.stateful.verify import VerificationError, VerifyReport, verify_step  # noqa: E402
from dmuon.stateful.state_dict import (LoadResult, get_model_state_dict, read_state_dict,  # noqa: E402
                                       set_model_state_dict)

from dmuon.stateful.compat import torch_supported as _torch_supported  # noqa: E402
from dmuon.stateful.compat import unsupported_torch_message as _unsupported  # noqa: E402

if _torch_supported():
    _install_fully_shard_patch()
    from dmuon.integrations import install as _install_integrations  # noqa: E402

    _install_integrations()  # accelerate / HF Trainer learn about dmuon models (on their import)
else:
    import warnings as _warnings

    _warnings.warn(_unsupported("import dmuon"), RuntimeWarning, stacklevel=2)

__all__ = [
    "functional", "dedicate_params", "Muon", "no_sync", "wait_all_replicate_broadcasts",
    "get_model_state_dict", "set_model_state_dict", "get_optimizer_state_dict",
    "set_optimizer_state_dict", "clip_grad_norm_", "clip_grad_value_", "save_sharded", "load_sharded", "read_state_dict",
    "LoadResult", "verify_step", "VerificationError", "VerifyReport",
]
