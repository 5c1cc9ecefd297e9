"""How close dmuon's Muon is to ``torch.optim.Muon``, and what bf16 Newton–Schulz costs in accuracy.

    python examples/compare_torch_muon.py

Prints three measurements (CPU, seeded, a few seconds) that the README quotes:

1. weights after 10 steps of ``torch.optim.Muon`` (as shipped: its NS casts to bf16) vs the
   functional ``dmuon.functional.muon`` with the same convention (Jordan's coefficients,
   ``lr_scale="moonlight"`` (``dmuon.Muon``'s ``adjust_lr_fn="match_rms_adamw"``, torch's name),
   Nesterov, weight decay),
   NS in bf16 and in fp64: max |difference| / max |weights moved|;
2. the same with torch's NS run in fp64 (its ``_zeropower_via_newtonschulz`` replaced, for this
   measurement only, by dmuon's fp64 direct NS with torch's coefficients): what remains is the rest
   of the update rule (momentum, Nesterov, scaling, weight decay);
3. one NS call (5 Jordan steps) on random matrices: relative Frobenius error vs the fp64 direct
   iteration, for dmuon's bf16 Gram and bf16 direct variants and torch's bf16 NS.
"""
from __future__ import annotations

import contextlib

import torch
import torch.optim._muon as torch_muon

from dmuon.functional import muon
from dmuon.newton_schulz.iteration import newton_schulz

SHAPES = {"wide": (64, 160), "tall": (192, 48), "square": (96, 96)}
STEPS, LR, WD = 10, 0.02, 0.1


def _grads(params: dict, step: int) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    return {k: torch.randn(v.shape, generator=g, dtype=torch.float64).to(v.dtype) + 0.1 * v
            for k, v in params.items()}


@contextlib.contextmanager
def torch_ns_in_fp64():
    """Replace torch's bf16 NS by an fp64 direct NS with the same coefficients (then restore)."""
    orig = torch_muon._zeropower_via_newtonschulz

    def fp64(grad, ns_coefficients, ns_steps, eps):  # torch's iteration, without the bf16 cast
        a, b, c = ns_coefficients
        x = grad.double()
        x = x.T if grad.size(0) > grad.size(1) else x
        x = x / x.norm().clamp(min=eps)
        for _ in range(ns_steps):
            A = x @ x.T
            x = a * x + (b * A + c * A @ A) @ x
        return (x.T if grad.size(0) > grad.size(1) else x).to(grad.dtype)

    torch_muon._zeropower_via_newtonschulz = fp64
    try:
        yield
    finally:
        torch_muon._zeropower_via_newtonschulz = orig


def trajectories(dtype: torch.dtype, ns_dtype: torch.dtype, ns_eps: float = 1e-7) -> float:
    """max over matrices of |dmuon - torch| / |torch - start| after STEPS steps."""
    g = torch.Generator().manual_seed(0)
    start = {k: (0.1 * torch.randn(s, generator=g, dtype=torch.float64)).to(dtype)
             for k, s in SHAPES.items()}
    ref = {k: v.clone().requires_grad_(True) for k, v in start.items()}
    opt = torch.optim.Muon(list(ref.values()), lr=LR, weight_decay=WD, momentum=0.95,
                           nesterov=True, adjust_lr_fn="match_rms_adamw")
    hp = muon.MuonHParams(lr=LR, weight_decay=WD, momentum=0.95, nesterov=True,
                          ns_coefficients="jordan", lr_scale="moonlight", ns_dtype=ns_dtype,
                          ns_eps=ns_eps)
    params, state = {k: v.clone() for k, v in start.items()}, muon.init(start)
    for step in range(STEPS):
        for k, gr in _grads({k: p.detach() for k, p in ref.items()}, step).items():
            ref[k].grad = gr
        opt.step()
        params, state = muon.update(_grads(params, step), state, params, hp)
    return max(float((params[k] - ref[k].detach()).abs().max()
                     / (ref[k].detach() - start[k]).abs().max()) for k in SHAPES)


def ns_errors(shape: tuple[int, int], seed: int, coefficients: str) -> dict[str, float]:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    exact = newton_schulz(x, steps=5, coefficients=coefficients, dtype=torch.float64,
                          variant="direct")

    def rel(y: torch.Tensor) -> float:
        return float(torch.linalg.norm(y.double() - exact) / torch.linalg.norm(exact))

    coeffs = (3.4445, -4.7750, 2.0315)
    out = {f"dmuon bf16 {v}": rel(newton_schulz(x.float(), steps=5, coefficients=coefficients,
                                                 dtype=torch.bfloat16, variant=v))
           for v in ("gram", "direct")}
    if coefficients == "jordan":
        out["torch bf16"] = rel(torch_muon._zeropower_via_newtonschulz(x.float(), coeffs, 5, 1e-7))
    return out


def main() -> None:
    torch.manual_seed(0)
    print(f"1. after {STEPS} steps, max |dmuon - torch.optim.Muon| / max |moved| (fp32 weights):")
    print(f"   dmuon NS bf16: {trajectories(torch.float32, torch.bfloat16):.2e}   "
          f"dmuon NS fp64: {trajectories(torch.float32, torch.float64):.2e}")
    with torch_ns_in_fp64():
        print("2. torch's NS without its bf16 cast (fp64 weights): "
              f"{trajectories(torch.float64, torch.float64):.2e} "
              "(eps: x/(|x|+1e-7) here vs torch's x/max(|x|, 1e-7)); with ns_eps=0: "
              f"{trajectories(torch.float64, torch.float64, 0.0):.2e}")
    print("3. one NS call (5 steps), relative Frobenius error vs fp64 direct, 3 seeds:")
    for coefficients in ("jordan", "polar_express"):
        for shape in ((256, 1024), (1024, 256), (512, 4096), (384, 384)):
            errs = [ns_errors(shape, s, coefficients) for s in range(3)]
            line = ", ".join(f"{k} {min(e[k] for e in errs):.1e}-{max(e[k] for e in errs):.1e}"
                             for k in errs[0])
            print(f"   {coefficients} {shape[0]}x{shape[1]} "
                  f"(aspect {max(shape) / min(shape):.0f}): {line}")


if __name__ == "__main__":
    main()
