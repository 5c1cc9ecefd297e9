"""Every public dmuon function that takes ``model`` names what it takes when given something else,
before anything runs (no process group needed): torch's clipping takes ``model.parameters()``, so
``dmuon.clip_grad_norm_(model.parameters(), 1.0)`` is what a torch user writes first (a user-path
review, session 14: it raised ``AttributeError: 'generator' object has no attribute
'named_modules'``)."""
from __future__ import annotations

import pytest
import torch.nn as nn

import dmuon


@pytest.mark.parametrize("call", [
    lambda m: dmuon.clip_grad_norm_(m.parameters(), 1.0),
    lambda m: dmuon.clip_grad_norm_(list(m.parameters()), 1.0),
    lambda m: dmuon.clip_grad_value_(m.parameters(), 1.0),
    lambda m: dmuon.get_model_state_dict(m.state_dict()),
], ids=["clip_norm_generator", "clip_norm_list", "clip_value_generator", "state_dict_of_a_dict"])
def test_a_non_module_model_argument_names_the_model(call):
    with pytest.raises(TypeError, match=r"takes the model itself .* not model\.parameters\(\)"):
        call(nn.Linear(2, 2))


def test_a_module_without_dedication_still_names_dedicate_params():
    with pytest.raises(RuntimeError, match="dedicate_params"):
        dmuon.clip_grad_norm_(nn.Linear(2, 2), 1.0)
