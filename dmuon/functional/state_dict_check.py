"""Pure checks and conversions for full (single-device style) checkpoints.

Two concerns, both free of ``torch.distributed`` and of any module:

* :func:`check_state_dict` compares what a state dict offers (``{key: shape}``) with what a model
  expects, with *tied* parameters (several names, one tensor) satisfied by any one of their names —
  HuggingFace ``save_pretrained`` drops the tied ``lm_head.weight``. It returns every missing,
  unexpected and wrong-shape entry at once, plus, for each expected key, the key to read it from.
* :func:`functional_states_from_full` / :func:`full_from_functional_states` convert between dmuon's
  topology-free optimizer state dict (the seeds' ``{"fsdp2": ..., "dedicated": ...}`` format) and the
  functional states :class:`~dmuon.functional.muon.MuonState` /
  :class:`~dmuon.functional.adamw.AdamWState`, so a checkpoint written by N ranks resumes in one
  process with :mod:`dmuon.functional` alone, and the other way round.

The optimizer format (every tensor full, keyed by fully-qualified parameter name)::

    {"fsdp2":     {name: {"exp_avg": T, "exp_avg_sq": T}},   # AdamW moments (non-Muon params)
     "dedicated": {name: {"momentum_buffer": T,               # Muon momentum of each matrix
                          "master": T}},                      # only if the master is wider than
                                                              # the param (e.g. fp32 for bf16)
     "adamw_step": int, "muon_step": int, "num_steps": int,   # counters (AdamW bias correction)
     "param_groups": [{"name": "muon", ...}, {"name": "adamw", ...}]}   # hyper-parameters
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, NamedTuple, Optional, Sequence

from dmuon.functional.adamw import AdamWState
from dmuon.functional.muon import MuonState

__all__ = [
    "StateDictCheck",
    "check_state_dict",
    "functional_states_from_full",
    "full_from_functional_states",
]

Shape = tuple[int, ...]


class StateDictCheck(NamedTuple):
    """Outcome of :func:`check_state_dict`.

    Attributes:
      missing: expected keys (one per tied group: its first name) absent from the dict.
      unexpected: keys of the dict the model does not have.
      wrong: ``"key: shape (a, b), expected (c, d)"`` (or ``"key: not a tensor (...)"``) messages.
      source: ``expected key -> key of the dict to read it from`` for every expected key that can
        be filled (a tied name absent from the dict reads from a present alias).
    """

    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    wrong: tuple[str, ...]
    source: Mapping[str, str]

    def problems(self, strict: bool = True) -> list[str]:
        """Human-readable problems: wrong entries always; missing / unexpected when ``strict``."""
        out = []
        if strict and self.missing:
            out.append(f"missing keys {list(self.missing)}")
        if strict and self.unexpected:
            out.append(f"unexpected keys {list(self.unexpected)}")
        if self.wrong:
            out.append("wrong entries: " + "; ".join(self.wrong))
        return out


def check_state_dict(given: Mapping[str, Optional[Shape]], expected: Mapping[str, Shape],
                     tied: Iterable[Sequence[str]] = ()) -> StateDictCheck:
    """Compare a state dict's keys and shapes with the model's.

    Args:
      given: ``{key: shape}`` of the dict to load; ``None`` (or a type name string) for an entry
        that is not a tensor.
      expected: ``{key: shape}`` of the model (single-device ``model.state_dict()`` spelling).
      tied: groups of expected keys that name one tensor (e.g. ``("model.embed_tokens.weight",
        "lm_head.weight")``); a group is satisfied by any one member, every present member must
        have the right shape.

    Returns:
      a :class:`StateDictCheck`; the caller decides which problems are fatal (``strict``).
    """
    alias: dict[str, tuple[str, ...]] = {}
    for group in tied:
        group = tuple(k for k in group if k in expected)
        for k in group:
            alias[k] = group
    wrong = []
    for k, shape in given.items():
        if k not in expected:
            continue
        if shape is None or isinstance(shape, str):
            wrong.append(f"{k}: not a tensor ({shape or 'unknown type'})")
        elif tuple(shape) != tuple(expected[k]):
            wrong.append(f"{k}: shape {tuple(shape)}, expected {tuple(expected[k])}")
    bad = {w.split(":", 1)[0] for w in wrong}
    missing, source = [], {}
    for k in expected:
        group = alias.get(k, (k,))
        present = [a for a in group if a in given and a not in bad]
        if present:
            source[k] = k if k in present else present[0]
        elif k == group[0] and not any(a in given for a in group):
            missing.append(k)
    unexpected = tuple(k for k in given if k not in expected)
    return StateDictCheck(tuple(missing), unexpected, tuple(wrong), source)


def functional_states_from_full(osd: Mapping[str, Any]) -> tuple[MuonState, AdamWState]:
    """Functional optimizer states from a full dmuon optimizer state dict (any topology).

    Args:
      osd: the dict of ``dmuon.get_optimizer_state_dict`` (or of ``dcp_to_torch_save`` on a
        ``dmuon.save_sharded`` checkpoint, its ``"optim"`` entry).

    Returns:
      ``(MuonState(step, momentum={name: buffer}), AdamWState(step, mu={name: exp_avg},
      nu={name: exp_avg_sq}))`` holding the dict's own tensors (no copies). Empty sections (a
      checkpoint taken before the first step) give empty dicts; ``dmuon.functional.muon.init`` /
      ``adamw.init`` give zero states for those.

    Raises:
      ValueError: the dict lacks the ``"fsdp2"`` / ``"dedicated"`` sections.
    """
    for key in ("fsdp2", "dedicated"):
        if not isinstance(osd.get(key), Mapping):
            raise ValueError(f"not a dmuon optimizer state dict: no {key!r} section (expected the "
                             "output of dmuon.get_optimizer_state_dict)")
    mom = {n: s["momentum_buffer"] for n, s in osd["dedicated"].items()}
    mu = {n: s["exp_avg"] for n, s in osd["fsdp2"].items()}
    nu = {n: s["exp_avg_sq"] for n, s in osd["fsdp2"].items()}
    return (MuonState(step=int(osd.get("muon_step", 0)), momentum=mom),
            AdamWState(step=int(osd.get("adamw_step", 0)), mu=mu, nu=nu))


def full_from_functional_states(muon_state: MuonState, adamw_state: AdamWState,
                                param_groups: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """The inverse of :func:`functional_states_from_full`: a dict ``dmuon.set_optimizer_state_dict``
    loads at any topology (momentum / moments must be flat ``{name: full tensor}`` dicts).

    Args:
      muon_state: Muon state of the dedicated matrices.
      adamw_state: AdamW state of every other trainable param.
      param_groups: optional hyper-parameter dicts (``{"name": "muon" | "adamw", ...}``).

    Returns:
      the full optimizer state dict (references the states' tensors; no copies).
    """
    return {"fsdp2": {n: {"exp_avg": adamw_state.mu[n], "exp_avg_sq": adamw_state.nu[n]}
                      for n in adamw_state.mu},
            "dedicated": {n: {"momentum_buffer": b} for n, b in muon_state.momentum.items()},
            "adamw_step": int(adamw_state.step), "muon_step": int(muon_state.step),
            "num_steps": max(int(adamw_state.step), int(muon_state.step)),
            "param_groups": [dict(g) for g in param_groups]}
