"""Make HF Accelerate and ``transformers.Trainer`` handle dmuon models correctly, with no user code.

A dmuon model (``dedicate_params`` + ``fully_shard``) already owns its data parallelism. What
Accelerate / Trainer would do to it, and what dmuon changes, **only for dmuon models** (a model
with a runtime, :func:`dmuon.stateful.runtime.state.find_state`; everything else takes the original
code path untouched):

* ``Accelerator.prepare_model`` wraps multi-process models in ``DistributedDataParallel``
  (``MULTI_CPU`` / ``MULTI_GPU``), which fails on FSDP2's DTensor params ("Cannot flatten
  unevenly sharded tensor", "mixed torch.Tensor and DTensor", or "incompatible with DDP",
  depending on the version). dmuon prepares such a model as Accelerate prepares an already
  distributed one: ``device_placement=False, evaluation_mode=True`` (autocast and ``torch.compile``
  still apply; no DDP/FSDP wrapping). It also gives the model a ``no_sync`` context (Accelerate's
  ``no_sync`` / ``accumulate`` use ``model.no_sync`` when present), so Trainer's gradient
  accumulation runs :func:`dmuon.no_sync` (no collectives on the non-final micro-batches).
  Accelerate's own FSDP or DeepSpeed on a dmuon model, or fp16 loss scaling (its ``GradScaler``
  never sees the dedicated gradients), raise ``ValueError`` saying what to change.
  A model dedicated with ``data_parallel="ddp"`` is the exception: Accelerate wraps it in DDP as
  usual (DDP skips the dedicated matrices; DDP's ``no_sync`` is followed by dmuon).
* ``Accelerator.clip_grad_norm_(model.parameters(), max_norm)`` (Trainer's clipping, default
  ``max_grad_norm=1.0``) would compute ``torch.nn.utils.clip_grad_norm_`` over ``.grad`` only, which
  misses the dedicated matrices (their reduced gradients live on the owners, in the runtime): the
  norm would be silently wrong. For a dmuon model it is :func:`dmuon.clip_grad_norm_` (global norm
  over FSDP2 shards and owners' reduced gradients, then all of them scaled).
* ``Accelerator.get_state_dict(model)`` returns :func:`dmuon.get_model_state_dict` (full tensors,
  single-device names; collective, as the Accelerate docs require for sharded models).
* ``Accelerator.save_state`` writes a ``dmuon.Muon``'s full, topology-free optimizer dict (rank 0
  alone writes what every rank's ``state_dict()`` returns), and ``Accelerator.load_state`` lets
  safetensors search the model's full dict for shared tensors (its DTensor entries have no
  storage to search): both resume exactly, as Trainer's checkpoints do.
* ``Trainer.save_model`` (called on every rank, also by Trainer's checkpointing) first gathers
  :func:`dmuon.get_model_state_dict` on every rank (drains HSDP publishes), then runs the original
  method with ``model.state_dict()`` answering that full dict, so rank 0's ``save_pretrained``
  writes a normal, loadable HF checkpoint.

All of these are public methods, wrapped at class level, idempotently (a marker attribute), and
only when the target exists with the expected parameters; a target that changed is reported by
:func:`status` and logged, and the dmuon path raises ``RuntimeError`` naming the version instead of
doing something silently wrong.

* ``Trainer._save_optimizer_and_scheduler`` (private; wrapped where it exists) asks rank 0 alone
  for ``optimizer.state_dict()``, which is collective on a dmuon model: every rank gathers
  :func:`dmuon.get_optimizer_state_dict` (full, topology-free) and rank 0 saves that as
  ``optimizer.pt``; Trainer's resume calls ``optimizer.load_state_dict(torch.load(...))`` on every
  rank, which ``dmuon.Muon`` accepts in this format at any topology. With Trainer's scheduler,
  per-rank RNG and trainer state beside it, ``trainer.train(resume_from_checkpoint=...)`` resumes
  exactly, on the same or another number of ranks.
* ``Trainer.train`` first checks that Trainer's processes are the process group's ranks: on a
  machine without CUDA, transformers runs a ``torchrun`` launch as ``NOT_PARALLEL`` unless
  ``TrainingArguments(use_cpu=True)`` (every rank would get the same batches and write the same
  checkpoint files), so that raises ``ValueError`` naming the fix, on every rank, before training;
  ``Accelerator.prepare_model`` checks the same. It also adds
  :class:`dmuon.integrations.hf_telemetry.DmuonTelemetryCallback` once, and the wrapped
  ``Trainer.log`` adds its ``dmuon_*`` entries (NS ms, bytes, imbalance) to the training logs.
* ``Trainer.create_optimizer`` raises ``ValueError`` on every rank, before any step, when a dmuon
  model's optimizer is not ``dmuon.Muon`` (Trainer's own ``optim``, or a torch optimizer passed in
  ``optimizers=``), naming ``optimizers=(dmuon.Muon(model, ...), None)``; before, the optimizer's
  first step raised about a dedicated param's placeholder.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from types import ModuleType
from typing import Any, Iterator, Optional

import torch.nn as nn

from dmuon.stateful.runtime.state import find_state, get_state

logger = logging.getLogger(__name__)

_MARK = "_dmuon_wrapped"
_status: dict[str, str] = {}


def dmuon_root(model: Any) -> Optional[nn.Module]:
    """The dmuon-prepared module inside ``model`` (through ``torch.compile`` / DDP-style wrappers)."""
    seen = 0
    while isinstance(model, nn.Module) and seen < 8:
        if find_state(model) is not None:
            return model
        model = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        seen += 1
    return None


def status() -> dict[str, str]:
    """``{"Accelerator.prepare_model": "installed" | "<why not>", ...}`` for every target seen."""
    return dict(_status)


def _wrap(cls: type, name: str, make, required_params: tuple[str, ...]) -> None:
    key = f"{cls.__name__}.{name}"
    fn = cls.__dict__.get(name)
    if fn is None:
        _status[key] = f"missing ({cls.__module__} has no {key})"
        logger.warning("dmuon: %s not found; dmuon models are not supported on this path", key)
        return
    if getattr(fn, _MARK, False):
        _status[key] = "installed"
        return
    params = inspect.signature(fn).parameters
    lacking = [p for p in required_params if p not in params]
    if lacking:
        _status[key] = f"unsupported signature (no {lacking})"
        logger.warning("dmuon: %s has no parameter(s) %s; dmuon models raise on this path", key,
                       lacking)
        wrapper = _unsupported(fn, key, lacking)
    else:
        wrapper = make(fn)
        _status[key] = "installed"
    functools.update_wrapper(wrapper, fn)
    setattr(wrapper, _MARK, True)
    setattr(cls, name, wrapper)


def _unsupported(fn, key: str, lacking: list[str]):
    def wrapper(self, *args, **kwargs):
        if any(dmuon_root(a) is not None for a in list(args) + list(kwargs.values())) or \
                dmuon_root(getattr(self, "model", None)) is not None:
            raise RuntimeError(
                f"dmuon: {key} in this version has no parameter(s) {lacking}, which dmuon's "
                "Accelerate/Trainer integration needs (tested: accelerate 1.15, transformers 5.24). "
                "Upgrade, or drive the model with a custom loop (examples/custom_loop.py).")
        return fn(self, *args, **kwargs)
    return wrapper


# ---------------------------------------------------------------------------------- accelerate
def _distributed_type_name(acc: Any) -> str:
    dt = getattr(acc, "distributed_type", None)
    return str(getattr(dt, "value", dt))


def _check_accelerator(acc: Any) -> None:
    dt = _distributed_type_name(acc).upper()
    if dt in ("FSDP", "DEEPSPEED", "MEGATRON_LM"):
        raise ValueError(
            f"dmuon: this Accelerator is configured for {dt}, but the model was prepared by "
            "dmuon.dedicate_params + fully_shard, which already shard it. Turn the framework's own "
            "sharding off (HF Trainer: TrainingArguments(fsdp=\"\"), no deepspeed=...; accelerate: "
            "no FSDP/DeepSpeed plugin) and keep dmuon + fully_shard.")
    if getattr(acc, "scaler", None) is not None:
        raise ValueError(
            "dmuon: fp16 loss scaling (GradScaler) is not supported for dmuon models: the scaler "
            "never sees the dedicated matrices' gradients (they live on their owners), so it would "
            "neither unscale them nor detect their overflows. Use bf16 (TrainingArguments(bf16=True)"
            " or mixed_precision='bf16') or fp32.")


def _check_data_parallel(acc: Any) -> None:
    """Raise unless the Accelerator's processes are the default process group's ranks."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return
    world = dist.get_world_size()
    procs = int(getattr(acc, "num_processes", 1) or 1)
    if world > 1 and procs != world:
        raise ValueError(
            f"dmuon: torch.distributed has {world} ranks, but this Trainer / Accelerator runs as "
            f"{procs} process(es) (distributed_type={_distributed_type_name(acc)}): every rank "
            "would train on the same batches, run the whole schedule alone and write the same "
            "checkpoint files. On a machine without CUDA, transformers does this to a torchrun "
            "launch unless told to use the CPU: pass TrainingArguments(use_cpu=True) (plain "
            "accelerate: Accelerator(cpu=True)).")


def _make_prepare_model(orig):
    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        root = dmuon_root(model)
        if root is None or evaluation_mode:
            return orig(self, model, device_placement=device_placement,
                        evaluation_mode=evaluation_mode)
        _check_accelerator(self)
        _check_data_parallel(self)
        if getattr(find_state(root), "data_parallel", "fsdp") == "ddp":
            # DDP mode: Accelerate's own DDP wrapping (it skips the dedicated matrices, and its
            # no_sync is followed by dmuon); skipping it would leave the other params unsynced
            return orig(self, model, device_placement=device_placement,
                        evaluation_mode=evaluation_mode)
        # already distributed by dmuon + FSDP2: no DDP / FSDP wrapping, no device move
        out = orig(self, model, device_placement=False, evaluation_mode=True)
        if getattr(root, "no_sync", None) is None:
            from dmuon.stateful.runtime.no_sync import no_sync
            root.no_sync = functools.partial(no_sync, root)  # used by Accelerator.no_sync
        return out
    return prepare_model


def _dmuon_model_for(acc: Any, parameters: list) -> Optional[nn.Module]:
    """The dmuon model whose dedicated params are in ``parameters`` (all of its params, or raise)."""
    from dmuon.compat.fsdp_patch import is_dedicated
    if not any(is_dedicated(p) for p in parameters):
        return None
    given = {id(p) for p in parameters}
    for m in list(getattr(acc, "_models", [])):
        root = dmuon_root(m)
        if root is None:
            continue
        ded = {id(p) for p in get_state(root).params.values()}
        if ded & given:
            if {id(p) for p in root.parameters()} != given:
                raise ValueError(
                    "dmuon: Accelerator.clip_grad_norm_ got a subset of a dmuon model's parameters "
                    "that includes dedicated matrices; clip all of model.parameters() (their norm is "
                    "global), or call dmuon.clip_grad_norm_(model, max_norm) yourself.")
            return root
    raise RuntimeError(
        "dmuon: Accelerator.clip_grad_norm_ got dedicated parameters of a model that this "
        "Accelerator did not prepare; call dmuon.clip_grad_norm_(model, max_norm) instead.")


def _make_clip_grad_norm(orig):
    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        parameters = list(parameters)
        root = _dmuon_model_for(self, parameters)
        if root is None:
            return orig(self, parameters, max_norm, norm_type=norm_type)
        from dmuon.stateful.extras.grad_clip import clip_grad_norm_ as dmuon_clip
        return dmuon_clip(root, float(max_norm), float(norm_type))
    return clip_grad_norm_


def _make_get_state_dict(orig):
    def get_state_dict(self, model, unwrap=True):
        root = dmuon_root(model)
        if root is None:
            return orig(self, model, unwrap=unwrap)
        from dmuon.stateful.checkpoint.state_dict import get_model_state_dict
        return get_model_state_dict(root, cpu_offload=True)
    return get_state_dict


def _make_save_state(orig):
    def save_state(self, output_dir=None, safe_serialization=True, **kwargs):
        # every rank calls each optimizer's state_dict() and rank 0 alone writes it: a dmuon.Muon
        # answers with dmuon's full, topology-free dict (gathered here, collective), as Trainer's
        # save does, which load_state's load_state_dict then reads on every rank
        muons = [(o, _unwrapped(o)) for o in getattr(self, "_optimizers", ())]
        muons = [(o, m) for o, m in muons if getattr(m, "dedicated_state", None) is not None]
        if not muons:
            return orig(self, output_dir, safe_serialization, **kwargs)
        with contextlib.ExitStack() as stack:
            for o, m in muons:
                stack.enter_context(_answering_optimizer_state_dict(o, _full_optimizer_dict(m)))
            return orig(self, output_dir, safe_serialization, **kwargs)
    return save_state


def _make_load_state(orig):
    def load_state(self, input_dir=None, load_kwargs=None, **kwargs):
        # safetensors' load_model looks for shared storages in model.state_dict(), whose dmuon
        # entries are DTensor copies without one: it reads dmuon's full dict instead (collective:
        # every rank loads the same files; gathered at that call only, on the host)
        roots = [m for m in getattr(self, "_models", ()) if dmuon_root(m) is m]
        if not roots:
            return orig(self, input_dir, load_kwargs, **kwargs)
        from dmuon.stateful.checkpoint.state_dict import get_model_state_dict
        with contextlib.ExitStack() as stack:
            for m in roots:
                stack.enter_context(_answering_state_dict(
                    m, functools.partial(get_model_state_dict, m, cpu_offload=True)))
            return orig(self, input_dir, load_kwargs, **kwargs)
    return load_state


def patch_accelerate(module: ModuleType) -> None:
    """Wrap ``Accelerator.prepare_model`` / ``clip_grad_norm_`` / ``get_state_dict`` /
    ``save_state`` / ``load_state`` (idempotent)."""
    cls = getattr(module, "Accelerator", None)
    if cls is None:
        _status["Accelerator"] = f"missing ({module.__name__} has no Accelerator)"
        return
    _wrap(cls, "prepare_model", _make_prepare_model, ("device_placement", "evaluation_mode"))
    _wrap(cls, "clip_grad_norm_", _make_clip_grad_norm, ("parameters", "max_norm", "norm_type"))
    _wrap(cls, "get_state_dict", _make_get_state_dict, ("model", "unwrap"))
    _wrap(cls, "save_state", _make_save_state, ("output_dir", "safe_serialization"))
    _wrap(cls, "load_state", _make_load_state, ("input_dir", "load_kwargs"))


# ---------------------------------------------------------------------------------- Trainer
@contextlib.contextmanager
def _answering_state_dict(model: nn.Module, sd: Any) -> Iterator[None]:
    """While inside, ``model.state_dict()`` returns ``sd`` (an instance attribute, then removed;
    a callable: called at the first ``state_dict()``, its dict kept)."""
    had = "state_dict" in model.__dict__
    prev = model.__dict__.get("state_dict")
    made = [sd] if not callable(sd) else []

    def answer(*args: Any, **kwargs: Any) -> dict:
        if not made:  # (dmuon's own pass reads the model's real state_dict meanwhile)
            del model.__dict__["state_dict"]
            try:
                made.append(sd())
            finally:
                model.__dict__["state_dict"] = answer
        return made[0]
    model.__dict__["state_dict"] = answer
    try:
        yield
    finally:
        if had:
            model.__dict__["state_dict"] = prev
        else:
            model.__dict__.pop("state_dict", None)


def _make_save_model(orig):
    def save_model(self, output_dir=None, _internal_call=False, *args, **kwargs):
        root = dmuon_root(getattr(self, "model", None))
        if root is None:
            return orig(self, output_dir, _internal_call, *args, **kwargs)
        if getattr(self, "is_fsdp_enabled", False) or getattr(self, "is_deepspeed_enabled", False):
            _check_accelerator(self.accelerator)
        from dmuon.stateful.checkpoint.state_dict import get_model_state_dict
        sd = get_model_state_dict(root, cpu_offload=True)  # collective: every rank is here
        with _answering_state_dict(root, sd):
            return orig(self, output_dir, _internal_call, *args, **kwargs)
    return save_model


def _full_optimizer_dict(muon: Any, root: Optional[nn.Module] = None) -> dict:
    """``muon``'s full, topology-free state dict on rank 0 (collective; what a save that rank 0
    alone writes must hold: every rank's ``state_dict()`` gives only its own pieces); ``root``:
    its model (default: the one it was built for)."""
    from dmuon.stateful.checkpoint.optimizer_state_dict import get_optimizer_state_dict
    root = muon.dedicated_state.model_ref() if root is None else root
    return get_optimizer_state_dict(root, muon, cpu_offload=True, rank0_only=True)


@contextlib.contextmanager
def _answering_optimizer_state_dict(optimizer: Any, sd: dict) -> Iterator[None]:
    """While inside, ``optimizer.state_dict()`` returns ``sd`` (an instance attribute)."""
    optimizer.__dict__["state_dict"] = lambda *a, **k: sd
    try:
        yield
    finally:
        optimizer.__dict__.pop("state_dict", None)


def _make_save_optimizer(orig):
    def _save_optimizer_and_scheduler(self, output_dir):
        root = dmuon_root(getattr(self, "model", None))
        if root is None or getattr(self, "optimizer", None) is None:
            return orig(self, output_dir)
        # Trainer asks rank 0 alone for optimizer.state_dict(), which is collective on a dmuon
        # model: every rank gathers dmuon's full, topology-free dict here, rank 0 saves it, and
        # Muon.load_state_dict (which Trainer's resume calls on every rank) reads it back
        with _answering_optimizer_state_dict(self.optimizer, _full_optimizer_dict(
                _unwrapped(self.optimizer), root)):
            return orig(self, output_dir)
    return _save_optimizer_and_scheduler


def _make_has_mixed_mesh_grads(orig):
    def _has_mixed_mesh_grads(self, model):
        # a dmuon model's dedicated params show zero-size `.grad` markers (plain tensors) beside
        # FSDP2's DTensor grads; its norm is Accelerator.clip_grad_norm_'s (dmuon's), never the
        # per-mesh norm of the markers
        if dmuon_root(model) is not None:
            return False
        return orig(self, model)
    return _has_mixed_mesh_grads


def _telemetry_callback(trainer: Any) -> Any:
    handler = getattr(trainer, "callback_handler", None)
    for cb in getattr(handler, "callbacks", []):
        if type(cb).__name__ == "DmuonTelemetryCallback":
            return cb
    return None


def _log_routing(trainer: Any, root: nn.Module) -> None:
    """Log the routing table (every param → Muon / AdamW / frozen and why) once per Trainer, on
    the main process; kept as ``trainer._dmuon_routing_log``."""
    if getattr(trainer, "_dmuon_routing_log", None):
        return
    table = getattr(find_state(root), "routing", None)
    if table is None:
        return
    trainer._dmuon_routing_log = [str(table)]
    is_main = getattr(trainer, "is_world_process_zero", lambda: True)
    if is_main():
        logger.info("%s", table)


def _make_train(orig):
    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        root = dmuon_root(getattr(self, "model", None))
        if root is not None:
            _check_data_parallel(self.accelerator)
            if _telemetry_callback(self) is None:
                from dmuon.integrations.hf_telemetry import DmuonTelemetryCallback
                self.add_callback(DmuonTelemetryCallback())
            _log_routing(self, root)
        return orig(self, resume_from_checkpoint, *args, **kwargs)
    return train


def _unwrapped(optimizer: Any) -> Any:
    """The optimizer inside accelerate's ``AcceleratedOptimizer`` (else itself)."""
    return getattr(optimizer, "optimizer", optimizer)


def _make_create_optimizer(orig):
    def create_optimizer(self, *args, **kwargs):
        opt = orig(self, *args, **kwargs)
        if dmuon_root(getattr(self, "model", None)) is not None:
            _check_optimizer(opt)
        return opt
    return create_optimizer


def _check_optimizer(opt: Any) -> None:
    """Raise unless a dmuon model's Trainer steps it with ``dmuon.Muon`` (Trainer's own ``optim``,
    or a torch optimizer passed in, would fail at its first step on the dedicated matrices)."""
    from dmuon.stateful.optimizer.muon import Muon
    inner = _unwrapped(opt)
    if not isinstance(inner, Muon):
        raise ValueError(
            f"dmuon: this Trainer's optimizer is a {type(inner).__name__}, which cannot update a "
            "dmuon model's dedicated matrices (their values and gradients live on their owner "
            "ranks: it would fail at its first step). Build dmuon.Muon(model, ...) after "
            "fully_shard and pass Trainer(..., optimizers=(optimizer, None)) (or a scheduler in "
            "place of None); TrainingArguments' optim, learning_rate and weight_decay then do not "
            "apply: set them on dmuon.Muon.")


def _make_log(orig):
    def log(self, logs, *args, **kwargs):
        cb = _telemetry_callback(self)
        if cb is not None and isinstance(logs, dict) and "loss" in logs:
            logs.update(cb.take(int(self.state.global_step)))
        return orig(self, logs, *args, **kwargs)
    return log


def patch_trainer(module: ModuleType) -> None:
    """Wrap ``Trainer.save_model`` and, where this transformers has it, the private
    ``Trainer._has_mixed_mesh_grads`` (transformers >= 5.2x picks a per-mesh norm for mixed
    DTensor / plain gradients instead of ``Accelerator.clip_grad_norm_``) (idempotent)."""
    cls = getattr(module, "Trainer", None)
    if cls is None:
        _status["Trainer"] = f"missing ({module.__name__} has no Trainer)"
        return
    _wrap(cls, "save_model", _make_save_model, ("output_dir",))
    _wrap(cls, "train", _make_train, ("resume_from_checkpoint",))
    _wrap(cls, "log", _make_log, ("logs",))
    _wrap(cls, "create_optimizer", _make_create_optimizer, ())
    _wrap(cls, "_save_optimizer_and_scheduler", _make_save_optimizer, ("output_dir",))
    if "_has_mixed_mesh_grads" in cls.__dict__:
        _wrap(cls, "_has_mixed_mesh_grads", _make_has_mixed_mesh_grads, ("model",))
