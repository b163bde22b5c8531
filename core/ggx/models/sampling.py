"""Choosing the next token from a row of logits: greedy at temperature 0, else top-k / top-p sampling."""
from __future__ import annotations

import math
from numbers import Integral, Real

import numpy as np

from ..errors import GGXValueError


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """Refuse settings that would sample garbage: NaN or negative temperature, negative top_k,
    top_p outside [0, 1] (llama.cpp's ranges; temperature 0 is greedy, top_k 0 keeps every token)."""
    if not (isinstance(temperature, Real) and math.isfinite(temperature) and temperature >= 0):
        raise GGXValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if not isinstance(top_k, Integral) or top_k < 0:
        raise GGXValueError(f"top_k must be an integer >= 0, got {top_k!r}")
    if not (isinstance(top_p, Real) and 0.0 <= top_p <= 1.0):
        raise GGXValueError(f"top_p must be in [0, 1], got {top_p!r}")


def sample(logits: np.ndarray, temperature: float = 0.0, top_k: int = 40, top_p: float = 0.95,
           rng: np.random.Generator | None = None) -> int:
    """One token id from float logits [n_vocab] (llama.cpp's default chain: top-k, top-p, temperature)."""
    check_sampling(temperature, top_k, top_p)
    if np.isnan(logits).any():
        raise GGXValueError(f"the logits hold {int(np.isnan(logits).sum())} NaN values: no token can be chosen")
    if temperature == 0.0:
        return int(np.argmax(logits))
    rng = rng or np.random.default_rng()
    x = logits.astype(np.float64)
    k = min(top_k, x.size) if top_k > 0 else x.size
    cand = np.argpartition(-x, k - 1)[:k]
    cand = cand[np.argsort(-x[cand], kind="stable")]
    if not math.isfinite(x[cand[0]]):
        raise GGXValueError(f"the largest logit is {x[cand[0]]}: no distribution to sample from")
    p = np.exp((x[cand] - x[cand[0]]) / temperature)
    p /= p.sum()
    if top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(p), top_p) + 1)
        cand, p = cand[:keep], p[:keep] / p[:keep].sum()
    return int(rng.choice(cand, p=p))
