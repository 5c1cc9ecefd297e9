"""Lines of dmuon code the distributed training path reaches, two ways, grouped by package:

* ``static``: the import closure (every ``import`` in a module, those inside functions included)
  of the modules that define ``dmuon.dedicate_params``, ``dmuon.Muon`` and the hooks — what
  ``dedicate_params``, the hooks and ``Muon.step`` can reach;
* ``loaded``: the modules a real run loads (``import dmuon``, ``dedicate_params``,
  ``fully_shard``, two forward / backward / ``step`` on one gloo rank, CPU).

Writes JSON (date, machine, torch version).

    python benchmarks/training_path.py [--out results/training_path.json]

Used for the step-program restructuring's before/after figure (issue 33's note).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
from collections import defaultdict
from pathlib import Path


def _train_once() -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up_proj = nn.Linear(16, 32, bias=False)
            self.down_proj = nn.Linear(32, 16, bias=False)
            self.norm = nn.LayerNorm(16)

        def forward(self, x):
            return x + self.down_proj(torch.relu(self.up_proj(self.norm(x))))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Block() for _ in range(2))
            self.head = nn.Linear(16, 4)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/rdzv", rank=0, world_size=1)
        try:
            mesh = init_device_mesh("cpu", (1,))
            model = Net()
            dmuon.dedicate_params(model, mesh, predicate=lambda n, p: p.ndim == 2 and "proj" in n)
            for layer in model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = dmuon.Muon(model, lr=0.02)
            for _ in range(2):
                opt.zero_grad()
                model(torch.randn(4, 16)).sum().backward()
                opt.step()
        finally:
            dist.destroy_process_group()


def _static_closure(root: Path, seeds: list[str]) -> dict[str, int]:
    """``{module: lines}`` of the dmuon modules ``seeds`` import, transitively (AST)."""
    import ast

    def path_of(mod: str):
        base = root.parent / Path(*mod.split("."))
        for p in (base.with_suffix(".py"), base / "__init__.py"):
            if p.is_file():
                return p
        return None

    seen: dict[str, int] = {}
    todo = list(seeds)
    while todo:
        mod = todo.pop()
        p = path_of(mod)
        if mod in seen or p is None:
            continue
        text = p.read_text(encoding="utf-8")
        seen[mod] = len(text.splitlines())
        parts = mod.split(".")
        while len(parts) > 1:  # a package's __init__ runs before its modules
            parts = parts[:-1]
            todo.append(".".join(parts))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                todo += [a.name for a in node.names if a.name.startswith("dmuon")]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                    and node.module.startswith("dmuon"):
                todo.append(node.module)
                todo += [f"{node.module}.{a.name}" for a in node.names]
    return seen


def _by_package(files: dict[str, int]) -> dict[str, int]:
    per: dict[str, int] = defaultdict(int)
    for name, n in files.items():
        parts = name.split(".")
        per[parts[1] if len(parts) > 2 else "(top)"] += n
    return dict(sorted(per.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    _train_once()
    import torch
    import dmuon
    from dmuon.stateful.runtime import hooks as hooks_module

    root = Path(dmuon.__file__).resolve().parent
    loaded = {name: len(Path(mod.__file__).read_text(encoding="utf-8").splitlines())
              for name, mod in sorted(sys.modules.items())
              if name.startswith("dmuon") and getattr(mod, "__file__", None)}
    seeds = ["dmuon", dmuon.dedicate_params.__module__, dmuon.Muon.__module__,
             hooks_module.__name__]
    static = _static_closure(root, seeds)
    out = {"date": datetime.date.today().isoformat(), "machine": platform.node(),
           "torch": torch.__version__, "seeds": seeds,
           "static": {"modules": len(static), "lines": sum(static.values()),
                      "by_package": _by_package(static), "files": dict(sorted(static.items()))},
           "loaded": {"modules": len(loaded), "lines": sum(loaded.values()),
                      "by_package": _by_package(loaded), "files": loaded}}
    text = json.dumps(out, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    print(json.dumps({k: {kk: out[k][kk] for kk in ("modules", "lines", "by_package")}
                      for k in ("static", "loaded")}, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
