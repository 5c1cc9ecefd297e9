"""The timeouts of the process groups of the meshes FSDP2 runs on (torch's side:
``init_device_mesh``'s sub-groups keep torch's default timeout, not the default group's).
Moved here from :mod:`dmuon.stateful.setup.dedicate`, which calls it."""
from __future__ import annotations

import datetime
import logging
from typing import Optional

import torch
import torch.distributed as dist

from dmuon.compat.torch_api import group_timeout, set_group_timeout

__all__ = ["bound_mesh_groups"]


def bound_mesh_groups(meshes: tuple, timeout: Optional[datetime.timedelta],
                      logger: logging.Logger) -> None:
    """FSDP2 runs its collectives on the groups of the mesh it is given; ``init_device_mesh``'s
    sub-groups get torch's default timeout (30 minutes), not ``init_process_group(timeout=)``.
    Lower every such group's timeout to dmuon's, so a hung rank surfaces within the same bound on
    every collective of the step. The default group itself (a 1-D mesh over the whole world uses
    it) is the user's: if it waits longer than dmuon's bound, warn with the fix (on ``logger``:
    the caller's)."""
    if timeout is None:
        return
    world = dist.group.WORLD
    for mesh in meshes:
        if mesh is None:
            continue
        for pg in mesh.get_all_groups():
            cur = group_timeout(pg, str(mesh.device_type))
            if cur is None or cur <= timeout:
                continue
            if pg is world:
                logger.warning(
                    "dmuon: FSDP2's collectives on this mesh run on the default process group, "
                    "whose timeout (%s) is longer than dedicate_params(timeout=%s): a hung rank "
                    "would surface only after %s there. For one bound, pass "
                    "init_process_group(..., timeout=datetime.timedelta(seconds=%d)).",
                    cur, timeout, cur, int(timeout.total_seconds()))
            elif not set_group_timeout(pg, timeout):
                logger.warning("dmuon: could not lower the timeout (%s) of a mesh group to "
                               "dedicate_params(timeout=%s) on torch %s", cur, timeout,
                               torch.__version__)
