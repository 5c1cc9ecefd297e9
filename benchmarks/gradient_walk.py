"""The walk of one step's gradients through dmuon's code, traced: on rank 0 of a 2 x 2 HSDP gloo
run (fp64 tiny model of ``tests/models.py``), every dmuon function that runs from
``loss.backward()`` (the post-accumulate-grad hooks, the reduces, the end-of-backward callback)
to the end of ``optimizer.step()`` (the owners' update and the HSDP publish launched) is recorded
with ``sys.setprofile``.

Reports (JSON, ``--out``): the dmuon files that run (``files``), per layer, and the calls from a
lower layer into a higher one (``calls_up``: caller file -> callee file, with counts). Layers,
lowest first: the pure core (``functional``, ``newton_schulz``, ``kernels``, ``compat``), then
the stateful wings in their dependency order (``runtime``, ``modes``, ``checkpoint``,
``optimizer``, ``extras``, ``setup``; an older tree's folders are read the same way), then the
rest (``integrations``, the package's top). A call up is a function of a lower layer calling one
of a higher layer: a callback the higher layer handed down (a hook, a listener, a runner).

    PYTHONPATH=$PWD:$PWD/tests python benchmarks/gradient_walk.py --out walk.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter

CORE = ("functional", "newton_schulz", "kernels", "compat")
WINGS = ("runtime", "modes", "checkpoint", "optimizer", "extras", "setup")


def layer_of(path: str) -> tuple[int, str] | None:
    """``(rank, name)`` of the dmuon file ``path`` (``None``: not dmuon's)."""
    parts = path.replace(os.sep, "/").split("/")
    if "dmuon" not in parts:
        return None
    rest = parts[len(parts) - 1 - parts[::-1].index("dmuon") + 1:]
    if not rest:
        return None
    if rest[0] in CORE:
        return 0, rest[0]
    if rest[0] == "stateful" and len(rest) > 2 and rest[1] in WINGS:
        return 1 + WINGS.index(rest[1]), rest[1]
    if rest[0] == "stateful" and len(rest) > 2 and rest[1] == "runtime":
        return 1, "runtime"
    return 1 + len(WINGS), rest[0].removesuffix(".py")


def short(path: str) -> str:
    parts = path.replace(os.sep, "/").split("/")
    i = len(parts) - 1 - parts[::-1].index("dmuon")
    return "/".join(parts[i:])


def worker(rank: int, world: int) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon
    from models import make_batches, make_model, muon_predicate

    model = make_model()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    dmuon.dedicate_params(model, mesh, muon_predicate)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, lr=0.02)
    batches = make_batches(3, 4)
    calls: Counter = Counter()
    files: set = set()

    def prof(frame, event, arg):
        if event != "call":
            return
        callee = frame.f_code.co_filename
        lc = layer_of(callee)
        if lc is None:
            return
        files.add(short(callee))
        back = frame.f_back
        while back is not None and layer_of(back.f_code.co_filename) is None:
            back = back.f_back  # through torch's own frames (autograd hooks, optimizer wrapper)
        if back is None:
            return
        lr_ = layer_of(back.f_code.co_filename)
        if lr_[0] < lc[0]:
            calls[(short(back.f_code.co_filename), short(callee))] += 1

    for i, ids in enumerate(batches):
        opt.zero_grad()
        loss = model(ids.chunk(world)[rank])
        if i == len(batches) - 1:
            sys.setprofile(prof)
        loss.backward()
        opt.step()
        sys.setprofile(None)
    by_layer: dict = {}
    for f in files:
        by_layer.setdefault(layer_of(f)[1], []).append(f)
    return {"files": sorted(files), "by_layer": {k: sorted(v) for k, v in by_layer.items()},
            "calls_up": [{"from": a, "to": b, "calls": n} for (a, b), n in sorted(calls.items())]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import datetime
    import platform
    import subprocess

    import torch

    from dmuon.launch import run_local_ranks
    results, errors = run_local_ranks(worker, 4, (), {}, backend="gloo", timeout_s=120)
    if errors:
        raise SystemExit("\n".join(errors.values()))
    r = results[0]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": platform.platform(), "torch": torch.__version__, "commit": commit.strip(),
           "files_count": len(r["files"]), "calls_up_sites": len(r["calls_up"]), **r}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"{len(r['files'])} dmuon files run on the gradient's path; "
          f"{len(r['calls_up'])} caller -> callee file pairs call up a layer")
    for c in r["calls_up"]:
        print(f"  {c['from']} -> {c['to']} ({c['calls']})")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
