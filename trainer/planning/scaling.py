"""How big and how long: compute-optimal sizes, and the time a run takes on named chips.

A scaling law in Hoffmann et al.'s (2022, "Training Compute-Optimal Large
Language Models") parametric form, L(N, D) = E + A / N^alpha + B / D^beta, for
N parameters trained on D tokens. `CHINCHILLA` is their published fit (their
eq. 10, Approach 3); trainer/planning/scaling_fit.py fits one to your own runs.

Minimising L under C = 6 N D gives N_opt = G (C/6)^a and D_opt = (C/6)^b / G,
with a = beta / (alpha + beta), b = alpha / (alpha + beta) and
G = (alpha A / (beta B))^(1 / (alpha + beta)). When a token costs more than
6 N FLOPs (attention at long sequences, small models), `Law.best_split` finds
the optimum for a given FLOPs-per-token function numerically.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from parallelism.chips import CHIPS

TOKENS_PER_PARAM = 20


@dataclasses.dataclass(frozen=True)
class Law:
    E: float
    A: float
    B: float
    alpha: float
    beta: float

    def loss(self, n_params, tokens):
        """Predicted loss (nats per token) for N parameters trained on D tokens; arrays broadcast."""
        return self.E + self.A / np.power(n_params, self.alpha) + self.B / np.power(tokens, self.beta)

    def optimum(self, flops: float) -> dict[str, float]:
        """The compute-optimal N and D for a budget of `flops` under C = 6 N D (closed form)."""
        alpha, beta = self.alpha, self.beta
        g = (alpha * self.A / (beta * self.B)) ** (1 / (alpha + beta))
        n = g * (flops / 6) ** (beta / (alpha + beta))
        d = (flops / 6) ** (alpha / (alpha + beta)) / g
        return {"n_params": n, "tokens": d, "loss": float(self.loss(n, d))}

    def best_split(self, flops: float, flops_per_token: Callable, lo: float = 1e3, hi: float = 1e13) -> dict:
        """The optimum when a token costs `flops_per_token(N)` FLOPs: the least loss over a fine grid of N."""
        n = np.geomspace(lo, hi, 4001)
        d = flops / flops_per_token(n)
        losses = self.loss(n, d)
        best = int(np.argmin(losses))
        return {"n_params": float(n[best]), "tokens": float(d[best]), "loss": float(losses[best])}


CHINCHILLA = Law(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)


def rule_of_thumb_optimum(flops: float) -> dict[str, float]:
    """20 tokens per parameter under C = 6 N D: N = sqrt(C / 120)."""
    n = math.sqrt(flops / (6 * TOKENS_PER_PARAM))
    return {"n_params": n, "tokens": TOKENS_PER_PARAM * n}


def seconds_to_train(flops: float, chip: str, chips: int, mfu: float) -> float:
    return flops / (CHIPS[chip].peak_flops * chips * mfu)
