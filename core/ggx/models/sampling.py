"""Choosing the next token from a row of logits: greedy at temperature 0, else top-k / top-p sampling."""
from __future__ import annotations

import numpy as np


def sample(logits: np.ndarray, temperature: float = 0.0, top_k: int = 40, top_p: float = 0.95,
           rng: np.random.Generator | None = None) -> int:
    """One token id from float logits [n_vocab] (llama.cpp's default chain: top-k, top-p, temperature)."""
    if temperature <= 0.0:
        return int(np.argmax(logits))
    rng = rng or np.random.default_rng()
    x = logits.astype(np.float64)
    k = min(top_k, x.size) if top_k > 0 else x.size
    cand = np.argpartition(-x, k - 1)[:k]
    cand = cand[np.argsort(-x[cand], kind="stable")]
    p = np.exp((x[cand] - x[cand[0]]) / temperature)
    p /= p.sum()
    if top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(p), top_p) + 1)
        cand, p = cand[:keep], p[:keep] / p[:keep].sum()
    return int(rng.choice(cand, p=p))
