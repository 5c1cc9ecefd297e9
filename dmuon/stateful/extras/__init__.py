"""Extras on a dedicated model: gradient clipping, QK-clip."""
