"""The supported torch range (issue 36): 2.11 through 2.15 are tested; a newer torch warns and runs,
unless a private API dmuon wraps (:mod:`dmuon.compat.torch_api`) is gone, then the import warns and
``dedicate_params`` raises, naming it. Each case runs in a fresh interpreter that pretends to be a
newer torch (``torch.__version__``) before ``import dmuon``."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


from dmuon.compat import torch_api as compat

ROOT = Path(__file__).resolve().parents[1]

_PRELUDE = """
import warnings
import torch
torch.__version__ = {version!r}
{before_import}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import dmuon
    from dmuon.compat.fsdp_patch import is_installed
msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
print("WARN", len(msgs), " | ".join(msgs))
print("PATCHED", is_installed())
"""

# one gloo rank: dedicate_params, fully_shard, dmuon.Muon, two steps
_RUN = """
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
store = dist.HashStore()
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
try:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 1))
    mesh = init_device_mesh("cpu", (1,))
    try:
        dmuon.dedicate_params(model, mesh, predicate=lambda n, p: n == "0.weight")
    except RuntimeError as e:
        print("RAISED", e)
        raise SystemExit(0)
    fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, lr=0.02)
    x = torch.randn(4, 8)
    for _ in range(2):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    print("STEPPED", opt.num_steps)
finally:
    dist.destroy_process_group()
"""


def _run(version: str, before_import: str = "", run: bool = True) -> str:
    code = _PRELUDE.format(version=version, before_import=textwrap.dedent(before_import))
    code += _RUN if run else ""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_the_range_includes_2_15():
    assert compat.SUPPORTED_TORCH == ((2, 11), (2, 15))
    assert compat.torch_tested("2.15.0") and compat.torch_tested("2.15.1+cu132")
    assert not compat.torch_tested("2.16.0") and not compat.torch_tested("2.10.2")


def test_installed_torch_imports_without_a_warning():
    out = _run(__import__("torch").__version__, run=False)
    assert "WARN 0" in out and "PATCHED True" in out, out


def test_newer_torch_warns_and_runs():
    out = _run("2.99.0")
    assert "WARN 1" in out and "2.99.0" in out and "newer" in out, out
    assert "PATCHED True" in out and "STEPPED 2" in out, out


@pytest.mark.slow  # the default tier's 600 s budget; the slow tier runs it
def test_newer_torch_without_a_wrapped_private_api_raises_naming_it():
    out = _run("2.99.0", before_import="""
        import torch.distributed.fsdp._fully_shard._fsdp_init as init
        del init._get_managed_states
        """)
    assert "WARN 1" in out and "_get_managed_states" in out, out
    assert "PATCHED False" in out, out
    raised = out.split("RAISED", 1)[1]
    assert "dmuon.dedicate_params" in raised and "_get_managed_states" in raised, out
    assert "2.99.0" in raised and "2.15" in raised, out


@pytest.mark.slow  # the default tier's 600 s budget; the slow tier runs it
def test_older_torch_still_refuses():
    out = _run("2.10.0")
    assert "WARN 1" in out and "PATCHED False" in out, out
    raised = out.split("RAISED", 1)[1]
    assert "2.11" in raised and "2.10.0" in raised, out
