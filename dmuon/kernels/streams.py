"""Process-wide CUDA side streams, made once per (device, role, priority, thread) and reused.

Every stream that runs a matmul gets its own cuBLAS workspace (32 MiB on Hopper), which torch
keeps for the life of the process, keyed by the stream: a model that made fresh streams would
leave one workspace behind per stream when it is freed (measured on an H200: +32 MiB allocated
per rebuilt model). So dmuon's engines, executors and checks take their streams from here and
a rebuilt model reuses its predecessor's. Streams are FIFO queues ordered by events, so models
alive at once may share them; each thread (a rank of a threaded world) has its own.
"""
from __future__ import annotations

import threading
from typing import Union

import torch

__all__ = ["side_stream"]

_STREAMS: dict[tuple, "torch.cuda.Stream"] = {}
_LOCK = threading.Lock()


def side_stream(device: Union[torch.device, int, None], role: str, *,
                high_priority: bool = False) -> "torch.cuda.Stream":
    """The stream of ``role`` (``"ns_capture"``, ``"unshard"``, ...) on ``device``: created on
    first use, then the same object for every later caller of this thread."""
    if device is None or isinstance(device, int):
        index = torch.cuda.current_device() if device is None else device
    else:
        index = device.index if device.index is not None else torch.cuda.current_device()
    prio = torch.cuda.Stream.priority_range()[1] if high_priority else 0  # (low, high)
    key = (index, role, prio, threading.get_ident())
    with _LOCK:
        st = _STREAMS.get(key)
        if st is None:
            st = _STREAMS[key] = torch.cuda.Stream(device=index, priority=prio)
    return st
