"""The project's model criteria for two runs' teacher-forced logits (docs/architecture.md,
"Agreement with llama.cpp"): over the first run's top 10 ids at each position, max |diff| <= 1.0
and mean |diff| <= 0.25, and the same argmax wherever the first run's top-2 margin is >= 0.5.
Equal greedy text is not a criterion: two correct backends part at the first near-tie.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

TOP = 10
MAX_ABS = 1.0
MEAN_ABS = 0.25
MIN_MARGIN = 0.5


@dataclass(frozen=True)
class LogitsRow:
    """One position's logits of run A against run B."""

    step: int  # 0: the prompt, then each decode step
    position: int  # the token's position in the sequence
    max_abs: float  # over A's top TOP ids
    mean_abs: float
    argmax_a: int
    argmax_b: int
    margin_a: float  # A's top-1 minus top-2 logit

    @property
    def argmax_checked(self) -> bool:
        return self.margin_a >= MIN_MARGIN

    @property
    def ok(self) -> bool:
        close = self.max_abs <= MAX_ABS and self.mean_abs <= MEAN_ABS
        return close and (not self.argmax_checked or self.argmax_a == self.argmax_b)

    def problem(self) -> str:
        """Why the row fails ("" when it passes)."""
        why = []
        if self.max_abs > MAX_ABS:
            why.append(f"max |diff| {self.max_abs:.3g} > {MAX_ABS:g}")
        if self.mean_abs > MEAN_ABS:
            why.append(f"mean |diff| {self.mean_abs:.3g} > {MEAN_ABS:g}")
        if self.argmax_checked and self.argmax_a != self.argmax_b:
            why.append(f"argmax {self.argmax_b} != {self.argmax_a} at margin {self.margin_a:.3g}")
        return "; ".join(why)

    def to_dict(self) -> dict:
        return asdict(self) | {"ok": self.ok}


def logits_rows(a: np.ndarray, b: np.ndarray, step: int, first_position: int) -> list[LogitsRow]:
    """Rows [n, n_vocab] of A and B at positions first_position, first_position + 1, ..."""
    a64 = np.asarray(a, np.float64).reshape(-1, a.shape[-1])
    b64 = np.asarray(b, np.float64).reshape(a64.shape)
    rows = []
    for i, (ra, rb) in enumerate(zip(a64, b64)):
        top = np.argpartition(-ra, TOP)[:TOP] if ra.size > TOP else np.arange(ra.size)
        diff = np.abs(ra[top] - rb[top])
        best2 = np.sort(ra[top])[-2:] if top.size > 1 else np.array([0.0, ra[top][0]])
        rows.append(LogitsRow(step, first_position + i, float(diff.max()), float(diff.mean()), int(ra.argmax()),
                              int(rb.argmax()), float(best2[-1] - best2[0])))
    return rows
