"""Batched Newton–Schulz for all matrices a rank owns, grouped by shape, replayed as a CUDA graph.

What it computes: for every input ``G_i`` (viewed as ``B_i`` matrices ``m_i x n_i`` through
:func:`~dmuon.newton_schulz.matrix_shape.as_matrix_shape`) exactly what
:func:`dmuon.newton_schulz.iteration.newton_schulz` computes, ``U_i ~ polar(G_i)``, returned in
``G_i``'s shape and dtype:

* matrices are grouped by ``(min(m, n), max(m, n))`` and orientation -- a tall matrix stays in
  its own layout and is iterated as the transposed view of it (``X^T``, the wide orientation;
  :func:`~dmuon.newton_schulz.iteration.left_product`), so no transposed copy is ever made --
  and each group is split into chunks of at most ``max_chunk_bytes`` of compute-dtype iterate
  (:func:`~dmuon.newton_schulz.chunks.plan_ns_chunks`);
* per chunk: Frobenius normalization straight from the sources into the batch (divisor
  :func:`~dmuon.newton_schulz.iteration.frobenius_denominator`, ``X_0 = G / (||G||_F + eps)``
  times the compute dtype's range lift, cast to the compute dtype, fp16 on CUDA, by
  :func:`dmuon.kernels.scale_cast.scale_cast_`), then one call of the functional core,
  ``ns_iterate(X_0, variant=..., sym=make_sym_op(sym_backend), lift=...)``, direct or Gram as
  :func:`~dmuon.newton_schulz.cost.choose_ns_variant` says for that shape, with
  the Gram restarts of ``gram_restart`` (by default 3 for fp16, else 2); every symmetric product
  runs on the Triton triangle kernel or cuBLAS (:mod:`dmuon.kernels.syrk`); the results are cast
  back into the destinations (``scale_cast_`` again). The engine holds no NS math of its own;
* on CUDA the whole program (gather + normalize, every chunk's iteration, scatter + cast) is
  captured once per input signature into one CUDA graph and replayed, so the host cost of a step
  is one replay whatever the number of matrices. Where capture is impossible (CPU tensors,
  ``cuda_graphs=False``, the caller is itself capturing, or capture raised) it runs eagerly; the
  reason is logged once.

Three ways to call it:

* ``engine.orthogonalize(tensors, batch_dims=...) -> list`` -- any tensors; the inputs are copied
  into engine-owned static buffers (one ``_foreach_copy_``), the graph replays, results are
  returned as new tensors (or copied into ``out=``).
* ``step = engine.bind(inputs, outputs, batch_dims=...)`` then ``step()`` each optimizer step --
  ``inputs``/``outputs`` are persistent tensors (e.g. the Nesterov buffers and the update
  buffers) whose storage does not move; the graph reads and writes them directly (no copies).
  ``outputs[i]`` must be contiguous with ``inputs[i]``'s shape; it may be ``inputs[i]`` itself
  (then ``bind`` itself overwrites the inputs' current values with its warm-up run).
* ``engine.orthogonalize_(tensors, batch_dims=...)`` -- in place, keyed by the tensors' storage:
  eager the first time, captured when a key comes on two calls in a row, replayed after that (no
  copies, no static buffers; what ``dmuon.Muon`` uses on CUDA: graph replay on persistent
  gradient buckets, or on freed ones whose addresses stay put; eager where they cycle).
  ``engine(xs)`` is that on ``(B, m, n)`` inputs: the engine itself is the ``orthogonalize=``
  hook of :func:`dmuon.functional.muon.update`; with ``engine.timer`` set
  (:class:`~dmuon.newton_schulz.timing.NSTimer`) it records each call's span and mode there.
"""
from __future__ import annotations

import logging
from typing import Any, Optional, Sequence, Union

import torch
from torch import Tensor

from dmuon.kernels.streams import side_stream
from dmuon.newton_schulz.coefficients import ns_coefficient_table
from dmuon.newton_schulz.config import NSConfig
from dmuon.newton_schulz.iteration import (default_ns_dtype, default_range_lift,
                                            frobenius_denominator, left_product, ns_iterate,
                                            resolve_gram_restart)
from dmuon.newton_schulz.chunks import NSChunk, plan_ns_chunks
from dmuon.newton_schulz.timing import NSTimer
from dmuon.kernels.scale_cast import scale_cast_
from dmuon.kernels.syrk import make_sym_op

__all__ = ["NSEngine", "BoundNS"]

log = logging.getLogger(__name__)
_LOGGED: set = set()


def _log_once(key: str, msg: str, *args) -> None:
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.warning(msg, *args)


_FP32_OUT: dict = {}


def _bmm_fp32_out_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.bmm(x, y, out_dtype=float32, out=...)`` runs here for 16-bit ``dtype``
    operands (probed once per device and dtype)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return False
    key = f"{device}/{dtype}"
    if torch.cuda.is_current_stream_capturing():
        return _FP32_OUT.get(key, False)   # never probe inside someone's graph capture
    if key not in _FP32_OUT:
        try:
            a = torch.ones(1, 16, 16, device=device, dtype=dtype)
            out = torch.empty(1, 16, 16, device=device, dtype=torch.float32)
            torch.bmm(a, a.mT, out_dtype=torch.float32, out=out)
            _FP32_OUT[key] = bool((out == 16).all())
        except Exception as exc:  # older torch / backend without the dtype overload
            _log_once("fp32out", "NSEngine: bmm with out_dtype unavailable (%s); casting results "
                      "in a separate pass", exc)
            _FP32_OUT[key] = False
    return _FP32_OUT[key]


def capture_graph(fn, pool, stream: torch.cuda.Stream) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Capture ``fn()`` into a new CUDA graph on ``stream`` with memory from ``pool``; returns
    ``(graph, what fn returned)`` (tensors written by each replay).

    Unlike ``torch.cuda.graph``, whose ``__enter__`` synchronizes the device and empties the
    caching allocator's cache, this neither synchronizes nor frees anything: a capture in the
    middle of a training step (``orthogonalize_``) would otherwise hand every cached block back to
    the driver, and the next forward would ``cudaMalloc`` it all again (issue 24: 130 mallocs and
    frees in such a step). The capture's own allocations come from ``pool`` (the allocator may
    ``cudaMalloc`` new segments for it, which is legal while capturing).
    ``capture_error_mode="thread_local"``: other threads (NCCL's watchdog) may query events.
    """
    g = torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    # Python's gc stays off while capturing: a collection would free a dropped model's graphs
    # (their private pools) in the middle of this capture, which torch's allocator asserts on
    # ("use_count > 0", seen when a model was rebuilt in one process)
    with torch.cuda.stream(stream):
        g.capture_begin(pool, capture_error_mode="thread_local")
        try:
            out = fn()
        finally:
            g.capture_end()
    torch.cuda.current_stream(stream.device).wait_stream(stream)
    return g, out


class _Program:
    """Runs (and on CUDA captures) one signature's gather -> NS -> scatter over fixed tensors."""

    def __init__(self, engine: "NSEngine", srcs: Sequence[Tensor], dsts: Sequence[Tensor],
                 batch_dims: Sequence[int], capture: bool = True):
        self.engine = engine
        self.srcs = list(srcs)
        self.dsts = list(dsts)
        self.device = self.srcs[0].device if self.srcs else torch.device("cpu")
        self.cdtype = engine.dtype or default_ns_dtype(self.device)
        self.gram_restart = resolve_gram_restart(engine.gram_restart, self.cdtype)
        self.lift = default_range_lift(self.cdtype)
        self.chunks, self.empty = plan_ns_chunks(
            [t.shape for t in self.srcs], batch_dims, steps=engine.steps,
            gram_restart=self.gram_restart, itemsize=torch.empty((), dtype=self.cdtype).itemsize,
            max_chunk_bytes=engine.max_chunk_bytes)
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.mode = "eager"
        self.capture_tried = False         # orthogonalize_: one capture attempt per program
        self._sym = make_sym_op(engine.sym_backend)
        fp32_out = self.device.type == "cuda" and _bmm_fp32_out_supported(self.device, self.cdtype)
        # per chunk, once: may Gram's last product write the (fp32) destinations directly?
        self._fused_final = tuple(
            fp32_out and all(self.dsts[e.index].dtype == torch.float32 for e in ch.entries)
            for ch in self.chunks)
        if capture:
            self._maybe_capture()

    # -- the program --------------------------------------------------------------------------
    def _run_chunk(self, ch: NSChunk, fused: bool) -> None:
        eng = self.engine
        shape = (ch.batch, ch.long, ch.short) if ch.tall else (ch.batch, ch.short, ch.long)
        buf = torch.empty(shape, dtype=self.cdtype, device=self.device)
        for e in ch.entries:                   # gather: X_0 = s G / (||G||_F + eps), cast
            src = self.srcs[e.index].reshape(e.batch, e.m, e.n).contiguous()
            denom = frobenius_denominator(src, eng.eps, self.cdtype, lift=self.lift)
            scale_cast_(buf[e.offset:e.offset + e.batch], src, denom)
        x0 = buf.mT if ch.tall else buf        # wide view; tall chunks iterate in their layout
        y = ns_iterate(x0, eng.table, variant=ch.variant, sym=self._sym,
                       gram_restart=self.gram_restart, final=self._final_product(ch, fused),
                       lift=self.lift)
        if y is None:                          # the last product wrote the destinations
            return
        yb = y.mT if ch.tall else y            # contiguous, laid out like the entries
        for e in ch.entries:                   # scatter: cast back to the destination dtype
            scale_cast_(self.dsts[e.index].view(e.batch, e.m, e.n),
                        yb[e.offset:e.offset + e.batch])

    def _final_product(self, ch: NSChunk, fused: bool):
        """The last general product, written by cuBLAS straight into fp32 destinations.

        On CUDA with a 16-bit compute dtype and fp32 destinations, Gram's ``Q X_0`` is done per
        entry with ``torch.bmm(..., out_dtype=float32, out=dst)``: the fp32 accumulator is stored
        without the bf16 rounding and the separate cast pass over the result. Otherwise (and for
        the direct variant's ``a X + Z X``) ``None``: the default product and a scatter.
        ``fused`` is that condition for ``ch``, decided once when the program is built. A product
        that still carries the fp16 range lift (``alpha != 1``: a Gram run without restarts) takes
        the default path too.
        """
        if not fused:
            return None

        def final(p: Tensor, x: Tensor, *, alpha: float = 1.0, beta: float = 0.0,
                  c: Optional[Tensor] = None):
            if c is not None or alpha != 1.0:
                return left_product(p, x, alpha=alpha, beta=beta, c=c)
            for e in ch.entries:
                pe, xe = p[e.offset:e.offset + e.batch], x[e.offset:e.offset + e.batch]
                dst = self.dsts[e.index].view(e.batch, e.m, e.n)
                if ch.tall:                    # dst = (P X)^T = X^T P^T, in the tall layout
                    torch.bmm(xe.mT, pe.mT, out_dtype=torch.float32, out=dst)
                else:
                    torch.bmm(pe, xe, out_dtype=torch.float32, out=dst)
            return None
        return final

    def run_eager(self) -> None:
        for i in self.empty:
            self.dsts[i].zero_()
        for ch, fused in zip(self.chunks, self._fused_final):
            self._run_chunk(ch, fused)

    def _maybe_capture(self, warmup: bool = True) -> None:
        """Capture the program (CUDA). ``warmup=False``: the caller ran it eagerly on this device
        already (kernels compiled, handles made), so it is captured straight away and never run
        here -- required when outputs alias inputs, which a warm-up run would overwrite."""
        eng = self.engine
        if self.device.type != "cuda":
            return
        if not eng.cuda_graphs:
            _log_once("disabled", "NSEngine: CUDA graphs disabled (cuda_graphs=False); "
                      "running NS eagerly")
            return
        try:
            if warmup:
                side = side_stream(self.device, "ns_warmup")
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):  # warm-up: Triton compiles, cuBLAS handles/workspaces
                    self.run_eager()
                torch.cuda.current_stream(self.device).wait_stream(side)
                # The warm-up's temporaries sit cached on the side stream, where the graph's
                # private pool cannot use them; on a nearly full device the capture would then
                # need cudaFree, which is illegal while capturing. Hand them back first.
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()
            self.graph, self.mode = capture_graph(self.run_eager, eng._pool(self.device),
                                                  eng._capture_stream(self.device))[0], "graph"
        except Exception as exc:  # capture impossible: fall back, say why once
            self.graph, self.mode = None, "eager"
            _log_once(f"capture:{type(exc).__name__}",
                      "NSEngine: CUDA graph capture failed (%s: %s); running NS eagerly",
                      type(exc).__name__, exc)
            torch.cuda.synchronize(self.device)

    def __call__(self) -> None:
        if self.graph is not None and not torch.cuda.is_current_stream_capturing():
            self.graph.replay()
        else:
            self.run_eager()


class BoundNS:
    """A captured NS program over fixed input/output tensors; call it once per step."""

    def __init__(self, program: _Program):
        self._program = program

    @property
    def mode(self) -> str:
        """``"graph"`` (one CUDA graph replay per call) or ``"eager"``."""
        return self._program.mode

    @property
    def chunks(self) -> tuple[NSChunk, ...]:
        """The batched calls this program makes (shape groups, split by ``max_chunk_bytes``)."""
        return self._program.chunks

    def __call__(self) -> None:
        self._program()


class NSEngine:
    """Batched, graph-replayed Newton–Schulz for a set of matrices (see the module docstring).

    Args:
      config: what it computes (:class:`~dmuon.newton_schulz.config.NSConfig`: the settings of
        :func:`dmuon.newton_schulz.iteration.newton_schulz` under ``MuonHParams``' names;
        ``ns_dtype=None``: fp16 on CUDA, fp32 on CPU; ``ns_gram_restart="auto"``: 3 for fp16,
        else 2).
      cuda_graphs: capture and replay on CUDA (default True).
      sym_backend: symmetric products on ``"triton"``, ``"torch"`` (cuBLAS) or ``"auto"``
        (Triton on CUDA when importable).
      max_chunk_bytes: cap on one batched call's compute-dtype iterate (default 4 GiB), which
        bounds the workspace (about 3-4 iterates plus the ``m x m`` matrices of a chunk).
    """

    def __init__(self, config: NSConfig = NSConfig(), *, cuda_graphs: bool = True,
                 sym_backend: str = "auto", max_chunk_bytes: Optional[int] = 4 << 30):
        if not isinstance(config, NSConfig):
            raise TypeError(f"NSEngine(config): an NSConfig, got {type(config).__name__}")
        steps, coefficients, eps, dtype, gram_restart, safety = config
        if not (eps >= 0.0):
            raise ValueError(f"ns_eps must be >= 0, got {eps!r}")
        if sym_backend not in ("auto", "triton", "torch"):
            raise ValueError(f"sym_backend must be 'auto', 'triton' or 'torch', got {sym_backend!r}")
        if max_chunk_bytes is not None and max_chunk_bytes <= 0:
            raise ValueError(f"max_chunk_bytes must be positive or None, got {max_chunk_bytes!r}")
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating dtype, got {dtype}")
        self.config = config
        self.steps = steps
        self.table = ns_coefficient_table(coefficients, steps, safety=safety)
        self.eps = float(eps)
        self.dtype = dtype
        resolve_gram_restart(gram_restart, torch.float32)  # validate now; resolved per program
        self.gram_restart = gram_restart
        self.cuda_graphs = cuda_graphs
        self.sym_backend = sym_backend
        self.max_chunk_bytes = max_chunk_bytes
        self._pools: dict = {}
        self._programs: dict = {}
        self._inplace: dict = {}          # orthogonalize_ programs by storage key, LRU order
        self._retired_graphs: list = []   # graphs of evicted programs (:meth:`_retire`)
        self.max_programs = 4
        # Capturing costs about one NS run of host time and its pool holds workspace memory: a
        # bound, whatever the callers' buffers do.
        self.max_inplace_captures = 4
        self._inplace_captures = 0
        self.last_mode = "none"           # "graph" / "eager" of the last orthogonalize_ call
        self._last_inplace_key: Optional[tuple] = None
        self.timer: Optional[NSTimer] = None  # where __call__ records its spans, if anywhere

    def twin(self) -> "NSEngine":
        """A new engine computing exactly what this one computes (same settings and timer) with
        programs of its own, so that its callers never evict or replace this one's."""
        t = NSEngine(self.config, cuda_graphs=self.cuda_graphs, sym_backend=self.sym_backend,
                     max_chunk_bytes=self.max_chunk_bytes)
        t.max_programs, t.max_inplace_captures, t.timer = (self.max_programs,
                                                           self.max_inplace_captures, self.timer)
        return t

    def _retire(self, prog: "_Program") -> None:
        """Drop an evicted program but keep its CUDA graph (never replayed again) while the engine
        lives. The graphs share one memory pool; when a pool's last graph dies while the pool
        still holds blocks, torch's device and host allocators assert (``use_count > 0``) at the
        next capture into it, and NS would run eagerly for the rest of training (measured on the
        H200, torch 2.11). The kept graphs cost no memory of their own (the pool is shared) and are
        bounded by ``max_inplace_captures``; the program's tensors are released."""
        if prog.graph is not None:
            self._retired_graphs.append(prog.graph)
        prog.graph = None

    def _capture_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The process's NS capture stream of ``device`` (:func:`~dmuon.kernels.streams.side_stream`:
        a stream per engine would leave its cuBLAS workspace behind when the engine is freed)."""
        return side_stream(device, "ns_capture")

    def _pool(self, device: torch.device):
        """One graph memory pool per device, shared by this engine's programs (run in order)."""
        if device not in self._pools:
            self._pools[device] = torch.cuda.graph_pool_handle()
        return self._pools[device]

    @staticmethod
    def _batch_dims(n: int, batch_dims: Union[int, Sequence[int]]) -> list[int]:
        if isinstance(batch_dims, int):
            return [batch_dims] * n
        bd = list(batch_dims)
        if len(bd) != n:
            raise ValueError(f"batch_dims has {len(bd)} entries for {n} tensors; give one int or "
                             "one per tensor")
        return bd

    @staticmethod
    def _signature(inputs: Sequence[Tensor], bd: Sequence[int]) -> tuple:
        """The key of ``orthogonalize``'s programs: shapes, batch dims, dtypes, devices."""
        return tuple((tuple(t.shape), d, t.dtype, t.device) for t, d in zip(inputs, bd))

    @staticmethod
    def _check(inputs: Sequence[Tensor]) -> None:
        devs = {t.device for t in inputs}
        if len(devs) > 1:
            raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devs))}")
        for t in inputs:
            if not t.is_floating_point():
                raise ValueError(f"NS inputs must be floating point, got {t.dtype}")

    def bind(self, inputs: Sequence[Tensor], outputs: Sequence[Tensor], *,
             batch_dims: Union[int, Sequence[int]] = 0) -> BoundNS:
        """Capture the program that writes ``NS(inputs[i])`` into ``outputs[i]``; returns a callable.

        The tensors' storage must stay where it is for as long as the result is used (the graph
        holds their addresses); their values may change freely between calls.
        """
        inputs, outputs = list(inputs), list(outputs)
        if len(inputs) != len(outputs):
            raise ValueError(f"{len(inputs)} inputs but {len(outputs)} outputs")
        self._check(inputs + outputs)
        for i, (x, y) in enumerate(zip(inputs, outputs)):
            if x.shape != y.shape or not y.is_contiguous():
                raise ValueError(f"outputs[{i}] must be contiguous with shape {tuple(x.shape)}, "
                                 f"got shape {tuple(y.shape)}, contiguous={y.is_contiguous()}")
        return BoundNS(_Program(self, inputs, outputs, self._batch_dims(len(inputs), batch_dims)))

    def orthogonalize(self, inputs: Sequence[Tensor], *, batch_dims: Union[int, Sequence[int]] = 0,
                      out: Optional[Sequence[Tensor]] = None) -> list[Tensor]:
        """``[newton_schulz(x) for x in inputs]`` in batched form; inputs are not mutated.

        Args:
          inputs: tensors (one device), each ``B`` matrices by ``batch_dims``.
          batch_dims: one int for all, or one per input.
          out: optional tensors to receive the results (else new tensors are returned).

        Returns:
          The results, in order, each with its input's shape and dtype.
        """
        inputs = list(inputs)
        if not inputs:
            return []
        bd = self._batch_dims(len(inputs), batch_dims)
        key = self._signature(inputs, bd)
        prog = self._programs.get(key)
        if prog is None:
            self._check(inputs)
            srcs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in inputs]
            torch._foreach_copy_(srcs, inputs)
            dsts = [torch.empty_like(t) for t in srcs]
            prog = self._programs[key] = _Program(self, srcs, dsts, bd)
        else:
            torch._foreach_copy_(prog.srcs, inputs)
        prog()
        if out is not None:
            out = list(out)
            torch._foreach_copy_(out, prog.dsts)
            return out
        return [t.clone() for t in prog.dsts]

    def orthogonalize_(self, tensors: Sequence[Tensor], *,
                       batch_dims: Union[int, Sequence[int]] = 0) -> list[Tensor]:
        """In place: overwrite every tensor with its Newton–Schulz result; returns ``tensors``.

        For callers whose buffers stay put across steps (the optimizer's donated gradient buckets)
        this costs no copies and no extra memory beyond the NS workspace. Programs are keyed by the
        tensors' storage (address, shape, dtype, batch dims): the first call with a key runs
        eagerly; when the same key comes on two calls in a row, that call captures a CUDA graph
        (once, without a warm-up run, which would overwrite the inputs; without synchronizing or
        emptying the allocator's cache) and every later call replays it. Keys whose addresses
        change or cycle between calls (gradient buckets freed between steps) never capture and
        stay eager, with no allocator churn. At most ``max_programs`` keys are kept (least
        recently used dropped), and at most ``max_inplace_captures`` graphs are ever captured here.

        Args:
          tensors: contiguous floating tensors on one device, each ``B`` matrices by
            ``batch_dims``; their values are replaced.
          batch_dims: one int for all, or one per tensor.

        Returns:
          ``list(tensors)`` (the same objects, now holding the results).
        """
        tensors = list(tensors)
        if not tensors:
            return []
        bd = self._batch_dims(len(tensors), batch_dims)
        for t in tensors:
            if not t.is_contiguous():
                raise ValueError(f"orthogonalize_ needs contiguous tensors, got shape "
                                 f"{tuple(t.shape)} with strides {t.stride()}")
        key = ("inplace",) + tuple((t.data_ptr(), tuple(t.shape), d, t.dtype, t.device)
                                   for t, d in zip(tensors, bd))
        prog = self._inplace.pop(key, None)
        consecutive = key == self._last_inplace_key
        self._last_inplace_key = key
        if prog is None:
            self._check(tensors)
            prog = _Program(self, tensors, tensors, bd, capture=False)
            prog.run_eager()
        else:
            prog.srcs = prog.dsts = list(tensors)   # same storage; keep the live tensor objects
            # Capture once, when the key recurs on two calls in a row: stable buffers (persistent
            # gradient buckets) capture at their second call; buffers whose addresses cycle
            # (buckets freed between steps) never do (the graph would replay only now and then,
            # while its private pool held workspace memory the rest of the step cannot use).
            if (consecutive and not prog.capture_tried and prog.device.type == "cuda"
                    and self.cuda_graphs and not torch.cuda.is_current_stream_capturing()):
                prog.capture_tried = True
                if self._inplace_captures < self.max_inplace_captures:
                    self._inplace_captures += 1
                    prog._maybe_capture(warmup=False)
                elif self._inplace_captures == self.max_inplace_captures:
                    self._inplace_captures += 1
                    log.info("NSEngine.orthogonalize_: %d graphs captured already, running "
                             "eagerly from now on for new buffer addresses",
                             self.max_inplace_captures)
            prog()
        self._inplace[key] = prog
        while len(self._inplace) > self.max_programs:
            self._retire(self._inplace.pop(next(iter(self._inplace))))
        self.last_mode = prog.mode
        return tensors

    def __call__(self, xs: Sequence[Tensor]) -> list[Tensor]:
        """:meth:`orthogonalize_` of ``(B, m, n)`` inputs (the ``orthogonalize=`` hook of
        :func:`dmuon.functional.muon.update`), timed into :attr:`timer` when one is set."""
        xs = list(xs)
        if self.timer is None or not xs:
            return self.orthogonalize_(xs, batch_dims=1)
        out = self.timer.run(xs[0].device, self.orthogonalize_, xs, batch_dims=1)
        self.timer.mode = self.last_mode
        return out

    def mode(self, inputs: Sequence[Tensor], batch_dims: Union[int, Sequence[int]] = 0) -> str:
        """``"graph"`` or ``"eager"`` for the program of this signature (``"none"`` if not built)."""
        prog = self._programs.get(self._signature(inputs, self._batch_dims(len(inputs), batch_dims)))
        return "none" if prog is None else prog.mode
