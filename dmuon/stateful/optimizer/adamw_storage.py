"""The dtype of FSDP2's AdamW moments: ``dmuon.Muon(adamw_state_dtype=...)`` (:class:`AdamWStorage`:
the pure storage rules of :class:`dmuon.functional.adamw_storage.AdamWStorage`, fp32 or bf16
rounded after each update, with the logged note of a load that converts; the Muon momentum's
storage is :mod:`dmuon.stateful.optimizer.state_storage`)."""
from __future__ import annotations

from typing import Any, Optional

from dmuon.functional import adamw_storage as fstorage

__all__ = ["AdamWStorage"]


class AdamWStorage(fstorage.AdamWStorage):
    """:class:`dmuon.functional.adamw_storage.AdamWStorage` with :meth:`load` (checkpoints)."""

    def load(self, st: Any, saved_dtype: Optional[str], what: str) -> Any:
        """``stored_state`` of staged working moments read from a checkpoint whose AdamW moments
        were stored in ``saved_dtype`` (``None``: fp32); a note if that differs."""
        from dmuon.stateful.optimizer.state_storage import note_conversion
        note_conversion(saved_dtype, self.dtype, what, "AdamW moments", "adamw_state_dtype")
        return self.stored_state(st)
