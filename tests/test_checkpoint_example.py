"""``examples/checkpoint.py``: saves every k steps and resumes on another world size (full
``torch.save`` format; the sharded format's resume paths are tested in test_checkpoint_topology)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "checkpoint.py"), *args],
                          env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow  # the example script end to end; resume across topologies: test_checkpoint_topology
def test_checkpoint_example_saves_and_resumes_on_another_world_size(tmp_path):
    d = ["--dir", str(tmp_path), "--save-every", "3"]  # (--sharded: the same flow through DCP)
    first = _run("2", "--steps", "6", *d)
    assert re.findall(r"step +(\d+) .*saved", first) == ["3", "6"], first
    second = _run("1", "--steps", "9", *d)
    assert "resumed from step 6 on 1 rank(s)" in second, second
    assert re.findall(r"step +(\d+) .*saved", second) == ["9"], second


@pytest.mark.slow
def test_the_sharded_example_resumes_after_a_crash_between_the_publishs_renames(tmp_path):
    """A job killed between the publish's two renames leaves ``sharded.1`` (the older checkpoint)
    and the complete new one as ``sharded.partial-<id>``, no ``sharded``: the example resumes
    from the new one (``load_sharded`` finishes the publish) instead of starting over."""
    d = ["--dir", str(tmp_path), "--save-every", "3", "--sharded"]
    first = _run("2", "--steps", "6", *d)
    assert re.findall(r"step +(\d+) .*saved", first) == ["3", "6"], first
    os.rename(tmp_path / "sharded", tmp_path / "sharded.partial-0123456789ab")
    second = _run("2", "--steps", "9", *d)
    assert "resumed from step 6 on 2 rank(s)" in second, second
    assert re.findall(r"step +(\d+) .*saved", second) == ["9"], second
    assert sorted(os.listdir(tmp_path)) == ["sharded", "sharded.1"]
