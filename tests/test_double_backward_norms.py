"""A double backward through FSDP2's own norm weights (issue 46): an R1 / WGAN-GP gradient penalty
(``g = autograd.grad(D(x).sum(), x, create_graph=True)``, then ``(loss + penalty).backward()``)
through blocks with a LayerNorm or an RMSNorm, ZeRO-2 and ZeRO-3. Before: both ranks died with
SIGSEGV in the second backward (torch's norm double backward read the weight FSDP2 had freed after
the first). Now dmuon keeps FSDP2's params gathered through a ``create_graph`` backward, as its
own copies, and equals one process; FSDP2's documented toggle (``set_reshard_after_backward(False)``
for the first pass only) still does too.

The ranks run in spawned processes (``run_ranks``): a crash fails the test, not pytest."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from user_paths_harness import TOL, RefMuon

DIM, STEPS, BATCH, WORLD = 8, 3, 4, 2
NORMS = {"layernorm": torch.nn.LayerNorm, "rmsnorm": torch.nn.RMSNorm}
# variant: (norm, ZeRO-3, the user toggles FSDP2's reshard_after_backward around the first pass)
VARIANTS = {f"{norm}_{z}{'_toggle' if toggle else ''}": (norm, z == "z3", toggle)
            for norm in NORMS for z in ("z2", "z3") for toggle in (False, True)}


class _Block(torch.nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.norm = NORMS[norm](DIM)
        self.up_proj = torch.nn.Linear(DIM, DIM)

    def forward(self, x):
        return x + torch.tanh(self.up_proj(self.norm(x)))


class Disc(torch.nn.Module):
    """A GAN discriminator: normed ``layers.N`` blocks (``up_proj``: Muon) and a linear head."""

    def __init__(self, norm):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Block(norm) for _ in range(2))
        self.head = torch.nn.Linear(DIM, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _muon_matrix(n, p):
    return p.ndim == 2 and "up_proj" in n


def _make(norm):
    torch.manual_seed(2)
    model = Disc(norm).double()
    with torch.no_grad():  # norm weights away from 1 (their double backward terms count)
        for layer in model.layers:
            layer.norm.weight.uniform_(0.5, 1.5)
    return model


def _r1_loop(model, opt, rank, dist, toggle):
    keep = model.set_reshard_after_backward if dist and toggle else (lambda flag: None)
    gen = torch.Generator().manual_seed(5)
    for _ in range(STEPS):
        real = torch.randn(BATCH, DIM, generator=gen, dtype=torch.float64)
        opt.zero_grad()
        for r in ([rank] if dist else range(WORLD)):
            x = real.chunk(WORLD)[r].clone().requires_grad_(True)
            out = model(x)
            keep(False)
            (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
            loss = F.softplus(-out).mean() + 5.0 * g.pow(2).sum(-1).mean()
            keep(True)
            (loss if dist else loss / WORLD).backward()
        opt.step()


#: the default tier's variants (one spawn); the slow tier runs every variant
FAST = ("layernorm_z3", "rmsnorm_z2", "layernorm_z2_toggle")


def _worker(rank, world, keys):
    import dmuon
    from stateful_harness import HP
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    out = {}
    for key in keys:
        norm, z3, toggle = VARIANTS[key]
        model = _make(norm)
        mesh = init_device_mesh("cpu", (world,))
        dmuon.dedicate_params(model, mesh, _muon_matrix, reshard_after_forward=z3)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=z3)
        fully_shard(model, mesh=mesh)
        opt = dmuon.Muon(model, lr=HP["lr"], momentum=HP["momentum"], nesterov=HP["nesterov"],
                         weight_decay=HP["weight_decay"], ns_steps=HP["ns_steps"],
                         ns_dtype=torch.float64, adamw_lr=HP["adamw_lr"],
                         adamw_betas=HP["adamw_betas"], adamw_eps=HP["adamw_eps"],
                         adamw_weight_decay=HP["adamw_weight_decay"])
        _r1_loop(model, opt, rank, True, toggle)
        out[key] = dmuon.get_model_state_dict(model)
    return out


@functools.lru_cache(maxsize=2)
def _results(fast):
    return run_ranks(_worker, WORLD, [k for k in VARIANTS if (k in FAST) == fast], timeout=120)


@pytest.mark.parametrize("key", [k if k in FAST else pytest.param(k, marks=pytest.mark.slow)
                                 for k in VARIANTS])
def test_gradient_penalty_through_norms_equals_one_process(key):
    norm, _, toggle = VARIANTS[key]
    model = _make(norm)
    _r1_loop(model, RefMuon(model, _muon_matrix), 0, False, toggle)
    ref = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for rank, got in enumerate(_results(key in FAST)):
        assert set(got[key]) == set(ref), key
        worst = max(float((got[key][k] - v).abs().max()) for k, v in ref.items())
        assert worst <= TOL, f"{key} rank {rank}: max abs diff {worst:.3g}"
