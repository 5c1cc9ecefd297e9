"""Torch compatibility: every private torch name dmuon uses (:mod:`~dmuon.compat.torch_api`, with
the supported torch range), the ``fully_shard`` patch that ``import dmuon`` installs
(:mod:`~dmuon.compat.fsdp_patch`) and the reads of FSDP2's state (:mod:`~dmuon.compat.fsdp_info`).

It imports torch only: ``import dmuon`` loads it (the seeds' contract), and so does
``import dmuon.functional``, which loads no module of :mod:`dmuon.stateful`.
"""
