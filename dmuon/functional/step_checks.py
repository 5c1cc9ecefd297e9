"""The verdicts of the checks ``dmuon.Muon.step`` runs before anything changes (pure: the
stateful layer gathers what every rank holds, these decide and raise): a superseded optimizer, an
earlier step that failed part-way, or no fresh gradient, a gradient on a param frozen at
construction, a gradient of the last step never cleared, an FSDP2 param with a gradient on some ranks only (or, where FSDP2 sends zeros for
those, on none: :func:`unused_everywhere`), ranks whose hook groups launched different collectives
since the last step (:func:`launches_differ`), a non-finite gradient; and the
verdict on a step that raised (:func:`step_broken`, from every rank's outcome)."""
from __future__ import annotations

import numbers
import zlib
from typing import Any, Optional, Sequence

import torch

from dmuon.functional.optimizer_format import hparams
from dmuon.functional.tree import flatten

__all__ = ["check_step_ready", "check_outside_grads", "check_grads_on_all_ranks", "unused_everywhere",
           "check_cleared", "pre_step_verdict", "check_publish_consumed",
           "check_finite_flags", "write_count", "check_not_broken", "step_broken",
           "broken_step_message", "LAUNCH_PRIME", "fold_launch", "combine_launches",
           "LaunchLog", "all_equal", "launches_differ", "hparams_fingerprint", "hparams_differ"]

#: a rank's launch fingerprint is below this prime, so that its ``(h, h * h)`` summed over ranks
#: stays exact in the pre-step all-reduce's int64 (up to 2**63 / LAUNCH_PRIME**2 = 131,072 ranks)
LAUNCH_PRIME = 8_388_593


def fold_launch(h: int, label: str) -> int:
    """The fingerprint ``h`` after one more launch named ``label``: a rolling hash of a sequence,
    equal on two ranks when they launched the same in the same order (and, but for a collision
    of odds ``1 / LAUNCH_PRIME``, only then)."""
    return (h * 1_000_003 + zlib.crc32(label.encode())) % LAUNCH_PRIME


def combine_launches(kinds: dict[str, int]) -> int:
    """One fingerprint of the per-kind fingerprints ``kinds`` (each folded from 1)."""
    h = 1
    for kind in sorted(kinds):
        h = fold_launch(h, f"{kind}:{kinds[kind]}")
    return h


class LaunchLog:
    """What the hook groups launched since the last step, as one fingerprint per kind of launch
    (``"unshard"``: forward gathers and re-gathers, ``"reduce"``, ``"publish"``; each kind keeps
    one order on every rank, whatever the kinds' interleaving: :func:`fold_launch`, from 1). The
    pre-step all-reduce compares :meth:`take` across ranks (:func:`launches_differ`)."""

    def __init__(self) -> None:
        self.lanes: dict[str, int] = {}

    def note(self, lane: str, label: str) -> None:
        self.lanes[lane] = fold_launch(self.lanes.get(lane, 1), label)

    def take(self) -> int:
        """The kinds' fingerprints as one (and start again)."""
        kinds, self.lanes = self.lanes, {}
        return combine_launches(kinds)


def all_equal(total: int, total_sq: int, world: int) -> bool:
    """The ``world`` ranks' values were all equal, read from their sum ``total`` and the sum of
    their squares ``total_sq`` (exactly when ``total ** 2 == world * total_sq``)."""
    return total * total == world * total_sq


def hparams_fingerprint(groups: Any) -> int:
    """A fingerprint (``< LAUNCH_PRIME``) of an optimizer's param groups' hyper-parameters
    (:func:`~dmuon.functional.optimizer_format.hparams`): equal on ranks that step with the same
    ones (and, but for a collision, only then). Values are read as data (numbers by value,
    whatever their Python or numpy type; strings, dtypes, CPU tensors' values, containers of
    them); other objects a library may keep in a group (a function: its repr holds an address
    that differs by process) count by their type alone."""
    return fold_launch(1, repr([sorted((str(k), _as_data(v)) for k, v in hparams(g).items())
                                for g in groups]))


def _as_data(v: Any) -> str:
    if isinstance(v, numbers.Real) and not isinstance(v, bool):  # numpy's numbers too
        return repr(int(v) if isinstance(v, numbers.Integral) else float(v))
    if v is None or isinstance(v, bool) or isinstance(v, (str, torch.dtype)):
        return repr(v)
    if isinstance(v, torch.Tensor):
        small = v.numel() <= 64 and v.device.type == "cpu"  # (a device tensor: no host sync)
        return repr(v.detach().tolist()) if small else f"tensor{tuple(v.shape)}"
    if isinstance(v, (tuple, list)):
        return "(" + ",".join(_as_data(x) for x in v) + ")"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k!r}:{_as_data(x)}" for k, x in sorted(v.items(), key=str)) + "}"
    return f"<{type(v).__qualname__}>"


def hparams_differ(total: int, total_sq: int, world: int, groups: Any = ()) -> Optional[str]:
    """The error when the ranks' :func:`hparams_fingerprint` s differ (as
    :func:`launches_differ` reads its sums), else ``None``; it lists this rank's ``groups``, so
    the ranks' messages side by side show which value differs."""
    if all_equal(total, total_sq, world):
        return None
    mine = "; ".join(", ".join(f"{k}={_as_data(v)}" for k, v in hparams(g).items())
                     for g in groups)
    return ("dmuon.Muon.step: the ranks' optimizers hold different hyper-parameters "
            "(optimizer.param_groups: lr, momentum, betas, weight_decay, momentum_dtype, ...), so "
            "each owner would update its matrices, and each rank its FSDP2 shards, by a rule of "
            "its own. Build dmuon.Muon with the same options on every rank, and change "
            "param_groups (a scheduler, a manual lr change) the same way on every rank. Nothing "
            "was updated; this batch's gradients were dropped. This rank's groups: "
            + (mine[:600] + (" ..." if len(mine) > 600 else "")))


def launches_differ(total: int, total_sq: int, world: int) -> Optional[str]:
    """The error when the ranks' launch fingerprints differ (``total``, ``total_sq``: their sum
    and the sum of their squares over ``world`` ranks; all are equal exactly when ``total ** 2 ==
    world * total_sq``: :func:`all_equal`), else ``None``."""
    if all_equal(total, total_sq, world):
        return None
    return (
        "dmuon.Muon.step: the ranks launched different sequences of dmuon's weight gathers / "
        "gradient reduces since the last step, so collectives of different hook groups were paired "
        "across ranks and this step's gradients are not the model's. A forward or backward differed "
        "across ranks: a block not called on some ranks (LayerDrop written as `continue` with a "
        "per-rank random draw), a block called twice on some ranks only, or a forward (an "
        "evaluation) on some ranks only. Every rank must call "
        "the same blocks in each forward; to drop a block on some ranks, call it and return its "
        "input there (exact), or draw the decision from a seed shared by every rank. Nothing was "
        "updated; this batch's gradients (dmuon's and FSDP2's) and gathered weights were dropped: "
        "run the forward and backward again.")


def check_step_ready(current: bool, fresh: bool, broken: Optional[str] = None) -> None:
    """Raise ``RuntimeError`` unless this optimizer is the newest on its model (``current``), no
    earlier step failed part-way (``broken``: that failure, every rank's, until a load) and a
    synced backward reached the dedicated matrices since the last step, the last backward
    (``fresh``)."""
    check_not_broken(broken, "dmuon.Muon.step")
    if not current:
        raise RuntimeError(
            "dmuon.Muon.step: a newer dmuon.Muon was built on this model, which supersedes "
            "this one (two optimizers would both update every matrix each step). Nothing was "
            "updated. Step only the newest optimizer (build one dmuon.Muon per model).")
    if not fresh:
        raise RuntimeError(
            "dmuon.Muon.step: no backward pass reached the dedicated matrices since the last "
            "step() (or zero_grad()), the last one raised before it ended (its gradients are "
            "partial: zero_grad() and run the batch again), or it ran inside dmuon.no_sync (its "
            "gradients were never reduced), so there is no fresh gradient to apply; nothing was "
            "updated. Run forward and loss.backward() (the last micro-batch outside "
            "dmuon.no_sync) before every step(). A step() on one rank only, or twice in a row, "
            "would update that rank's FSDP2 shards again and leave its dedicated matrices "
            "behind the other ranks'.")


def check_outside_grads(outside: Sequence[tuple[str, Any]]) -> None:
    """Raise if a param in none of the optimizer's groups (``requires_grad=False`` when
    ``dmuon.Muon`` was built, so neither dedicated nor AdamW's) has a gradient: it was unfrozen
    since, and no optimizer would apply its gradient. No collective: every rank computes the same
    verdict, since FSDP2 gives each rank a gradient of a param any rank used (a param unfrozen on
    some ranks only already breaks FSDP2's reduce-scatter)."""
    bad = [n for n, p in outside if p.grad is not None]
    if bad:
        raise RuntimeError(
            f"dmuon.Muon.step: params {bad[:6]}{' ...' if len(bad) > 6 else ''} were frozen "
            "(requires_grad=False) when dmuon.Muon(model) was built, so they are in none of its "
            "param groups (dmuon.dedicate_params skips frozen matrices too), yet they have a "
            "gradient now: they were unfrozen and would silently never be updated. Nothing was "
            "updated. To train them later, keep them trainable through dedicate_params and "
            "dmuon.Muon and freeze them afterwards with requires_grad_(False) (a param with no "
            "gradient is skipped, as torch skips it); to keep them frozen, set "
            "requires_grad_(False) again and drop their gradients (model.zero_grad()).")


def check_publish_consumed(pending: Sequence[str], what: str) -> None:
    """Raise ``RuntimeError`` if an HSDP publish of the last step is still pending for the hook
    groups ``pending`` (no forward / backward since it; the same on every rank)."""
    if pending:
        groups = [k or "<root>" for k in pending]
        raise RuntimeError(
            f"dmuon: {what} would publish new HSDP weights while the previous step's publish is "
            f"still pending for hook groups {groups[:6]}{' ...' if len(groups) > 6 else ''} (no "
            "forward/backward ran since that step). Nothing was updated. Run a forward and "
            "backward before the next step, or call dmuon.wait_all_replicate_broadcasts(model) "
            "first (or build the optimizer with dmuon.Muon(..., replicate_async=False)).")


def check_grads_on_all_ranks(names: Sequence[str], counts: Sequence[int], world: int) -> None:
    """Raise if an FSDP2 param of ``names`` has a gradient on some of the ``world`` ranks only
    (``counts``: on how many ranks each has one), for a torch whose FSDP2 has no
    ``set_reduce_scatter_unused_params``."""
    bad = [n for n, c in zip(names, counts) if 0 < c < world]
    if bad:
        raise RuntimeError(
            f"dmuon.Muon.step: FSDP2 params {bad[:6]}{' ...' if len(bad) > 6 else ''} have a "
            "gradient on some ranks only (e.g. parts of MoE experts that got no token on some "
            "ranks), so FSDP2's reduce-scatter mixed different params' gradients across ranks. "
            f"Nothing was updated. torch {torch.__version__}'s FSDP2 has no "
            "set_reduce_scatter_unused_params (torch 2.13's has it, and dmuon.Muon turns it "
            "on); upgrade torch, make every rank use every FSDP2 param each step, or move "
            "those params to dmuon (dedicate them), which handles it.")


def check_cleared(names: Sequence[str], ranks: int) -> None:
    """Raise ``RuntimeError`` if ``ranks`` (> 0) ranks hold a gradient of the last step that was
    never cleared (``names``: this rank's): torch keeps ``.grad`` until ``zero_grad`` and adds
    the next backward to it (or steps with it again), and dmuon keeps no stepped gradient."""
    if ranks > 0:
        mine = f"; on this rank: {list(names[:4])}{' ...' if len(names) > 4 else ''}" if names else ""
        raise RuntimeError(
            f"dmuon.Muon.step: the gradients of the last step were not cleared before this one "
            f"({ranks} rank(s){mine}). torch keeps .grad until zero_grad and would add this "
            "step's gradients to them (or step with them again); dmuon does not keep a stepped "
            "gradient, so it cannot. Nothing was updated. Call optimizer.zero_grad() (or "
            "model.zero_grad()) once per step, after step() or before the backward, then run "
            "the backward again.")


def unused_everywhere(names: Sequence[str], used: Sequence[int], none_before: Sequence[int],
                      world: int) -> list[str]:
    """The FSDP2 params of ``names`` that no rank used since their gradients were last cleared
    (``used``: on how many of the ``world`` ranks each got a gradient; ``none_before``: on how
    many its ``.grad`` was ``None`` when the first backward reached FSDP2): FSDP2's
    ``set_reduce_scatter_unused_params`` gave them a zero gradient where a single-device
    optimizer sees ``None`` and skips them."""
    return [n for n, u, z in zip(names, used, none_before) if u == 0 and z == world]


def pre_step_verdict(uncleared: Sequence[str], names: Sequence[str], counts: Sequence[int],
                     world: int, zeros_sent: bool) -> list[str]:
    """The verdicts from the pre-step all-reduce ``counts`` = ``[ranks holding an uncleared
    gradient] + [ranks where each of names had a gradient] + ([ranks where its .grad was None
    before], zeros_sent only)``: raise (:func:`check_cleared`; without ``zeros_sent``,
    :func:`check_grads_on_all_ranks`), else the FSDP2 params to give ``None`` back
    (:func:`unused_everywhere`)."""
    check_cleared(uncleared, counts[0])
    k = len(names)
    if not zeros_sent:
        check_grads_on_all_ranks(names, counts[1:1 + k], world)
        return []
    return unused_everywhere(names, counts[1:1 + k], counts[1 + k:], world)


def check_finite_flags(flags: torch.Tensor, named: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Raise ``FloatingPointError`` if a rank flagged a non-finite gradient (``flags[0, r]``: its
    backward computed one among the dedicated matrices' local gradients; ``flags[1, r]``: it
    holds one among the reduced gradients, FSDP2's shards or the owners' averages), naming the
    ranks and this rank's non-finite gradients among ``named``."""
    if bool(flags.any()):
        world = flags.shape[1]
        computed = [r for r in range(world) if flags[0, r] > 0]
        reduced = [r for r in range(world) if flags[1, r] > 0]
        local = [n for n, g in named if not torch.isfinite(g).all()]
        raise FloatingPointError(
            "dmuon.Muon.step: non-finite (NaN/Inf) gradients"
            + (f"; computed by the backward of ranks {computed} (dedicated matrices' local "
               "gradients)" if computed else "")
            + (f"; in the reduced gradients held by ranks {reduced} (FSDP2 shards or owners' "
               "averages)" if reduced else "")
            + (f" (here: {local[:8]})" if local else "")
            + ". Nothing was updated; call optimizer.zero_grad() to skip this batch, lower the "
            "learning rate or check the loss and inputs (or pass check_finite=False).")


def write_count(*trees: Any) -> int:
    """A number that grows with every in-place write to a tensor leaf of ``trees`` (the sum of
    their version counters): equal before and after a failed step when it changed nothing."""
    return sum([t._version for tree in trees for t in flatten(tree)[0]  # (a list: one call,
                if isinstance(t, torch.Tensor)])                       # not one per tensor)


def check_not_broken(broken: Optional[str], what: str) -> None:
    """Raise ``RuntimeError`` if an earlier step failed part-way (``broken``: its error, the same
    on every rank, until a load): ``what`` (a step, a checkpoint of the state) is refused."""
    if broken is not None:
        raise RuntimeError(f"{what}: refused, nothing was updated: {broken}")


def step_broken(counts: Sequence[int]) -> bool:
    """The agreed outcome of a step from ``counts``: ``[ranks whose step raised, ranks whose state
    changed in it]`` (a rank whose step completed counts as changed). True: some rank failed after
    some rank's state changed, so the step can be neither kept nor retried (every rank raises and
    marks its optimizer broken). False with failures: every rank failed before anything changed
    (each re-raises its own error; the step can be retried as it is)."""
    return counts[0] > 0 and counts[1] > 0


def broken_step_message(detail: str) -> str:
    """The error of a step that failed part-way (``detail``: the ranks and their errors): what
    failed and how to go on, raised by that step on every rank and by every later ``step()``."""
    return (f"a dmuon.Muon.step() failed part-way ({detail}) after some of the optimizer's state "
            "had changed (momentum, masters or AdamW moments on some rank), so that step can be "
            "neither kept nor retried: step() raises until the state is reloaded. Reload the "
            "model and the optimizer on every rank from your last checkpoint "
            "(dmuon.set_model_state_dict(model, sd) and Muon.load_state_dict / "
            "dmuon.set_optimizer_state_dict / torch's set_optimizer_state_dict, or "
            "dmuon.load_sharded), then run the iteration again.")
