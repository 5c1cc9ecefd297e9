"""Train a small MLP with dmuon's functional Muon + AdamW: explicit state, a plain loop, CPU only.

    python examples/functional_muon.py

Matrices (ndim >= 2) get Muon, everything else (biases) gets AdamW. The task is synthetic and
learnable: regress the outputs of a fixed random "teacher" network. Exits non-zero if the loss did not
fall, so it doubles as a smoke test.
"""
import sys
import time

import torch
from torch import nn
from torch.func import functional_call

from dmuon.functional import adamw, muon


def main() -> int:
    torch.manual_seed(0)
    dim_in, hidden, dim_out, batch, steps = 32, 128, 8, 256, 200

    teacher = nn.Sequential(nn.Linear(dim_in, 64), nn.Tanh(), nn.Linear(64, dim_out))
    model = nn.Sequential(nn.Linear(dim_in, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                          nn.Linear(hidden, dim_out))

    # Params are a flat {name: tensor} dict, split by route; the optimizer state is ours to hold.
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    muon_names = [n for n, p in params.items() if p.ndim >= 2]
    adamw_names = [n for n, p in params.items() if p.ndim < 2]
    muon_hp = muon.MuonHParams(lr=0.02, weight_decay=0.01)
    adamw_hp = adamw.AdamWHParams(lr=3e-3, weight_decay=0.0)
    muon_state = muon.init({n: params[n] for n in muon_names})
    adamw_state = adamw.init({n: params[n] for n in adamw_names})

    def loss_fn(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(functional_call(model, p, (x,)), y)

    x_eval = torch.randn(1024, dim_in)
    with torch.no_grad():
        y_eval = teacher(x_eval)
    first = loss_fn(params, x_eval, y_eval).item()
    print(f"step   0  eval loss {first:.5f}")

    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        x = torch.randn(batch, dim_in)
        with torch.no_grad():
            y = teacher(x)
        leaves = {n: p.detach().requires_grad_(True) for n, p in params.items()}
        grads = dict(zip(leaves, torch.autograd.grad(loss_fn(leaves, x, y), list(leaves.values()))))
        with torch.no_grad():
            # donate=True: we never reuse the old params/state, so they are updated in place.
            new_m, muon_state = muon.update({n: grads[n] for n in muon_names}, muon_state,
                                            {n: params[n] for n in muon_names}, muon_hp, donate=True)
            new_a, adamw_state = adamw.update({n: grads[n] for n in adamw_names}, adamw_state,
                                              {n: params[n] for n in adamw_names}, adamw_hp,
                                              donate=True)
        params = {**new_m, **new_a}
        if step % 40 == 0:
            with torch.no_grad():
                print(f"step {step:3d}  eval loss {loss_fn(params, x_eval, y_eval).item():.5f}")

    with torch.no_grad():
        last = loss_fn(params, x_eval, y_eval).item()
    elapsed = time.perf_counter() - t0
    print(f"loss {first:.5f} -> {last:.5f} in {steps} steps, {elapsed:.1f} s")
    if not last < 0.2 * first:
        print("FAILED: the loss did not fall enough", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
