"""The three pictures of a scaling-law fit (needs matplotlib: `pip install -e ".[dev]"`).

- isoflops.png: loss against N per budget, each with its parabola and vertex (Approach 2);
- frontier.png: every run's loss against its compute, the Approach 2 frontier
  L_min = k_L C^g and Approach 3's loss at its compute-optimal split;
- contours.png: Approach 3's L(N, D) as contours over N and D, the isoFLOP
  lines of the budgets, and the efficient frontier (the optimum N, D of each C).
"""

from __future__ import annotations

import io
import os

import numpy as np

from trainer.planning import scaling_fit
from trainer.planning.scaling import Law
from trainer.storage.workdir import write_file


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


NAMES = ("isoflops.png", "frontier.png", "contours.png")


def write_all(out: str, n, tokens, flops, loss, a2: dict | None, law: Law, flops_per_token) -> list[str]:
    """Write the three PNGs into `out` (a directory or a bucket); returns their paths."""
    plt = _pyplot()
    paths = [os.path.join(out, name) for name in NAMES]
    colours = plt.cm.viridis(np.linspace(0, 0.9, len(scaling_fit.group_by_budget(flops))))

    fig, ax = plt.subplots(figsize=(7, 5))
    minima = {m["flops"]: m for m in (a2 or {}).get("minima", [])}
    for colour, idx in zip(colours, scaling_fit.group_by_budget(flops), strict=True):
        c = float(np.median(flops[idx]))
        ax.scatter(n[idx], loss[idx], color=colour, label=f"C = {c:.2g}")
        m = minima.get(c)
        if m is not None:
            x = np.linspace(np.log10(n[idx]).min() - 0.2, np.log10(n[idx]).max() + 0.2, 100)
            ax.plot(10**x, np.polyval(m["coeffs"], x), color=colour, alpha=0.6)
            if "n_params" in m:
                ax.scatter([m["n_params"]], [m["loss"]], color=colour, marker="*", s=200, edgecolor="k")
    ax.set(xscale="log", xlabel="parameters N", ylabel="final eval loss", title="IsoFLOP profiles (Approach 2)")
    _save(plt, fig, ax, paths[0])

    fig, ax = plt.subplots(figsize=(7, 5))
    sc = ax.scatter(flops, loss, c=np.log10(n), cmap="viridis")
    fig.colorbar(sc, label="log10 N")
    c_line = np.geomspace(flops.min() / 2, flops.max() * 8, 100)
    if a2:
        ax.plot(c_line, a2["k_l"] * c_line ** a2["g"], "k--", label=f"Approach 2: L_min ~ C^{a2['g']:.3f}")
    best = [law.best_split(c, flops_per_token)["loss"] for c in c_line]
    ax.plot(c_line, best, "r-", label="Approach 3: loss at the optimal split")
    ax.set(xscale="log", xlabel="training FLOPs C", ylabel="final eval loss", title="Loss against compute")
    _save(plt, fig, ax, paths[1])

    fig, ax = plt.subplots(figsize=(7, 5))
    n_grid = np.geomspace(n.min() / 4, n.max() * 4, 200)
    d_grid = np.geomspace(tokens.min() / 4, tokens.max() * 4, 200)
    nn, dd = np.meshgrid(n_grid, d_grid)
    contours = ax.contour(nn, dd, law.loss(nn, dd), levels=15, cmap="viridis_r")
    ax.clabel(contours, fontsize=7)
    for colour, idx in zip(colours, scaling_fit.group_by_budget(flops), strict=True):
        c = float(np.median(flops[idx]))
        ax.plot(n_grid, c / flops_per_token(n_grid), color=colour, alpha=0.5, label=f"C = {c:.2g}")
    frontier = [law.best_split(c, flops_per_token) for c in c_line]
    ax.plot([f["n_params"] for f in frontier], [f["tokens"] for f in frontier], "r-", lw=2, label="efficient frontier")
    ax.scatter(n, tokens, color="k", s=10)
    ax.set(xscale="log", yscale="log", xlim=(n_grid[0], n_grid[-1]), ylim=(d_grid[0], d_grid[-1]),
           xlabel="parameters N", ylabel="tokens D", title="Approach 3: L(N, D)")  # fmt: skip
    _save(plt, fig, ax, paths[2])
    return paths


def _save(plt, fig, ax, path: str) -> None:
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=100)
    plt.close(fig)
    write_file(path, image.getvalue())
