"""Which dedicated params a model now names otherwise, decided purely
(:mod:`dmuon.functional.renames`; the wrapped model itself: tests/test_user_paths_review4.py)."""
from __future__ import annotations

from dmuon.functional.renames import plain_name, renamed


def test_wrapper_segments_do_not_rename():
    assert plain_name("_orig_mod.module.layers.0._checkpoint_wrapped_module.w") == "layers.0.w"
    now = {1: ["_orig_mod.layers.0.w"], 2: ["base_model.model.layers.1.lora.w", "x"]}
    assert renamed({"layers.0.w": 1, "layers.1.w": 2, "layers.2.w": 3}, now) == [
        ("layers.1.w", "base_model.model.layers.1.lora.w"), ("layers.2.w", "<gone>")]
    assert renamed({"layers.1.w": 2}, {2: ["base_model.model.layers.1.w"]}) == []  # a prefix
