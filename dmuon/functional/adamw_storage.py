"""How FSDP2's AdamW moments are stored: ``dmuon.Muon(adamw_state_dtype=...)`` (pure;
:class:`AdamWStorage`: fp32 or bf16, rounded after each update). The stateful layer's
:class:`dmuon.stateful.optimizer.state_storage.AdamWStorage` adds the logged note of a load that
converts; the Muon momentum's storage is :mod:`dmuon.stateful.optimizer.state_storage`."""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import Tensor

from dmuon.functional import state_dtype as sd

__all__ = ["AdamWStorage", "check_adamw_state_dtype"]


def check_adamw_state_dtype(dtype: Any) -> torch.dtype:
    """``adamw_state_dtype`` as a ``torch.dtype`` (the constructor's and every load's check).

    Raises:
      ValueError: not a storage dtype, or an 8-bit float."""
    d = sd.check_state_dtype(dtype, "adamw_state_dtype")
    if sd.is_scaled(d):
        raise ValueError(f"dmuon.Muon adamw_state_dtype must be torch.float32 or torch.bfloat16, "
                         f"got {d}: AdamW's second moment spans too many binades for an 8-bit "
                         "float with one scale")
    return d


class AdamWStorage:
    """FSDP2's AdamW moments (``exp_avg``, ``exp_avg_sq`` of the local shards) stored in
    ``adamw_state_dtype``: ``torch.float32`` (default: as the params, bitwise as before) or
    ``torch.bfloat16`` (round to nearest even after each update; the update runs on the decoded
    values in the params' dtype, as torch's AdamW would, then rounds). 8-bit floats are refused:
    the second moment spans more binades than one scale per shard keeps.
    """

    def __init__(self, dtype: Any):
        self.dtype = check_adamw_state_dtype(dtype)

    @property
    def identity(self) -> bool:
        return self.dtype == torch.float32

    def _tree(self, tree: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return {n: sd.encode(t, self.dtype).data for n, t in tree.items()}

    def stored_state(self, st: Any) -> Any:
        """The ``AdamWState`` ``st`` (working moments) with its moments as stored."""
        if self.identity:
            return st
        return st._replace(mu=self._tree(st.mu), nu=self._tree(st.nu))

    def working_state(self, st: Any, params: Mapping[str, Tensor]) -> Any:
        """The stored ``st`` with its moments decoded into the params' dtype (new tensors)."""
        if self.identity:
            return st
        return st._replace(**{k: {n: sd.decode(sd.Stored(t, None), params[n].dtype)
                                  for n, t in getattr(st, k).items()} for k in ("mu", "nu")})

    def commit_state(self, stored: Any, work: Any) -> Any:
        """The updated working state rounded back into ``stored``'s buffers."""
        if self.identity:
            return work
        for k in ("mu", "nu"):
            for n, t in getattr(work, k).items():
                sd.encode(t, self.dtype, out=getattr(stored, k)[n])  # rounded into the buffer
        return work._replace(mu=stored.mu, nu=stored.nu)
