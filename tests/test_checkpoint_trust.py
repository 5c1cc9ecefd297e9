"""Loading a checkpoint never runs code, nor reads outside its folder (issue 39).

Before: a crafted sharded checkpoint ran code inside ``dmuon.load_sharded`` and the load then
succeeded (DCP's reader unpickles ``.metadata``, and its planner ``torch.load(weights_only=False)``-s
every non-tensor entry: ``extra``, counters, param groups; the CRC marker is integrity, not
authentication: whoever writes the files recomputes it). ``read_state_dict`` followed an index
naming ``../outside/...`` or an absolute path, recursed on an index naming itself, and inflated a
compressed record x1029 (512 MiB from a 0.5 MiB file).

Here every crafted file is refused with ``CheckpointError`` on every rank (the live model
unchanged), and the code in it never ran: the file its payload would create does not exist.
"""
from __future__ import annotations

import json
import os
import pickle
import zipfile

import pytest
import torch
from dist_utils import catch
from reliability_spawn import results


class RunsCode:
    """Unpickling this runs ``touch <path>`` (what any code execution could do)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch '{self.path}'",))


# ----------------------------------------------------------------------------- read_state_dict
def _index(folder, weight_map) -> str:
    path = os.path.join(folder, "model.safetensors.index.json")
    with open(path, "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return path


def _safetensors(path, **tensors) -> None:
    from safetensors.torch import save_file
    save_file(tensors, path)


def test_read_state_dict_stays_inside_its_folder(tmp_path):
    from dmuon.checkpoint.files import CheckpointError
    import dmuon
    outside, folder = tmp_path / "outside", tmp_path / "model"
    outside.mkdir()
    folder.mkdir()
    _safetensors(str(outside / "secret.safetensors"), w=torch.ones(2))
    _safetensors(str(folder / "model-1.safetensors"), v=torch.ones(2))
    for target in ("../outside/secret.safetensors", str(outside / "secret.safetensors"),
                   "sub/../../outside/secret.safetensors"):
        _index(str(folder), {"v": "model-1.safetensors", "w": target})
        with pytest.raises(CheckpointError, match="outside"):
            dmuon.read_state_dict(str(folder))
    # an index naming itself, or another index: refused, not a RecursionError
    for target in ("model.safetensors.index.json", "other.index.json"):
        _index(str(folder), {"v": target})
        with pytest.raises(CheckpointError, match="index"):
            dmuon.read_state_dict(str(folder))
    _index(str(folder), {"v": "model-1.safetensors"})  # a good one still reads
    assert torch.equal(dmuon.read_state_dict(str(folder))["v"], torch.ones(2))


def test_read_state_dict_loads_a_hugging_face_hub_cache_snapshot(tmp_path):
    """A hub cache snapshot (``<repo>/snapshots/<rev>/``) links each file to ``../../blobs/<hash>``.
    Before: the folder was refused ("outside the folder") and its index named directly raised
    FileNotFoundError (its shards were looked for beside the blob). Now both load, equal to the
    tensors saved; a link leading out of ``<repo>`` is still refused."""
    from dmuon.checkpoint.files import CheckpointError
    import dmuon
    want = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.float64)}
    repo = tmp_path / "hub" / "models--org--tiny"
    blobs, sharded, single = repo / "blobs", repo / "snapshots" / "rev1", repo / "snapshots" / "rev2"
    for d in (blobs, sharded, single):
        d.mkdir(parents=True)
    _safetensors(str(blobs / "h1"), a=want["a"])
    _safetensors(str(blobs / "h2"), b=want["b"])
    _safetensors(str(blobs / "h3"), **want)
    _index(str(blobs), {"a": "model-00001-of-00002.safetensors",
                        "b": "model-00002-of-00002.safetensors"})
    os.rename(blobs / "model.safetensors.index.json", blobs / "h4")
    for name, blob in (("model-00001-of-00002.safetensors", "h1"),
                       ("model-00002-of-00002.safetensors", "h2"),
                       ("model.safetensors.index.json", "h4")):
        os.symlink(f"../../blobs/{blob}", sharded / name)
    os.symlink("../../blobs/h3", single / "model.safetensors")
    for path in (sharded, sharded / "model.safetensors.index.json", single,
                 single / "model.safetensors"):
        got = dmuon.read_state_dict(str(path))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), path
    # a link out of <repo> (to another repo's blob, or anywhere else) is still refused
    other = tmp_path / "hub" / "models--org--other" / "blobs"
    other.mkdir(parents=True)
    _safetensors(str(other / "h9"), b=want["b"])
    os.remove(sharded / "model-00002-of-00002.safetensors")
    os.symlink("../../../models--org--other/blobs/h9", sharded / "model-00002-of-00002.safetensors")
    for path in (sharded, sharded / "model.safetensors.index.json"):
        with pytest.raises(CheckpointError, match="outside"):
            dmuon.read_state_dict(str(path))


def test_read_state_dict_reads_only_regular_files_of_its_folder_as_its_index_maps(tmp_path):
    """Issue 46. Before: ``model.safetensors`` or an index's shard that is a symbolic link to a
    file outside the folder was read (its values loaded); a FIFO named ``pytorch_model.bin``
    blocked ``read_state_dict`` forever; with an index mapping ``a`` to one file, another listed
    file's ``a`` silently won. Now each is refused before any read, naming the file; a link whose
    target stays inside the folder still reads."""
    import threading

    from dmuon.checkpoint.files import CheckpointError
    import dmuon
    outside, folder = tmp_path / "outside", tmp_path / "model"
    outside.mkdir()
    folder.mkdir()
    _safetensors(str(outside / "secret.safetensors"), w=torch.ones(2))
    os.symlink(outside / "secret.safetensors", folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.safetensors.*outside"):
        dmuon.read_state_dict(str(folder))
    os.remove(folder / "model.safetensors")
    _safetensors(str(folder / "model-1.safetensors"), v=torch.ones(2))
    os.symlink(outside / "secret.safetensors", folder / "model-2.safetensors")
    _index(str(folder), {"v": "model-1.safetensors", "w": "model-2.safetensors"})
    with pytest.raises(CheckpointError, match="model-2.safetensors.*outside"):
        dmuon.read_state_dict(str(folder))
    os.remove(folder / "model-2.safetensors")  # a link inside the folder is fine
    os.makedirs(folder / "parts")
    _safetensors(str(folder / "parts" / "w.safetensors"), w=torch.full((2,), 3.0))
    os.symlink("parts/w.safetensors", folder / "model-2.safetensors")
    got = dmuon.read_state_dict(str(folder))
    assert torch.equal(got["v"], torch.ones(2)) and torch.equal(got["w"], torch.full((2,), 3.0))
    # the index's per-key map is obeyed: a key found in a file the index does not name for it
    _safetensors(str(folder / "model-1.safetensors"), v=torch.ones(2), w=torch.zeros(2))
    with pytest.raises(CheckpointError, match="'w'.*model-1.safetensors.*model-2.safetensors"):
        dmuon.read_state_dict(str(folder))
    _safetensors(str(folder / "model-1.safetensors"), x=torch.ones(2))  # a named key missing
    with pytest.raises(CheckpointError, match="'v'.*model-1.safetensors"):
        dmuon.read_state_dict(str(folder))
    # a FIFO named pytorch_model.bin: refused at once, not a read blocked forever
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "pytorch_model.bin")
    box: list = []
    reader = threading.Thread(target=lambda: box.append(catch(
        lambda: dmuon.read_state_dict(str(fifo)))), daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # release the blocked reader (a writer end) before failing
        os.close(os.open(fifo / "pytorch_model.bin", os.O_RDWR))
        reader.join(10)
    assert box and box[0][0] == "CheckpointError" and "not a regular file" in box[0][1], box


def test_a_checkpoint_file_is_opened_only_inside_its_folder_and_sized_before_its_read(tmp_path,
                                                                                     monkeypatch):
    """Issue 46: the file checks of ``load_sharded`` (one rank's share): a file larger than the
    marker says is refused by its size before a byte is read (a 4 GiB file was read in full
    first, while the other ranks timed out); one linked outside the folder is refused."""
    from dmuon.checkpoint import files
    (tmp_path / "__0_0.distcp").write_bytes(b"x" * 100)
    with open(tmp_path / "__1_0.distcp", "wb") as f:
        f.truncate(1 << 30)  # sparse: 1 GiB that would be read in full
    read: list = []
    real = files._crc
    monkeypatch.setattr(files, "_crc", lambda f: read.append(f) or real(f))
    marker = {"save_id": "s", "files": {"__0_0.distcp": {"size": 100, "crc32": 0},
                                         "__1_0.distcp": {"size": 100, "crc32": 0}}}
    problems = files.file_problems(str(tmp_path), "__1_0.distcp", marker["files"]["__1_0.distcp"])
    assert problems and "1073741824 bytes" in problems[0] and read == [], (problems, read)
    (tmp_path / "__1_0.distcp").unlink()
    (tmp_path.parent / "elsewhere.distcp").write_bytes(b"x" * 100)
    os.symlink(tmp_path.parent / "elsewhere.distcp", tmp_path / "__1_0.distcp")
    problems = files.file_problems(str(tmp_path), "__1_0.distcp", marker["files"]["__1_0.distcp"])
    assert problems and "outside" in problems[0] and read == [], (problems, read)


def test_read_state_dict_refuses_compressed_records_and_code(tmp_path):
    from dmuon.checkpoint.files import CheckpointError
    import dmuon
    plain = tmp_path / "plain.pt"
    torch.save({"w": torch.zeros(1024, 1024)}, plain)  # 4 MiB of zeros
    bomb = tmp_path / "bomb.pt"
    with zipfile.ZipFile(plain) as zin, zipfile.ZipFile(bomb, "w") as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info.filename), compress_type=zipfile.ZIP_DEFLATED)
    assert os.path.getsize(bomb) < os.path.getsize(plain) / 50
    with pytest.raises(CheckpointError, match="compressed"):
        dmuon.read_state_dict(str(bomb))
    # a pickle that would run code: refused, and it did not run
    side = tmp_path / "ran"
    evil = tmp_path / "evil.bin"
    torch.save({"w": torch.ones(2), "x": RunsCode(str(side))}, evil)
    with pytest.raises(CheckpointError, match="weights_only"):
        dmuon.read_state_dict(str(evil))
    assert not side.exists()
    assert torch.equal(dmuon.read_state_dict(str(plain))["w"], torch.zeros(1024, 1024))


def test_dcp_items_compressed_or_transformed_are_refused(tmp_path):
    """Inside a sharded checkpoint: a deflated tensor record, and an item stored through a DCP
    storage transform (compression), are refused before anything inflates."""
    import io

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    from dmuon.checkpoint import trust
    from dmuon.checkpoint.files import CheckpointError
    raw = io.BytesIO()
    torch.save(torch.zeros(512, 512), raw)
    bomb = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(raw.getvalue())) as zin, zipfile.ZipFile(bomb, "w") as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info.filename), compress_type=zipfile.ZIP_DEFLATED)
    with pytest.raises(CheckpointError, match="compressed"):
        trust._tensor_item(io.BytesIO(bomb.getvalue()), "item")
    assert torch.equal(trust._tensor_item(io.BytesIO(raw.getvalue()), "item"), torch.zeros(512, 512))
    info = _StorageInfo("__0_0.distcp", 0, 10)
    info.transform_descriptors = ["zstd"]
    md = Metadata(state_dict_metadata={}, storage_data={MetadataIndex("w"): info})
    (tmp_path / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match="transform"):
        trust.read_metadata(str(tmp_path / ".metadata"), {"__0_0.distcp": 100})
    with pytest.raises(CheckpointError, match="outside"):  # beyond the file the marker measured
        trust.read_metadata(str(tmp_path / ".metadata"), {"__0_0.distcp": 5})


# ----------------------------------------------------------------------------- load_sharded
def _forge(model, opt, path: str, extra: dict) -> None:
    """What anyone with write access to the folder can do: a dmuon-shaped DCP checkpoint (plain
    ``dcp.save``) with a valid completion marker (CRCs recomputed)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from dmuon.checkpoint import files, sharded
    from dmuon.stateful.runtime.state import get_state
    sd = sharded._save_entries(model, get_state(model), opt)
    sd["extra"] = extra
    sd["dmuon"] = {"save_id": "forged000000"}
    dcp.save(sd, checkpoint_id=path)
    if dist.get_rank() == 0:
        files.write_marker(path, "forged000000")
    dist.barrier()


def _rewrite_metadata(path: str, edit) -> None:
    from dmuon.checkpoint import files
    with open(os.path.join(path, ".metadata"), "rb") as f:
        md = pickle.load(f)  # our own good file
    edit(md)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    files.write_marker(path, "forged000000")


def _trust_worker(rank: int, world: int, tmp: str) -> dict:
    import shutil

    import torch.distributed as dist

    import dmuon
    from models import make_batches, make_model
    from stateful_harness import build_dmuon
    model = make_model()
    model, opt = build_dmuon(rank, world, model, model.layers, {})
    for ids in make_batches(1, 4):
        opt.zero_grad()
        model(ids.chunk(world)[rank]).backward()
        opt.step()
    before = dmuon.get_model_state_dict(model, cpu_offload=True)
    side = {k: os.path.join(tmp, f"ran-{k}") for k in ("extra", "metadata")}
    _forge(model, opt, f"{tmp}/extra", {"step": RunsCode(side["extra"])})
    _forge(model, opt, f"{tmp}/metadata", {"step": 1})
    _forge(model, opt, f"{tmp}/escape", {"step": 1})
    if rank == 0:
        def planner_data(md):
            md.planner_data = RunsCode(side["metadata"])
        _rewrite_metadata(f"{tmp}/metadata", planner_data)

        def escape(md):  # one item read from a file beside the folder
            info = next(iter(md.storage_data.values()))
            shutil.copy(os.path.join(f"{tmp}/escape", info.relative_path), f"{tmp}/outside.distcp")
            for v in md.storage_data.values():
                if v.relative_path == info.relative_path:
                    v.relative_path = "../outside.distcp"
        _rewrite_metadata(f"{tmp}/escape", escape)
        shutil.copytree(f"{tmp}/escape", f"{tmp}/marker")
        with open(f"{tmp}/marker/dmuon-complete.json") as f:
            marker = json.load(f)
        marker["files"]["../outside.distcp"] = marker["files"].popitem()[1]
        with open(f"{tmp}/marker/dmuon-complete.json", "w") as f:
            json.dump(marker, f)
    dist.barrier()
    out = {tag: catch(lambda: dmuon.load_sharded(f"{tmp}/{tag}", model, opt))
           for tag in ("extra", "metadata", "escape", "marker")}
    # issue 46: a shard file linked to a copy outside the folder (its CRC still matches)
    _forge(model, opt, f"{tmp}/linked", {"step": 1})
    if rank == 0:
        name = sorted(f for f in os.listdir(f"{tmp}/linked") if f.endswith(".distcp"))[0]
        os.rename(f"{tmp}/linked/{name}", f"{tmp}/linked-{name}")
        os.symlink(f"{tmp}/linked-{name}", f"{tmp}/linked/{name}")
    dist.barrier()
    out["linked"] = catch(lambda: dmuon.load_sharded(f"{tmp}/linked", model, opt))
    out["ran"] = sorted(k for k, p in side.items() if os.path.exists(p))
    after = dmuon.get_model_state_dict(model, cpu_offload=True)
    out["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    # a save refuses extra values a load could not read without running code, before writing
    out["save_extra"] = catch(lambda: dmuon.save_sharded(f"{tmp}/saved", model, opt,
                                                         extra={"cfg": RunsCode(side["extra"])}))
    out["save_wrote"] = sorted(p for p in os.listdir(tmp) if p.startswith("saved"))
    return out


def test_crafted_sharded_checkpoints_are_refused_and_never_run_code(tmp_path_factory):
    for rank, r in enumerate(results(2, "trust", tmp_path_factory)):
        assert r["ran"] == [], (rank, r["ran"])
        assert r["unchanged"], rank
        for tag, needle in (("extra", "weights_only"), ("metadata", "not allowed"),
                            ("escape", "outside"), ("marker", "outside")):
            kind, msg = r[tag]
            assert kind == "CheckpointError" and needle in msg, (rank, tag, kind, msg)
        kind, msg = r["save_extra"]
        assert kind == "CheckpointError" and "extra['cfg']" in msg, (rank, kind, msg)
        assert r["save_wrote"] == [], (rank, r["save_wrote"])


def test_a_sharded_checkpoint_file_linked_outside_its_folder_is_refused(tmp_path_factory):
    """Issue 46. Before: a ``.distcp`` file that is a symbolic link to a copy outside the folder
    loaded (its CRC matches). Now every rank raises ``CheckpointError`` naming the file."""
    for rank, r in enumerate(results(2, "trust", tmp_path_factory)):
        kind, msg = r["linked"]
        assert kind == "CheckpointError" and "outside" in msg and ".distcp" in msg, (rank, r["linked"])
