"""The demo's task: next-token prediction on a fixed random Markov source with a known loss floor.

A :class:`MarkovSource` of order ``k`` (1 or 2) over ``V`` tokens is a table
``P[c, x] = Pr(X_t = x | (X_{t-k}, ..., X_{t-1}) = c)`` with one row per context ``c``
(``V**k`` rows; a context is encoded as the integer ``sum_i X_{t-k+i} * V**(k-1-i)``). Rows are
*sparse-ish*: each context has ``branching`` random successors with Dirichlet(1) weights, mixed with
a little uniform mass ``smoothing`` so the chain is irreducible and aperiodic (hence has a unique
stationary distribution and every sequence has finite loss).

Loss floor. For a stationary source the best achievable expected cross-entropy of predicting
``X_t`` from all of its past is the entropy rate

    H = sum_c pi(c) * H(P[c, :]) = - sum_c pi(c) sum_x P[c, x] log P[c, x]      (nats)

where ``pi`` is the stationary distribution over contexts (Cover & Thomas, *Elements of
Information Theory*, Thm. 4.2.4). Sequences are drawn with their first ``k`` tokens from ``pi``,
so every later position is stationary; the demo scores only predictions of positions ``>= k``
(whose context is complete), and the expected loss of the Bayes-optimal predictor is exactly
``H``. :func:`entropy_rate` computes ``pi`` by power iteration in fp64 to a stated tolerance.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["MarkovSource", "make_source", "entropy_rate", "stationary_distribution", "uniform_loss"]


@dataclass(frozen=True)
class MarkovSource:
    """A fixed order-``order`` Markov source over ``vocab`` tokens.

    Attributes:
      vocab: number of tokens ``V``.
      order: Markov order ``k`` (1 or 2).
      probs: ``(V**k, V)`` fp64 transition table; row ``c`` is the next-token law after context ``c``.
      seed: the seed it was built from (for the record).
    """

    vocab: int
    order: int
    probs: Tensor
    seed: int

    @functools.cached_property
    def stationary(self) -> Tensor:
        """Stationary law over contexts (computed once; see :func:`stationary_distribution`)."""
        return stationary_distribution(self)

    def context_index(self, ctx: Tensor) -> Tensor:
        """Encode contexts ``(..., k)`` of token ids as row indices ``(...)`` into ``probs``."""
        idx = torch.zeros(ctx.shape[:-1], dtype=torch.long, device=ctx.device)
        for i in range(self.order):
            idx = idx * self.vocab + ctx[..., i].long()
        return idx

    def sample(self, batch: int, length: int, generator: torch.Generator) -> Tensor:
        """Draw ``batch`` sequences of ``length`` tokens (int64, CPU), first ``k`` from ``pi``.

        Deterministic given the generator's state. ``length`` must exceed the order.
        """
        k, V = self.order, self.vocab
        if length <= k:
            raise ValueError(f"sequence length {length} must exceed the Markov order {k}")
        pi = self.stationary
        start = torch.multinomial(pi.float(), batch, replacement=True, generator=generator)
        out = torch.empty(batch, length, dtype=torch.long)
        for i in range(k):  # decode the start context into its k tokens
            out[:, i] = (start // V ** (k - 1 - i)) % V
        cdf = torch.cumsum(self.probs, dim=1)
        cdf[:, -1] = 1.0
        u = torch.rand(batch, length - k, dtype=torch.float64, generator=generator)
        for t in range(k, length):
            rows = cdf[self.context_index(out[:, t - k:t])]
            nxt = torch.searchsorted(rows, u[:, t - k:t - k + 1].contiguous(), right=True)
            out[:, t] = nxt.squeeze(1).clamp_(max=V - 1)
        return out

    def log_prob(self, seqs: Tensor) -> Tensor:
        """``log P(x_t | context)`` for every scored position ``t >= k``: shape ``(B, L - k)``."""
        k = self.order
        ctx = torch.stack([seqs[:, i:seqs.shape[1] - k + i] for i in range(k)], dim=-1)
        rows = self.probs[self.context_index(ctx)]
        return torch.log(torch.gather(rows, -1, seqs[:, k:, None]).squeeze(-1))


def make_source(vocab: int = 64, order: int = 2, *, branching: int = 4, smoothing: float = 0.02,
                seed: int = 0) -> MarkovSource:
    """Build a random sparse-ish Markov source (deterministic in ``seed``).

    Args:
      vocab: number of tokens ``V`` (>= 2).
      order: Markov order, 1 or 2.
      branching: successors per context that get Dirichlet(1) weight (1 <= branching <= V).
      smoothing: uniform mass mixed into every row, in (0, 1): ``P = (1-s) * sparse + s / V``.
      seed: seed of the table.

    Returns:
      The :class:`MarkovSource`.
    """
    if vocab < 2:
        raise ValueError(f"vocab must be >= 2, got {vocab}")
    if order not in (1, 2):
        raise ValueError(f"order must be 1 or 2, got {order}")
    if not 1 <= branching <= vocab:
        raise ValueError(f"branching must be in [1, vocab={vocab}], got {branching}")
    if not 0.0 < smoothing < 1.0:
        raise ValueError(f"smoothing must be in (0, 1) so the chain is ergodic, got {smoothing}")
    g = torch.Generator().manual_seed(seed)
    rows = vocab ** order
    succ = torch.rand(rows, vocab, generator=g).argsort(dim=1)[:, :branching]
    # Dirichlet(1, ..., 1) weights: normalized standard exponentials
    weights = -torch.log1p(-torch.rand(rows, branching, dtype=torch.float64, generator=g))
    weights = weights / weights.sum(dim=1, keepdim=True)
    sparse = torch.zeros(rows, vocab, dtype=torch.float64)
    sparse.scatter_(1, succ, weights)
    probs = (1.0 - smoothing) * sparse + smoothing / vocab
    probs = probs / probs.sum(dim=1, keepdim=True)
    return MarkovSource(vocab=vocab, order=order, probs=probs, seed=seed)


def stationary_distribution(src: MarkovSource, *, tol: float = 1e-14,
                            max_iters: int = 100_000) -> Tensor:
    """Stationary law ``pi`` over the ``V**k`` contexts (fp64, sums to 1) by power iteration.

    The context chain moves ``(x_1..x_k) -> (x_2..x_k, x)`` with probability ``P[c, x]``, so one
    step is ``pi'[(x_2..x_k, x)] = sum_{x_1} pi[(x_1..x_k)] P[(x_1..x_k), x]``. Iterates from the
    uniform law until the L1 change is below ``tol``.

    Raises:
      RuntimeError: no convergence in ``max_iters`` steps.
    """
    V, k = src.vocab, src.order
    P = src.probs
    pi = torch.full((V ** k,), 1.0 / V ** k, dtype=torch.float64)
    for _ in range(max_iters):
        if k == 1:
            new = pi @ P
        else:
            # pi as (x1, x2); new[x2, x] = sum_x1 pi[x1, x2] P[(x1, x2), x]
            joint = pi.view(V, V, 1) * P.view(V, V, V)
            new = joint.sum(dim=0).reshape(-1)
        new = new / new.sum()
        delta = float((new - pi).abs().sum())
        pi = new
        if delta < tol:
            return pi
    raise RuntimeError(f"stationary distribution did not converge in {max_iters} iterations "
                       f"(last L1 change {delta:.3e}); increase smoothing")


def entropy_rate(src: MarkovSource) -> float:
    """Entropy rate ``H = sum_c pi(c) H(P[c, :])`` in nats: the demo's loss floor."""
    pi = src.stationary
    P = src.probs
    row_h = -(P * torch.log(P)).sum(dim=1)   # rows are strictly positive (smoothing > 0)
    return float((pi * row_h).sum())


def uniform_loss(vocab: int) -> float:
    """Loss of the uniform predictor, ``log V`` nats (where training starts, roughly)."""
    return math.log(vocab)
