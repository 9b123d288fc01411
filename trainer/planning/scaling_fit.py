"""Fitting a scaling law to your own runs, the two ways Hoffmann et al. (2022) did.

Input: points (n_params N, tokens D, flops C, loss L), grouped into isoFLOP
budgets (the points of one budget share C).

- Approach 2 (isoFLOP profiles): per budget, a parabola of L in log10 N; its
  vertex is that budget's optimal N (and D = C / FLOPs-per-token there). Then
  N_opt = k_N C^a, D_opt = k_D C^b and L_min = k_L C^g by least squares in log
  space, over the budgets whose vertex lies within the sizes trained (all
  convex ones when fewer than two do).
- Approach 3 (parametric): L(N, D) = E + A / N^alpha + B / D^beta, written as
  exp(LSE(a - alpha log N, b - beta log D, e)) with A = e^a, B = e^b, E = e^e,
  fitted by minimising the Huber loss (delta 1e-3) of log L with L-BFGS from a
  grid of starting points, the best of which is kept; under C ~ N D its
  optimum grows as N_opt ~ C^(beta/(alpha+beta)), D_opt ~ C^(alpha/(alpha+beta)).

Intervals come from bootstrap resamples of the points (90%: 5th and 95th
percentiles). Approach 3 runs in float64 (`jax.enable_x64`): the Huber loss
works on residuals of a thousandth of a nat, near float32's resolution of log L.
"""

from __future__ import annotations

import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

from trainer.planning.scaling import Law

HUBER_DELTA = 1e-3
LBFGS_STEPS = 100
# Starting points for e, a, b, alpha, beta: a coarser version of Hoffmann et al.'s grid (their
# appendix D.2, 4,500 starts), 243 starts; on synthetic laws both grids find the same minimum.
START_GRID = ((-1.0, 0.0, 1.0), (0.0, 10.0, 20.0), (0.0, 10.0, 20.0), (0.0, 0.5, 1.0), (0.0, 0.5, 1.0))


def group_by_budget(flops: np.ndarray) -> list[np.ndarray]:
    """Indices of the points of each budget (FLOPs equal to 2 significant digits), smallest budget first."""
    keys = np.array([float(f"{c:.2g}") for c in flops])
    return [np.flatnonzero(keys == k) for k in np.unique(keys)]


def _power_law(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(exponent, coefficient) of y = coefficient * x^exponent, least squares in log space."""
    slope, intercept = np.polyfit(np.log(x), np.log(y), 1)
    return float(slope), float(np.exp(intercept))


def isoflop_minima(n, flops, loss, flops_per_token) -> list[dict]:
    """Per budget with three or more sizes: the parabola (in log10 N) and its vertex."""
    out = []
    for idx in group_by_budget(flops):
        x = np.log10(n[idx])
        if len(np.unique(x)) < 3:
            continue
        coeffs = np.polyfit(x, loss[idx], 2)
        c = float(np.median(flops[idx]))
        entry = {"flops": c, "coeffs": coeffs.tolist(), "points": len(idx), "convex": bool(coeffs[0] > 0)}
        if coeffs[0] > 0:
            x_min = -coeffs[1] / (2 * coeffs[0])
            n_opt = 10**x_min
            entry.update(n_params=float(n_opt), tokens=float(c / flops_per_token(n_opt)),
                         loss=float(np.polyval(coeffs, x_min)),
                         inside=bool(x.min() <= x_min <= x.max()))  # fmt: skip
        out.append(entry)
    return out


def approach2(n, flops, loss, flops_per_token) -> dict:
    """Optimal N, D and loss as power laws of C, from the isoFLOP parabolas' vertices."""
    minima = [m for m in isoflop_minima(n, flops, loss, flops_per_token) if m["convex"]]
    inside = [m for m in minima if m["inside"]]
    # A vertex beyond the sizes trained is an extrapolation: used only when too few budgets bracket theirs.
    used = inside if len(inside) >= 2 else minima
    if len(used) < 2:
        raise ValueError("approach 2 needs at least two budgets with three or more sizes and a convex profile")
    c = np.array([m["flops"] for m in used])
    a, k_n = _power_law(c, np.array([m["n_params"] for m in used]))
    b, k_d = _power_law(c, np.array([m["tokens"] for m in used]))
    g, k_l = _power_law(c, np.array([m["loss"] for m in used]))
    return {"a": a, "b": b, "k_n": k_n, "k_d": k_d, "g": g, "k_l": k_l, "minima": minima,
            "budgets_used": [m["flops"] for m in used]}  # fmt: skip


def approach2_predict(fit: dict, flops: float, flops_per_token) -> dict:
    n = fit["k_n"] * flops ** fit["a"]
    return {"n_params": n, "tokens": flops / flops_per_token(n), "loss": fit["k_l"] * flops ** fit["g"]}


def _objective(theta, log_n, log_d, log_loss, weights):
    e, a, b, alpha, beta = theta
    predicted = jax.nn.logsumexp(jnp.stack([a - alpha * log_n, b - beta * log_d, jnp.full_like(log_n, e)]), axis=0)
    return jnp.sum(weights * optax.losses.huber_loss(predicted, log_loss, delta=HUBER_DELTA))


@jax.jit
def _minimise(starts, log_n, log_d, log_loss, weights):
    """L-BFGS from each start (a row of `starts`) for each weighting (a row of `weights`): (thetas, objectives)."""
    solver = optax.lbfgs()

    def one(theta, w):
        f = lambda t: _objective(t, log_n, log_d, log_loss, w)
        value_and_grad = optax.value_and_grad_from_state(f)

        def body(carry, _):
            theta, state = carry
            value, grad = value_and_grad(theta, state=state)
            updates, state = solver.update(grad, state, theta, value=value, grad=grad, value_fn=f)
            return (optax.apply_updates(theta, updates), state), None

        (theta, _), _ = jax.lax.scan(body, (theta, solver.init(theta)), None, length=LBFGS_STEPS)
        return theta, f(theta)

    return jax.vmap(one)(starts, weights)


def _law(theta) -> Law:
    e, a, b, alpha, beta = (float(t) for t in theta)
    return Law(E=float(np.exp(e)), A=float(np.exp(a)), B=float(np.exp(b)), alpha=alpha, beta=beta)


def approach3(n, tokens, loss, weights=None, starts=None) -> tuple[Law, float]:
    """The law with the least Huber objective over the starting grid, and that objective."""
    starts = np.array(list(itertools.product(*START_GRID))) if starts is None else np.atleast_2d(starts)
    weights = np.ones(len(n)) if weights is None else weights
    with jax.enable_x64(True):
        data = [jnp.asarray(np.log(v), jnp.float64) for v in (n, tokens, loss)]
        rows_w = jnp.broadcast_to(jnp.asarray(weights, jnp.float64), (len(starts), len(n)))
        thetas, values = _minimise(jnp.asarray(starts, jnp.float64), *data, rows_w)
        thetas, values = np.asarray(thetas), np.asarray(values)
    values = np.where(np.isfinite(values), values, np.inf)
    best = int(np.argmin(values))
    return _law(thetas[best]), float(values[best])


def bootstrap(n, tokens, flops, loss, flops_per_token, full: Law, resamples: int = 200, seed: int = 0) -> dict:
    """90% intervals of a, b (approach 2) and alpha, beta, a, b (approach 3) over resampled points.

    Approach 2 resamples within each budget (so every budget keeps its size);
    approach 3 reweights the points by their resampled counts and starts
    L-BFGS from `full` (the fit to all points) and a coarse grid, all resamples in one vmap.
    """
    rng = np.random.default_rng(seed)
    groups = group_by_budget(flops)
    a2 = []
    for _ in range(resamples):
        idx = np.concatenate([rng.choice(g, len(g)) for g in groups])
        try:
            with warnings.catch_warnings():  # a resample may repeat one size: a poorly conditioned fit
                warnings.simplefilter("ignore")
                fit = approach2(n[idx], flops[idx], loss[idx], flops_per_token)
            a2.append((fit["a"], fit["b"]))
        except ValueError:
            continue  # a resample with no convex profile says nothing about the exponents
    full_theta = [np.log(full.E), np.log(full.A), np.log(full.B), full.alpha, full.beta]
    coarse = [[e, a, b, al, be] for e in (-0.5, 0.5) for a, b in ((5.0, 5.0), (15.0, 15.0)) for al, be in ((0.3, 0.3),)]
    starts = np.array([full_theta, *coarse])
    counts = np.stack([np.bincount(rng.integers(0, len(n), len(n)), minlength=len(n)) for _ in range(resamples)])
    a3 = []
    with jax.enable_x64(True):
        data = [jnp.asarray(np.log(v), jnp.float64) for v in (n, tokens, loss)]
        rows_s = jnp.asarray(np.repeat(starts[None], resamples, 0).reshape(-1, 5), jnp.float64)
        rows_w = jnp.asarray(np.repeat(counts, len(starts), 0), jnp.float64)
        thetas, values = (np.asarray(x) for x in _minimise(rows_s, *data, rows_w))
    thetas, values = thetas.reshape(resamples, len(starts), 5), values.reshape(resamples, len(starts))
    for t, v in zip(thetas, np.where(np.isfinite(values), values, np.inf), strict=True):
        alpha, beta = t[int(np.argmin(v))][3:]
        a3.append((alpha, beta, beta / (alpha + beta), alpha / (alpha + beta)))

    def interval(samples, i):
        if not samples:
            return None
        column = np.array([s[i] for s in samples])
        return [float(np.percentile(column, 5)), float(np.percentile(column, 95))]

    return {
        "approach2": {"a": interval(a2, 0), "b": interval(a2, 1), "resamples": len(a2)},
        "approach3": {k: interval(a3, i) for i, k in enumerate(("alpha", "beta", "a", "b"))} | {"resamples": len(a3)},
    }
