"""How big and how long: Chinchilla-optimal sizes and the time a run takes on named chips.

Two readings of Hoffmann et al. (2022), "Training Compute-Optimal Large
Language Models":

- the rule of thumb, about 20 training tokens per parameter;
- the parametric fit of their Approach 3, L(N, D) = E + A / N^alpha + B / D^beta
  with E = 1.69, A = 406.4, B = 410.7, alpha = 0.34, beta = 0.28 (their eq. 10).
  Minimising it under C = 6 N D gives N_opt = G (C/6)^a and D_opt = (C/6)^b / G
  with a = beta / (alpha + beta), b = alpha / (alpha + beta) and
  G = (alpha A / (beta B))^(1 / (alpha + beta)).
"""

from __future__ import annotations

import math

from trainer.flops import CHIPS

TOKENS_PER_PARAM = 20
FIT = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}


def fit_loss(n_params: float, tokens: float) -> float:
    """The fit's predicted loss (nats per token, on their data) for N parameters and D tokens."""
    return FIT["E"] + FIT["A"] / n_params ** FIT["alpha"] + FIT["B"] / tokens ** FIT["beta"]


def fit_optimum(flops: float) -> dict[str, float]:
    """The fit's compute-optimal parameters and tokens for a budget of `flops` (C = 6 N D)."""
    alpha, beta = FIT["alpha"], FIT["beta"]
    g = (alpha * FIT["A"] / (beta * FIT["B"])) ** (1 / (alpha + beta))
    n = g * (flops / 6) ** (beta / (alpha + beta))
    d = (flops / 6) ** (alpha / (alpha + beta)) / g
    return {"n_params": n, "tokens": d, "loss": fit_loss(n, d)}


def rule_of_thumb_optimum(flops: float) -> dict[str, float]:
    """20 tokens per parameter under C = 6 N D: N = sqrt(C / 120)."""
    n = math.sqrt(flops / (6 * TOKENS_PER_PARAM))
    return {"n_params": n, "tokens": TOKENS_PER_PARAM * n}


def seconds_to_train(flops: float, chip: str, chips: int, mfu: float) -> float:
    return flops / (CHIPS[chip][1] * chips * mfu)
