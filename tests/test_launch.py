"""``dmuon.launch.run``: spawns local gloo ranks that each run ``main`` in a live default group, and a
failing worker makes a script exit non-zero with that worker's traceback (no hang)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _write_rank(out_dir: str, tag: str) -> None:
    """Each rank all-reduces its rank and writes what it saw of the group to ``out_dir/<rank>``."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    env = f"{os.environ['RANK']},{os.environ['LOCAL_RANK']},{os.environ['WORLD_SIZE']}"
    Path(out_dir, str(rank)).write_text(
        f"{tag} {rank} {world} {x.item():g} {dist.get_backend()} {torch.get_num_threads()} {env}")


def test_run_spawns_two_gloo_ranks(tmp_path, monkeypatch):
    from dmuon.launch import run

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    run(_write_rank, str(tmp_path), "hi", world_size=2, backend="gloo", timeout_s=30)
    got = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert got == {"0": "hi 0 2 3 gloo 1 0,0,2", "1": "hi 1 2 3 gloo 1 1,1,2"}, got


_FAILING = textwrap.dedent("""
    import torch
    import torch.distributed as dist
    from dmuon.launch import run

    def main(bad_rank):
        if dist.get_rank() == bad_rank:
            raise ValueError(f"boom from rank {bad_rank}")
        dist.all_reduce(torch.ones(1))  # the other rank would wait here forever

    if __name__ == "__main__":
        run(main, 1, world_size=2, backend="gloo", timeout_s=30)
        print("unreachable")
""")


@pytest.mark.slow  # a subprocess with 2 ranks; the in-process launch failure is in test_demo.py
def test_failing_worker_exits_nonzero_with_traceback(tmp_path):
    script = tmp_path / "failing.py"
    script.write_text(_FAILING)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode != 0, (proc.stdout, proc.stderr)
    assert "ValueError: boom from rank 1" in proc.stderr, proc.stderr[-3000:]
    assert "unreachable" not in proc.stdout


def _env_of_rank(rank, world_size):
    import torch.distributed as dist
    return {"seen": os.environ.get("DMUON_TEST_LAUNCH_ENV"),
            "gone": os.environ.get("DMUON_TEST_GONE"), "world": dist.get_world_size()}


def test_forkserver_ranks_get_the_parents_current_environment(monkeypatch):
    """The tests' ranks come from a forkserver started once (dist_utils): a variable the parent
    sets or removes after the server started reaches the ranks as it would a spawned one."""
    from dist_utils import run_ranks

    from dmuon.launch import run_local_ranks

    monkeypatch.setenv("DMUON_TEST_GONE", "1")
    run_ranks(_env_of_rank, 2)  # the server runs (it may have before this test)
    monkeypatch.setenv("DMUON_TEST_LAUNCH_ENV", "now")
    monkeypatch.delenv("DMUON_TEST_GONE")
    out = run_local_ranks(_env_of_rank, 2, start_method="forkserver", timeout_s=60, deadline_s=90)
    assert not out.errors and [out.results[r] for r in (0, 1)] == \
        [{"seen": "now", "gone": None, "world": 2}] * 2, out
    with pytest.raises(ValueError, match="never 'fork'"):
        run_local_ranks(_env_of_rank, 2, start_method="fork")
