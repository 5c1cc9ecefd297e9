"""Run dmuon's Triton kernels in Triton's CPU interpreter and check them (CI has no GPU).

Run as a script (``tests/test_kernels_interpreter.py`` does, in a subprocess, because
``TRITON_INTERPRET=1`` must be set before Triton is imported). Checks, against fp64 references:

* the pointer triangle kernel ``sym_abt_triton`` on an even (256 x 128) and an uneven (200 x 136)
  shape: ``a a^T`` with epilogue, and ``a b`` for two commuting symmetric matrices, results exactly
  symmetric (the mirror-exact diagonal tiles) and within bf16 tolerance;
* the TMA triangle kernel ``sym_abt_tma`` (descriptor loads and stores are emulated) in three
  configs, on a contiguous and a transposed operand, same checks;
* the scale-and-cast kernel: the division bitwise equal to ``torch.div`` (fp32 out), the bf16 cast
  within one ulp (the interpreter truncates), the plain cast exact.
* Muon's fused elementwise stages (:mod:`dmuon.kernels.muon_elementwise`): momentum (Nesterov
  input in its own tensor and in the gradient's storage) and apply against the fp64 formulas
  (fp32, one rounding), fp64 tensors falling back to the foreach stages bitwise, and a whole
  ``muon.update`` with them as its stage implementations close to the foreach one.

Prints one line per check and exits 1 on any failure.
"""
from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from dmuon.kernels.interpreter import install_interpreter_shims  # noqa: E402

install_interpreter_shims()

from dmuon.kernels import scale_cast, syrk  # noqa: E402
from dmuon.kernels.syrk_tma import sym_abt_tma  # noqa: E402

FAILED: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'OK  ' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        FAILED.append(name)


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).norm() / ref.norm())


def operands(bsz: int, m: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(bsz, m, k, generator=g, dtype=torch.float64) / k ** 0.5
    gm = x @ x.mT
    p, q = gm + 0.5 * gm @ gm, 1.5 * gm - 0.3 * gm @ gm
    c = torch.randn(bsz, m, m, generator=g, dtype=torch.float64)
    return x, (p + p.mT) / 2, (q + q.mT) / 2, (c + c.mT) / 2


def check_triangle(name: str, fn, bsz: int, m: int, k: int, transposed: bool) -> None:
    x, p, q, c = operands(bsz, m, k, seed=m + k)
    bf = torch.bfloat16
    a = x.mT.contiguous().to(bf).mT if transposed else x.to(bf)
    ad, c16 = a.double(), c.to(bf)
    eye = torch.eye(m, dtype=torch.float64)
    out = fn(a, alpha=0.7, beta=-0.4, c=c16, gamma=1.3)
    ref = 0.7 * ad @ ad.mT - 0.4 * c16.double() + 1.3 * eye
    check(f"{name} a a^T + c + I {bsz}x{m}x{k}{' T' if transposed else ''}",
          torch.equal(out, out.mT) and rel(out, ref) < 1e-2, f"err {rel(out, ref):.2e}")
    p16, q16 = p.to(bf), q.to(bf)
    out = fn(p16, q16, alpha=0.5, beta=2.0, c=c16)
    ref = 0.5 * p16.double() @ q16.double() + 2.0 * c16.double()
    check(f"{name} a b + c {bsz}x{m}x{m}", torch.equal(out, out.mT) and rel(out, ref) < 1e-2,
          f"err {rel(out, ref):.2e} symmetric {torch.equal(out, out.mT)}")


def check_muon_elementwise() -> None:
    from dmuon.functional import muon
    from dmuon.kernels import muon_elementwise

    ew = muon_elementwise.fused_elementwise()
    g = torch.Generator().manual_seed(3)
    b, gr, p, u = (torch.randn(5003, generator=g) for _ in range(4))  # not a multiple of BLOCK
    mu, decay, alpha = 0.95, 1 - 0.02 * 0.1, -0.37
    b_ref = mu * b.double() + gr.double()
    x_ref = gr.double() + mu * b_ref
    b1, g1, x1 = b.clone(), gr.clone(), torch.full_like(gr, float("nan"))
    ew.momentum([b1], [g1], [x1], mu)
    b2, g2 = b.clone(), gr.clone()
    ew.momentum([b2], [g2], [g2], mu)  # the Nesterov input in the gradient's storage
    check("muon momentum + nesterov (fp32, vs fp64)",
          rel(b1, b_ref) < 1e-6 and rel(x1, x_ref) < 1e-6 and torch.equal(g1, gr)
          and torch.equal(b2, b1) and torch.equal(g2, x1), f"err {rel(x1, x_ref):.2e}")
    p1 = p.clone()
    ew.apply([p1], [u], decay, [alpha])
    p_ref = p.double() * decay + alpha * u.double()
    check("muon apply (fp32, vs fp64)", rel(p1, p_ref) < 1e-6, f"err {rel(p1, p_ref):.2e}")
    check("the kernels' in-place writes bump the version counters (a failed step's retry check)",
          b1._version > 0 and x1._version > 0 and p1._version > 0,
          f"versions {b1._version}, {x1._version}, {p1._version}")
    t64 = [t.double() for t in (b, gr, p, u)]
    f64, r64 = [t.clone() for t in t64], [t.clone() for t in t64]
    ew.momentum([f64[0]], [f64[1]], [f64[1]], mu)
    ew.apply([f64[2]], [f64[3]], decay, [alpha])
    muon.foreach_momentum_([r64[0]], [r64[1]], [r64[1]], mu)
    muon.foreach_apply_([r64[2]], [r64[3]], decay, [alpha])
    check("muon stages fall back to foreach (fp64, bitwise)",
          all(torch.equal(x, y) for x, y in zip(f64, r64)))
    hp = muon.MuonHParams(lr=0.03, weight_decay=0.1)
    out = {}
    for name, e in (("fused", ew), ("foreach", None)):
        params = {"w": torch.randn(48, 40, generator=torch.Generator().manual_seed(4)),
                  "e": torch.randn(3, 16, 24, generator=torch.Generator().manual_seed(5))}
        state = muon.init(params)
        for step in range(3):
            gen = torch.Generator().manual_seed(10 + step)
            grads = {n: torch.randn(t.shape, generator=gen) for n, t in params.items()}
            params, state = muon.update(grads, state, params, hp, batch_dims={"e": 1},
                                        donate=True, donate_grads=True, elementwise=e,
                                        orthogonalize=lambda xs: [x.mul(0.5).tanh() for x in xs])
        out[name] = params
    err = max(rel(out["fused"][n], out["foreach"][n].double()) for n in out["fused"])
    check("muon.update with the fused stages (fp32, vs foreach)", err < 1e-6, f"err {err:.2e}")


def main() -> int:
    def old(a, b=None, **kw):
        return syrk.sym_abt_triton(a, b, **kw)
    check_triangle("pointer kernel", old, 2, 256, 128, transposed=False)
    check_triangle("pointer kernel", old, 2, 200, 136, transposed=True)
    for cfg in ("p128x128", "p128x256", "p128x256_flat"):
        def tma(a, b=None, _cfg=cfg, **kw):
            return sym_abt_tma(a, b, config=_cfg, **kw)
        check_triangle(f"tma {cfg}", tma, 2, 256, 128, transposed=False)
        check_triangle(f"tma {cfg}", tma, 1, 256, 192, transposed=True)
    g = torch.Generator().manual_seed(1)
    src = torch.randn(3, 5000, generator=g) * 7
    den = torch.linalg.vector_norm(src, dim=-1, keepdim=True).add_(1e-7)
    grid = (-(-5000 // scale_cast._BLOCK), 3)
    d32 = torch.empty(3, 5000)
    scale_cast._scale_cast_kernel[grid](src, d32, den.reshape(3), 5000, HAS_DENOM=True,
                                        BLOCK=scale_cast._BLOCK)
    check("scale_cast divide (fp32 out, bitwise)", torch.equal(d32, torch.div(src, den)))
    # The interpreter truncates fp32 -> bf16 (the GPU rounds to nearest even, bitwise equal to
    # torch there: tests/test_ns_gpu.py), so bf16 is checked to one ulp here.
    dst = torch.empty(3, 5000, dtype=torch.bfloat16)
    scale_cast._scale_cast_kernel[grid](src, dst, den.reshape(3), 5000, HAS_DENOM=True,
                                        BLOCK=scale_cast._BLOCK)
    ref = torch.div(src, den).to(torch.bfloat16).float()
    ulp = (dst.float() - ref).abs() / ref.abs().clamp_min(1e-30)
    check("scale_cast divide + bf16 cast (1 ulp)", bool((ulp <= 2.0 ** -7).all()),
          f"max {ulp.max().item():.2e}")
    back = torch.empty(3, 5000)
    scale_cast._scale_cast_kernel[grid](dst, back, back, 5000, HAS_DENOM=False,
                                        BLOCK=scale_cast._BLOCK)
    check("scale_cast cast", torch.equal(back, dst.float()))
    check_muon_elementwise()
    print(f"{len(FAILED)} failed", flush=True)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
