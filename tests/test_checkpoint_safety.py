"""Sharded checkpoints never lie: atomic saves, validated and transactional loads.

Before: ``save_sharded`` over an existing directory, killed midway on one rank, left a directory
that ``load_sharded`` loaded without error (DCP writes ``.metadata`` last; the old one indexed a mix
of old and new shard files); a truncated shard raised on every rank only after all model entries
were overwritten, as DCP's ``CheckpointException`` (a ``BaseException``: ``except Exception``
resume-or-fresh code missed it); flipped bytes loaded a 2.4e24 weight; int64 tensors were cast
into float weights.
"""
from __future__ import annotations

import glob
import os

import pytest
import torch
from dist_utils import catch, run_ranks
from models import make_batches, make_model
from stateful_harness import build_dmuon

BATCH = 4


def _setup(rank, world, steps, seed=0):
    model = make_model(seed=seed)
    model, opt = build_dmuon(rank, world, model, model.layers, {})
    for ids in make_batches(steps, BATCH):
        opt.zero_grad()
        model(ids.chunk(world)[rank]).backward()
        opt.step()
    return model, opt


def _snapshot(model, opt):
    import dmuon
    return (dmuon.get_model_state_dict(model, cpu_offload=True),
            dmuon.get_optimizer_state_dict(model, opt, cpu_offload=True))


def _same(a, b):
    if isinstance(a, dict):
        return set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def _kill_during_save(rank, world, path, where):
    """A good checkpoint at ``path``, then a second save killed at ``where``."""
    import dmuon
    import dmuon.checkpoint.sharded as cs

    model, opt = _setup(rank, world, 1)
    dmuon.save_sharded(path, model, opt, extra={"step": 1})
    good = dmuon.get_model_state_dict(model, cpu_offload=True)
    if rank == 0:
        torch.save(good, path + "-expected.pt")
    ids = make_batches(2, BATCH)[1].chunk(world)[rank]
    opt.zero_grad()
    model(ids).backward()
    opt.step()
    if where == "writing" and rank == 1:  # rank 1 dies right after writing its shard files
        from torch.distributed.checkpoint import FileSystemWriter
        orig = FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            fut = orig(self, plan, planner)
            fut.wait()
            os._exit(3)
        FileSystemWriter.write_data = write_then_die
    new = dmuon.get_model_state_dict(model, cpu_offload=True)  # (collective)
    if where == "publish" and rank == 0:  # rank 0 dies between the publish's two renames
        torch.save(new, path + "-expected2.pt")

        def dying_publish(path, tmp, keep_last):  # noqa: ARG001
            os.rename(path, f"{path}.retired-{os.path.basename(tmp)}")
            os._exit(3)
        cs.publish = dying_publish
    dmuon.save_sharded(path, model, opt, extra={"step": 2})
    return "saved"


def _load_after(rank, world, path, expected="-expected.pt"):
    import dmuon
    model, opt = _setup(rank, world, 0, seed=5)
    out = {}
    try:
        res = dmuon.load_sharded(path, model, opt)
        out["loaded"] = res.extra.get("step")
        want = torch.load(path + expected)
        got = dmuon.get_model_state_dict(model, cpu_offload=True)
        out["values"] = all(torch.equal(got[k], want[k]) for k in want)
    except Exception as e:  # noqa: BLE001 - resume-or-fresh code catches Exception
        out["error"] = (type(e).__name__, str(e))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("where", ["writing", "publish"])
def test_killed_save_never_loads_a_torn_checkpoint(tmp_path, where):
    path = str(tmp_path / "ckpt")
    with pytest.raises(AssertionError) as died:  # a rank died: the run fails
        run_ranks(_kill_during_save, 2, path, where, timeout=60)
    if where == "writing":  # the survivor: a CheckpointError (what `except` catches for saves)
        survivor = str(died.value).split("--- rank 0 ---")[1]
        assert "CheckpointError: dmuon.save_sharded" in survivor, survivor[-2000:]
    if where == "publish":  # no checkpoint at path; the new one complete in its partial folder
        assert not os.path.exists(path) and any(n.startswith("ckpt.partial-")
                                                for n in os.listdir(tmp_path))
    res = run_ranks(_load_after, 2, path, "-expected.pt" if where == "writing" else
                    "-expected2.pt", timeout=60)
    for r in res:
        if where == "writing":  # the previous checkpoint is intact at path, values and all
            assert r.get("loaded") == 1 and r["values"], r
        else:  # the load finishes the publish: the complete new checkpoint, values and all
            assert r.get("loaded") == 2 and r["values"], r
    if where == "publish":
        assert os.path.isfile(os.path.join(path, "dmuon-complete.json"))
        assert not any(n.startswith("ckpt.partial-") for n in os.listdir(tmp_path))
        # keep_last=1: the next save removes the copy the cut publish left (the old checkpoint)
        assert any(n.startswith("ckpt.retired-") for n in os.listdir(tmp_path))
        run_ranks(_save_again, 2, path, timeout=60)
        assert sorted(n for n in os.listdir(tmp_path) if n.startswith("ckpt")) == [
            "ckpt", "ckpt-expected.pt", "ckpt-expected2.pt"], os.listdir(tmp_path)


def _save_again(rank, world, path):
    import dmuon
    model, opt = _setup(rank, world, 0, seed=5)
    dmuon.save_sharded(path, model, opt, extra={"step": 3})


def _save_after(rank, world, path):
    """A new job saves (keep_last=2) without loading first: the interrupted publish is finished
    before the rotation, so the new save is ``path`` and the finished one ``path.1``."""
    import dmuon
    model, opt = _setup(rank, world, 0, seed=5)
    dmuon.save_sharded(path, model, opt, extra={"step": 9}, keep_last=2)
    return [dmuon.load_sharded(p, model, opt).extra["step"] for p in (path, path + ".1")]


@pytest.mark.slow
def test_a_save_after_a_crash_between_the_publishs_renames_keeps_the_finished_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    with pytest.raises(AssertionError):
        run_ranks(_kill_during_save, 2, path, "publish", timeout=60)
    assert run_ranks(_save_after, 2, path, timeout=60) == [[9, 2]] * 2


def _corruptions(rank, world, tmp):
    """One good save, then damaged copies of it; each load raises on every rank and leaves the
    live model and optimizer bit-identical."""
    import shutil

    import torch.distributed as dist

    import dmuon
    from dmuon.stateful.runtime.state import get_state

    out = {}
    model, opt = _setup(rank, world, 2)
    good = f"{tmp}/good"
    dmuon.save_sharded(good, model, opt, extra={"step": 2})
    # keep_last: a second save keeps the first as good.1
    dmuon.save_sharded(good, model, opt, extra={"step": 3}, keep_last=2)
    out["rotated"] = os.path.isdir(good + ".1") and os.path.isdir(good)
    # an int-typed and a NaN-holding checkpoint, written through dmuon (valid markers)
    import dmuon.checkpoint.sharded as cs
    orig = cs._save_entries
    name = "layers.0.self_attn.q_proj.weight"
    rt = get_state(model)

    def int_typed(*a, **k):
        sd = orig(*a, **k)
        if name in sd["model"]:
            sd["model"][name] = sd["model"][name].to(torch.int64)
        return sd

    def with_nan(*a, **k):
        sd = orig(*a, **k)
        if name in sd["model"]:
            sd["model"][name] = sd["model"][name].clone().fill_(float("nan"))
        return sd
    for tag, fn in (("int", int_typed), ("nan", with_nan)):
        cs._save_entries = fn
        dmuon.save_sharded(f"{tmp}/{tag}", model, opt)
    cs._save_entries = orig
    dist.barrier()
    if rank == 0:
        for tag in ("truncated", "flipped", "no_marker"):
            shutil.copytree(good, f"{tmp}/{tag}")
        shard = sorted(glob.glob(f"{tmp}/truncated/*.distcp"))[0]
        with open(shard, "r+b") as f:
            f.truncate(os.path.getsize(shard) // 2)
        shard = sorted(glob.glob(f"{tmp}/flipped/*.distcp"))[-1]
        with open(shard, "r+b") as f:
            f.seek(os.path.getsize(shard) // 2)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))
        os.remove(f"{tmp}/no_marker/dmuon-complete.json")
    dist.barrier()
    before = _snapshot(model, opt)
    for tag in ("truncated", "flipped", "no_marker", "int", "nan", "missing"):
        out[tag] = catch(lambda: dmuon.load_sharded(f"{tmp}/{tag}", model, opt))
    # two complete checkpoints, one per rank (node-local folders, a per-rank "latest" lookup).
    # Before (a user-path review, session 16): loaded without an error, half of each
    out["mixed"] = catch(lambda: dmuon.load_sharded(good if rank == 0 else good + ".1",
                                                    model, opt))
    # a save given another path on each rank. Before: a checksum error that named no cause,
    # and rank 1's partial folder left on disk
    out["split"] = catch(lambda: dmuon.save_sharded(f"{tmp}/split{rank}", model, opt))
    dist.barrier()
    out["split_left"] = sorted(os.path.basename(p) for p in glob.glob(f"{tmp}/split*"))
    out["unchanged"] = _same(before, _snapshot(model, opt))
    # resume-or-fresh with `except Exception`
    try:
        dmuon.load_sharded(f"{tmp}/truncated", model, opt)
        out["fresh"] = False
    except Exception:  # noqa: BLE001
        out["fresh"] = True
    # the good one still loads, and equals what was saved
    res = dmuon.load_sharded(good, model, opt)
    out["good"] = res.extra["step"] == 3 and _same(before, _snapshot(model, opt))
    out["rt_ok"] = rt is get_state(model)
    return out


def test_corrupt_torn_and_wrong_checkpoints_raise_and_change_nothing(tmp_path):
    res = run_ranks(_corruptions, 2, str(tmp_path), timeout=120)
    for rank, r in enumerate(res):
        assert r["rotated"] and r["unchanged"] and r["fresh"] and r["good"], (rank, r)
        assert r["split_left"] == [], (rank, r["split_left"])
        for tag, needle in (("truncated", "truncated"), ("flipped", "corrupt"),
                            ("no_marker", "has no dmuon-complete.json"), ("int", "int64"),
                            ("nan", "non-finite"), ("missing", "does not exist"),
                            ("mixed", "different checkpoints"), ("split", "different paths")):
            kind, msg = r[tag]
            assert kind == "CheckpointError", (rank, tag, kind, msg)
            assert needle in msg, (rank, tag, msg)


# ------------------------------------------------------------------ issue 46: a dead peer's join
def _peer_dies(rank, world):
    """Rank 1 exits abruptly after setup; rank 0 then asks for a state dict (a store-based join
    first)."""
    import time

    import dmuon
    model, _ = _setup(rank, world, 1)
    if rank == 1:
        time.sleep(0.5)
        os._exit(3)
    time.sleep(2.0)  # rank 1 is gone by now
    t0 = time.monotonic()
    got = catch(lambda: dmuon.get_model_state_dict(model))
    return {"raised": got, "seconds": time.monotonic() - t0}


@pytest.mark.slow
def test_a_state_dict_call_with_a_dead_peer_raises_within_seconds_naming_it():
    """Issue 46. Before: with rank 1's process gone, ``get_model_state_dict`` on rank 0 waited
    the store-based join's full 30 s. Now the join sees rank 1's heartbeat stop and raises
    ``NotOnEveryRankError`` naming rank 1 within about 5 s."""
    from dmuon.launch import run_local_ranks
    results, errors = run_local_ranks(_peer_dies, 2, (), {}, backend="gloo", timeout_s=60,
                                      grace_s=45.0, deadline_s=120)
    assert 1 in errors and 0 in results, (results, errors)
    kind, msg = results[0]["raised"]
    assert kind == "NotOnEveryRankError" and "rank(s) [1]" in msg, results[0]
    assert results[0]["seconds"] < 8.0, results[0]


def test_the_join_tells_a_rank_whose_heartbeat_stopped_from_one_still_beating(monkeypatch):
    """Issue 46 (the join's dead-peer check, single process): on a real ``TCPStore``, a process
    beating (:func:`dmuon.compat.heartbeat.start_heartbeat`) is never gone; a rank whose
    counter stopped is gone once it did not move for ``DMUON_DEAD_PEER_S``; a rank that never
    beat is never called gone."""
    import time

    import torch.distributed as dist

    from dmuon.compat import heartbeat
    monkeypatch.setenv(heartbeat.DEAD_ENV, "2.5")
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    heartbeat.start_heartbeat(0, store)
    store.add("dmuon/alive/1", 1)  # rank 1 beat once, then stopped
    watch = heartbeat.PeerWatch(store)
    first = watch.gone(lambda: [0, 1, 2])
    deadline, gone = time.monotonic() + 6.0, []
    while time.monotonic() < deadline and not gone:
        time.sleep(0.2)
        gone = watch.gone(lambda: [0, 1, 2])
    assert first == [] and gone == [1], (first, gone)


def test_the_heartbeat_ends_with_its_process_group(tmp_path):
    """The heartbeat of the default group's store stops when that group is destroyed: a process
    that rebuilds its model with a new group keeps no thread beating on a store that is gone (on
    the GPU, the old thread's ``store.add`` on the destroyed group's store aborted the process at
    exit: ``benchmarks/rebuild_loop.py`` ended with SIGABRT)."""
    import subprocess
    import sys
    code = (
        "import threading, time, torch.distributed as dist\n"
        "from dmuon.compat.heartbeat import start_heartbeat\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path}/rdzv', rank=0, "
        "world_size=1)\n"
        "start_heartbeat(0)\n"
        "beating = lambda: [t for t in threading.enumerate() if t.name == 'dmuon-heartbeat']\n"
        "assert beating()\n"
        "dist.destroy_process_group()\n"
        "deadline = time.monotonic() + 5\n"
        "while beating() and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
        "assert not beating(), 'the heartbeat outlived its process group'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_heartbeat_beats_while_the_main_thread_waits_on_the_store():
    """The heartbeat has a store connection of its own: while this thread is blocked in a store
    ``wait`` (a barrier, a rendezvous), the counter keeps moving, so the join never calls a live
    rank gone (on the shared connection the beat waited behind the wait: 3.7 s of a 4 s one)."""
    import datetime
    import threading
    import time

    import torch.distributed as dist

    from dmuon.compat import heartbeat
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    heartbeat.start_heartbeat(7, store)
    reader = store.clone()
    time.sleep(0.2)
    counts = []

    def sample():
        for _ in range(6):
            counts.append(int(reader.add("dmuon/alive/7", 0)))
            time.sleep(0.5)
    t = threading.Thread(target=sample)
    t.start()
    try:
        store.wait(["never-set"], datetime.timedelta(seconds=3))
    except Exception:  # noqa: BLE001 - the wait times out, as intended
        pass
    t.join()
    assert counts[-1] - counts[0] >= 2, counts
