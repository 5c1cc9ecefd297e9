"""dmuon's host (Python) time per step, on CPU: a stack of ``--layers`` blocks of seven tiny
``Linear(--dim, --dim)`` matrices (a Llama layer's count: q, k, v, o, gate, up, down), so the
math is negligible and what is left is the host's work per matrix; FSDP2 per block, one gloo rank
(world 1, where the GPU step is host-bound: ``ns_overlap_host.py``). Times forward, backward and
``step()`` (medians of ``--steps`` steps after 3 warm-up steps) for dmuon's Muon and for FSDP2 +
``torch.optim.AdamW`` on the same model, as wall time and as the main thread's CPU time
(``time.thread_time``: the host work itself, less sensitive to other processes on a shared
machine), and counts the calls of dmuon's ``__torch_function__`` guards per step (each a Python
dispatch), and, in one more step under ``sys.setprofile``, the Python function calls and the
calls of built-ins (torch's ops among them) from the forward to the end of ``step()``: counts
that do not depend on the machine's load.

Writes JSON (date, machine, torch version).

    python benchmarks/host_overhead.py --out benchmarks/results/host_overhead.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_util import run_header, write_json  # noqa: E402


def _worker(rank: int, world: int, layers: int, dim: int, steps: int) -> dict:
    import torch
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon
    from dmuon.stateful.runtime.guard_base import TorchGuard

    torch.set_num_threads(1)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
            self.mats = nn.ModuleDict({n: nn.Linear(dim, dim, bias=False) for n in names})
            self.norm = nn.LayerNorm(dim)

        def forward(self, x):
            h = self.norm(x)
            return x + sum(m(h) for m in self.mats.values()) / 7

    def build(muon: bool):
        torch.manual_seed(0)
        model = nn.Sequential(*[Block() for _ in range(layers)])
        mesh = init_device_mesh("cpu", (world,))
        if muon:
            dmuon.dedicate_params(model, mesh, lambda n, p: p.ndim == 2)
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = (dmuon.Muon(model, lr=0.02) if muon
               else torch.optim.AdamW(model.parameters(), lr=1e-3))
        return model, opt

    calls = [0]
    plain_tf = TorchGuard.__dict__["__torch_function__"].__func__

    def counted(cls, func, types, args=(), kwargs=None):
        calls[0] += 1
        return plain_tf(cls, func, types, args, kwargs)

    out = {}
    x = torch.randn(4, dim)
    for label, muon in (("fsdp2_adamw", False), ("dmuon", True)):
        model, opt = build(muon)
        TorchGuard.__torch_function__ = classmethod(counted)
        times: dict = {"forward": [], "backward": [], "step": []}
        cpu: dict = {"forward": [], "backward": [], "step": []}
        guard_calls = []
        for i in range(3 + steps):
            calls[0] = 0
            opt.zero_grad()
            t0, c0 = time.perf_counter(), time.thread_time()
            loss = model(x).square().mean()
            t1, c1 = time.perf_counter(), time.thread_time()
            loss.backward()
            t2, c2 = time.perf_counter(), time.thread_time()
            opt.step()
            t3, c3 = time.perf_counter(), time.thread_time()
            if i >= 3:
                for k, t, c in (("forward", t1 - t0, c1 - c0), ("backward", t2 - t1, c2 - c1),
                                ("step", t3 - t2, c3 - c2)):
                    times[k].append(t * 1e3)
                    cpu[k].append(c * 1e3)
                guard_calls.append(calls[0])
        TorchGuard.__torch_function__ = classmethod(plain_tf)
        events = {"call": 0, "c_call": 0}  # one more step, profiled: machine-independent counts

        def prof(frame, event, arg):
            if event in events:
                events[event] += 1
        opt.zero_grad()
        sys.setprofile(prof)
        model(x).square().mean().backward()
        opt.step()
        sys.setprofile(None)
        med = {k: round(statistics.median(v), 3) for k, v in times.items()}
        med["total"] = round(sum(med.values()), 3)
        med_cpu = {k: round(statistics.median(v), 3) for k, v in cpu.items()}
        med_cpu["total"] = round(sum(med_cpu.values()), 3)
        out[label] = {"median_ms": med, "main_thread_cpu_ms": med_cpu,
                      "guard_calls_per_step": max(guard_calls),
                      "python_calls_per_step": events["call"],
                      "builtin_calls_per_step": events["c_call"]}
        del model, opt
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    import subprocess

    from dmuon.launch import run_local_ranks
    results, errors = run_local_ranks(_worker, 1, (args.layers, args.dim, args.steps), {},
                                      backend="gloo", timeout_s=600)
    if errors:
        raise SystemExit("\n".join(errors.values()))
    r = results[0]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    doc = {**run_header(), "commit": commit, "layers": args.layers, "dim": args.dim,
           "matrices": 7 * args.layers, "steps": args.steps, **r}
    write_json(args.out, doc)
    for label, v in r.items():
        print(f"{label}: wall {v['median_ms']} ms; main thread CPU {v['main_thread_cpu_ms']} ms; "
              f"guard calls per step {v['guard_calls_per_step']}; Python calls "
              f"{v['python_calls_per_step']}, built-in calls {v['builtin_calls_per_step']}")


if __name__ == "__main__":
    main()
