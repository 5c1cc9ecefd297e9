"""The owner plan is identical on every rank: 4 gloo processes with different hash seeds and input orders.

Each worker is started with its own ``PYTHONHASHSEED`` (set in the parent before the spawn, so the
fresh interpreter uses it) and shuffles the specs with its rank as seed, plans several cases,
all-gathers the fingerprints as byte tensors and the owner slots as int64 tensors, and sends what it
saw back to the parent through a queue. (``tests/dist_utils.run_ranks`` is not used here because it
gives every rank the same environment, and the hash seed must differ per rank at interpreter start.)
"""
from __future__ import annotations

import pytest

import datetime
import os
import queue as _queue
import random
import traceback

import torch
import torch.multiprocessing as mp

WORLD = 4
TIMEOUT_S = 60
CASES = (("llama-3.2-1b", 8, 1), ("llama-3.1-8b", 4, 2), ("llama-3.1-70b", 64, 8), ("qwen2.5-7b", 2, 2))


def _worker(rank: int, rdzv: str, q) -> None:
    try:
        torch.set_num_threads(1)
        import torch.distributed as dist

        from dmuon.functional.plan import plan_owners
        from dmuon.tools.presets import preset_specs

        dist.init_process_group("gloo", init_method=rdzv, rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=TIMEOUT_S))
        out = {"hash": hash("dmuon-plan"), "seed_env": os.environ.get("PYTHONHASHSEED"), "cases": []}
        try:
            for model, g, r in CASES:
                specs = list(preset_specs(model))
                random.Random(1000 + rank).shuffle(specs)
                plan = plan_owners(specs, g, r)
                fp = torch.tensor(list(bytes.fromhex(plan.fingerprint)), dtype=torch.uint8)
                fps = [torch.empty_like(fp) for _ in range(WORLD)]
                dist.all_gather(fps, fp)
                slots = torch.tensor([plan.slot_of(plan.owners[n]) for n in sorted(plan.owners)],
                                     dtype=torch.int64)
                all_slots = [torch.empty_like(slots) for _ in range(WORLD)]
                dist.all_gather(all_slots, slots)
                out["cases"].append({
                    "fingerprint": plan.fingerprint,
                    "gathered": [bytes(t.tolist()).hex() for t in fps],
                    "slots_equal": all(torch.equal(s, slots) for s in all_slots),
                    "first_names": [s.name for s in specs[:3]],
                })
        finally:
            dist.destroy_process_group()
        q.put(("ok", rank, out))
    except BaseException:  # noqa: BLE001 - the parent must see every failure
        q.put(("error", rank, traceback.format_exc()))


@pytest.mark.slow  # the default tier's 600 s budget; the slow tier runs it
def test_plan_identical_across_4_gloo_ranks(tmp_path):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    rdzv = f"file://{tmp_path}/rdzv"
    old = os.environ.get("PYTHONHASHSEED")
    procs = []
    try:
        for rank in range(WORLD):
            os.environ["PYTHONHASHSEED"] = str(17 + 101 * rank)   # read by the fresh interpreter
            p = ctx.Process(target=_worker, args=(rank, rdzv, q), daemon=True)
            p.start()
            procs.append(p)
    finally:
        if old is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = old
    results, errors = {}, {}
    try:
        while len(results) + len(errors) < WORLD:
            try:
                kind, rank, payload = q.get(timeout=TIMEOUT_S + 30)
            except _queue.Empty:
                errors[-1] = "timed out waiting for workers"
                break
            (results if kind == "ok" else errors)[rank] = payload
            if errors:
                break
    finally:
        for p in procs:
            p.join(timeout=10 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    assert not errors, "\n".join(f"--- rank {k} ---\n{v}" for k, v in sorted(errors.items()))

    # the workers really ran under different hash seeds and saw different input orders
    assert [results[k]["seed_env"] for k in range(WORLD)] == [str(17 + 101 * k) for k in range(WORLD)]
    assert len({results[k]["hash"] for k in range(WORLD)}) == WORLD
    assert len({tuple(results[k]["cases"][0]["first_names"]) for k in range(WORLD)}) > 1

    from dmuon.functional.plan import plan_owners
    from dmuon.tools.presets import preset_specs
    for i, (model, g, r) in enumerate(CASES):
        local = plan_owners(preset_specs(model), g, r).fingerprint   # the parent's own plan
        for k in range(WORLD):
            case = results[k]["cases"][i]
            assert case["fingerprint"] == local, (model, g, r, k)
            assert case["gathered"] == [local] * WORLD
            assert case["slots_equal"]
