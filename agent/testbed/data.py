"""Synthetic training text: a fixed, sparse, higher-order Markov chain over a small vocabulary.

The chain is built once from ``seed`` in two levels, so that it can be learned step by step:

- every token ``b`` owns a pool of ``pool`` candidate successors (a random subset of the
  vocabulary): the last token alone narrows the next one from ``vocab`` to ``pool`` choices
  (a bigram model reaches about ln(pool) nats quickly);
- every context of the last ``order`` tokens picks ``branching`` of the last token's pool with
  Dirichlet(``concentration``) probabilities: the earlier tokens (reached through attention)
  bring the loss further down towards the chain's entropy rate (``entropy_floor``, nats).

The second level is a large table (vocab**order contexts), so the loss keeps falling for
thousands of steps. No downloads; fully deterministic given the seed and the generator.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


class MarkovSource:
    """A stationary order-``order`` Markov chain over ``vocab`` tokens, built from ``seed``."""

    def __init__(
        self,
        vocab: int,
        seed: int,
        *,
        order: int = 2,
        pool: int = 16,
        branching: int = 4,
        concentration: float = 0.5,
    ) -> None:
        if vocab < 2:
            raise ValueError(f"MarkovSource: vocab must be >= 2, got {vocab}")
        if order < 1:
            raise ValueError(f"MarkovSource: order must be >= 1, got {order}")
        if not 1 <= pool <= vocab:
            raise ValueError(f"MarkovSource: pool must be in 1..vocab, got {pool}")
        if not 1 <= branching <= pool:
            raise ValueError(f"MarkovSource: branching must be in 1..pool, got {branching}")
        if concentration <= 0:
            raise ValueError(f"MarkovSource: concentration must be > 0, got {concentration}")
        if vocab**order > 2**22:
            raise ValueError(
                f"MarkovSource: vocab**order = {vocab**order} contexts is too large (max 2**22)"
            )
        self.vocab = vocab
        self.order = order
        self.pool = pool
        self.branching = branching
        rng = np.random.default_rng(seed)
        n_contexts = vocab**order
        # Each token's pool of candidate successors: (vocab, pool), distinct within a row.
        pools = np.argpartition(rng.random((vocab, vocab)), pool - 1, axis=1)[:, :pool]
        # Each context picks `branching` distinct members of its last token's pool.
        picks = np.argpartition(rng.random((n_contexts, pool)), branching - 1, axis=1)
        last_token = np.arange(n_contexts) % vocab  # contexts are numbered base vocab, last digit
        successors = np.take_along_axis(pools[last_token], picks[:, :branching], axis=1)
        probs = rng.dirichlet(np.full(branching, concentration), size=n_contexts)
        probs = np.maximum(probs, 1e-12)
        probs /= probs.sum(axis=1, keepdims=True)
        self._successors = torch.from_numpy(successors.astype(np.int64))  # (C, branching)
        cdf = np.cumsum(probs, axis=1)
        cdf[:, -1] = 1.0
        self._cdf = torch.from_numpy(cdf.astype(np.float64))  # (C, branching)
        # Mean per-context entropy (nats): the loss floor of a perfect model, up to the
        # difference between the uniform and the stationary weighting of contexts.
        self.entropy_floor = float(np.mean(-np.sum(probs * np.log(probs), axis=1)))
        self._radix = torch.tensor([vocab**i for i in reversed(range(order))], dtype=torch.int64)

    def batch(self, batch_size: int, seq_len: int, generator: torch.Generator) -> Tensor:
        """``batch_size`` independent sequences of ``seq_len + 1`` tokens: (B, T+1) int64.

        Each sequence starts from ``order`` uniform random tokens (the chain then runs from
        there); inputs are ``x[:, :-1]``, targets ``x[:, 1:]``.
        """
        if batch_size < 1 or seq_len < 1:
            raise ValueError(
                f"MarkovSource.batch: batch_size and seq_len must be >= 1, "
                f"got {batch_size}, {seq_len}"
            )
        total = seq_len + 1
        out = torch.empty(batch_size, max(total, self.order), dtype=torch.int64)
        out[:, : self.order] = torch.randint(
            0, self.vocab, (batch_size, self.order), generator=generator
        )
        # (T+1, B, 1): one uniform per drawn token, contiguous per position for searchsorted.
        uniforms = torch.rand(out.shape[1], batch_size, 1, generator=generator, dtype=torch.float64)
        for t in range(self.order, out.shape[1]):
            context = (out[:, t - self.order : t] * self._radix).sum(dim=1)  # (B,)
            cdf = self._cdf[context]  # (B, branching)
            choice = torch.searchsorted(cdf, uniforms[t]).clamp_(max=self.branching - 1)
            out[:, t] = self._successors[context].gather(1, choice).squeeze(1)
        return out[:, :total]
