"""dmuon with ``torch.compile``-d layers equals the single-process reference (fp64, 2 gloo ranks).

Users compile the transformer blocks either in place (``layer.compile()``) or by wrapping
(``model.layers[i] = torch.compile(layer)``, an ``OptimizedModule`` whose param names gain
``_orig_mod``), before ``dedicate_params``, between it and ``fully_shard``, or after both; or the
whole model (``model.compile()``). In every
order dmuon's hooks must stay out of the compiled graphs (they run eagerly, as graph breaks, like
FSDP2's), the compiled forward must really run (counted by the backend), and training must match
:func:`stateful_harness.reference_run` within 1e-10 relative, with the usual bytes on the wire.

Backend ``aot_eager`` (dynamo + AOTAutograd, eager kernels): it exercises everything that interacts
with the hooks (graph capture, guards, the compiled autograd.Function) without a C++ compiler, so
the test stays fast on 2 cores. Inductor is the same capture with generated kernels.
"""
from __future__ import annotations

import time

import pytest

from dist_utils import run_ranks
from stateful_harness import HP, max_rel_err, reference_run

TOL = 1e-10
STEPS = 3
ORDERS = [
    # (id, how to compile, when: "before" dedicate, "between" dedicate and fully_shard, "after"
    #  both, Z3 (reshard_after_forward))
    ("inplace_before", "inplace", "before", True),
    ("inplace_between", "inplace", "between", True),
    ("inplace_after", "inplace", "after", True),
    ("wrap_before", "wrap", "before", True),
    ("wrap_between", "wrap", "between", True),
    ("wrap_after", "wrap", "after", True),
    ("inplace_before_z2", "inplace", "before", False),
    ("wrap_after_z2", "wrap", "after", False),
    ("model_after", "model", "after", True),   # the whole model: model.compile()
]
# what a captured graph would show if a dmuon hook had been traced into it
HOOK_MARKERS = ("broadcast", "reduce", "resize", "untyped_storage", "copy_", "set_", "wait")


def _compile_layers(model, how, backend):
    import torch

    if how == "model":
        model.compile(backend=backend)
        return
    for i, layer in enumerate(list(model.layers)):
        if how == "inplace":
            layer.compile(backend=backend)
        else:
            model.layers[i] = torch.compile(layer, backend=backend)


def _recording_backend(inner, graphs):
    """A dynamo backend that keeps each captured graph's code and compiles it with ``inner``."""
    from torch._dynamo.backends.registry import lookup_backend

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return lookup_backend(inner)(gm, example_inputs)

    return backend


def _run(rank, world, how, when, z3, backend):
    import torch
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dmuon.stateful.setup.dedicate import dedicate_params
    from dmuon.stateful.optimizer.muon import Muon
    from dmuon.stateful.checkpoint.state_dict import get_model_state_dict
    from models import make_batches, make_model, muon_predicate

    torch._dynamo.reset()
    graphs: list[str] = []
    counter = CompileCounterWithBackend(_recording_backend(backend, graphs))
    mesh = init_device_mesh("cpu", (world,))
    model = make_model(dtype=torch.float64)
    if when == "before":
        _compile_layers(model, how, counter)
    dedicate_params(model, mesh, muon_predicate, reshard_after_forward=z3)
    if when == "between":
        _compile_layers(model, how, counter)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=z3)
    fully_shard(model, mesh=mesh, reshard_after_forward=z3)
    if when == "after":
        _compile_layers(model, how, counter)
    opt = Muon(model, lr=HP["lr"], momentum=HP["momentum"], nesterov=HP["nesterov"],
               weight_decay=HP["weight_decay"], ns_steps=HP["ns_steps"], ns_dtype=torch.float64,
               adamw_lr=HP["adamw_lr"], adamw_betas=HP["adamw_betas"], adamw_eps=HP["adamw_eps"],
               adamw_weight_decay=HP["adamw_weight_decay"])
    for ids in make_batches(STEPS, 4):
        opt.zero_grad()
        model(ids.chunk(world)[rank]).backward()
        opt.step()
    sd = get_model_state_dict(model, cpu_offload=True)
    rt = opt.dedicated_state
    return {"sd": {k.replace("._orig_mod", ""): v for k, v in sd.items()},
            "frames": counter.frame_count, "ops": counter.op_count, "graphs": graphs,
            "counters": rt.executor.counters(),
            "groups": sorted(rt.groups)}


def _worker(rank, world, orders, backend="aot_eager"):
    out = {}
    for oid, how, when, z3 in orders:
        t = time.perf_counter()
        out[oid] = _run(rank, world, how, when, z3, backend)
        out[oid]["seconds"] = time.perf_counter() - t
    return out


def _dedicated_bytes() -> tuple[int, int]:
    """``(P, F)``: the dedicated matrices' bytes, and the bytes of the reduces' presence elements
    (one per matrix, in the reduce dtype: here the params' own)."""
    from models import make_model, muon_predicate

    mats = [p for n, p in make_model().named_parameters() if muon_predicate(n, p)]
    return sum(p.numel() * p.element_size() for p in mats), sum(p.element_size() for p in mats)


def _check(results, orders, world):
    ref = reference_run(dict(steps=STEPS))
    (P, F), G = _dedicated_bytes(), world
    for oid, _, _, z3 in orders:
        for rank in range(world):
            res = results[rank][oid]
            assert set(res["sd"]) == set(ref["sd"]), oid
            err, where = max_rel_err(res["sd"], ref["sd"])
            assert err <= TOL, f"{oid} rank {rank}: rel err {err:.3g} at {where}"
            # the blocks ran compiled: one graph (both layers share it), no recompile per step
            assert 1 <= res["frames"] <= 2 and res["ops"] > 0, (oid, res["frames"], res["ops"])
            for code in res["graphs"]:
                hit = [m for m in HOOK_MARKERS if m in code]
                assert not hit, f"{oid}: dmuon hook traced into a compiled graph ({hit}):\n{code}"
            assert res["groups"] == ["layers.0", "layers.1"], (oid, res["groups"])
        # the hooks ran eagerly every step: Z3 moves (N-1)/N (3P + F) per step, Z2 (N-1)/N (2P + F)
        sent = sum(results[r][oid]["counters"][lane]["sent_bytes"]
                   for r in range(world) for lane in ("unshard", "reduce")) / world / STEPS
        want = (G - 1) / G * ((3 if z3 else 2) * P + F)
        assert sent == pytest.approx(want, rel=1e-12), (oid, sent, P, F)


@pytest.mark.slow
def test_compiled_layers_equal_reference():
    results = run_ranks(_worker, 2, ORDERS, timeout=120)
    _check(results, ORDERS, 2)
