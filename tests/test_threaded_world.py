"""The threaded-ranks harness (``tests/threaded_world.py``) on CPU: dmuon at world 2 and 4 as
threads of one process equals the single-process reference, as the gloo processes do — the check
that the harness the H200 test runs the CUDA path with (``test_world_gpu_threads.py``) is a
faithful backend: its added ``reduce``, its thread-local worlds, one model build at a time.
Slow tier (each world ~10 s of CPU)."""
from __future__ import annotations

import pytest

from test_world_gpu_threads import check

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("world", [2, 4])
def test_threaded_ranks_on_cpu_equal_the_reference(world):
    check(world, "cpu")
