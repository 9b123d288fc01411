"""One picture of a run, or of several overlaid, from their metrics.jsonl (scripts/report.py).

Panels: training and evaluation loss, learning rate, gradient norm, update
ratio (|update| / |params|), tokens per second and MFU; for a GRPO run, its reward (each rollout's, their
moving average, and the held-out prompts' greedy reward from step 0 on). Skipped steps are
crosses along the foot of the loss panel (a non-finite loss is not drawn). A
rollback is a vertical line on every panel at the step it left, and the
history after it starts again from the step it went back to, so the abandoned
stretch stays visible. Below them, where the run keeps one (goodput.json,
trainer/storage/goodput.py), a bar per run of where its wall time went.
"""

from __future__ import annotations

import json
import os

from trainer.config.errors import ConfigError
from trainer.storage.goodput import BUCKETS, LEDGER
from trainer.storage.metrics import METRICS_FILE, read_records
from trainer.storage.workdir import path

PANELS = (("loss", "loss"), ("lr", "learning rate"), ("grad_norm", "gradient norm"),
          ("update_ratio", "update ratio"), ("tokens_per_sec", "tokens/s"), ("mfu", "MFU"))  # fmt: skip
REWARD = ("rl/reward", "reward (GRPO): rollouts', smoothed, held-out greedy")
# A distilled run's loss panel shows its cross-entropy (comparable with any run's loss), its objective here.
OBJECTIVE = ("objective", "distillation's objective: (1 - alpha) x cross-entropy + alpha x divergence")


def read(workdir: str) -> dict:
    """{"train": records with a loss, "eval": with an eval_loss or a GRPO eval_reward, "skipped": steps,
    "rollbacks": events, "goodput": the run's time account or None}."""
    records = read_records(workdir)
    if records is None:
        raise ConfigError(f"{workdir} has no {METRICS_FILE}; give the --workdir of a run that has logged.")
    account = path(workdir) / LEDGER
    run = {"train": [], "eval": [], "skipped": [], "rollbacks": [],
           "goodput": json.loads(account.read_text()) if account.exists() else None}  # fmt: skip
    for record in records:
        if record.get("event") == "rollback":
            run["rollbacks"].append(record)
        elif record.get("event") == "skipped":
            run["skipped"].append(record["step"])
        elif "eval_loss" in record or "eval_reward" in record:
            run["eval"].append(record)
        elif "loss" in record:
            run["train"].append(_comparable(record))
    return run


def _comparable(record: dict) -> dict:
    """A distilled step's record with its cross-entropy as the loss that is plotted beside other runs' losses,
    and its objective apart (none on a step of the student's own samples, which has no cross-entropy)."""
    if "distill/cross_entropy" not in record:
        return record
    loss = None if record.get("distill/on_policy") else record["distill/cross_entropy"]
    return {**record, "loss": loss, "objective": record["loss"]}


def figure(workdirs: list[str]):
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError('the report draws with matplotlib: pip install -e ".[dev]" (or pip install matplotlib).')
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [read(workdir) for workdir in workdirs]
    given = lambda key: any(r.get(key) is not None for run in runs for r in run["train"])  # noqa: E731
    panels = PANELS + ((REWARD,) if given("rl/reward") else ()) + ((OBJECTIVE,) if given("objective") else ())
    rows = (len(panels) + 1) // 2
    fig = plt.figure(figsize=(12, 3 * rows + 3))
    grid = fig.add_gridspec(rows + 1, 2, height_ratios=(1,) * rows + (0.7,))
    axes = [fig.add_subplot(grid[0, 0])]
    axes += [fig.add_subplot(grid[i // 2, i % 2], sharex=axes[0]) for i in range(1, len(panels))]
    shares = fig.add_subplot(grid[rows, :])
    accounts = []
    for n, (workdir, run) in enumerate(zip(workdirs, runs, strict=True)):
        color, label = f"C{n}", _label(workdir, workdirs)
        if run["goodput"]:
            accounts.append((label, run["goodput"]["seconds"]))
        for ax, (key, title) in zip(axes, panels, strict=True):
            steps = [r["step"] for r in run["train"] if r.get(key) is not None]
            ax.plot(steps, [r[key] for r in run["train"] if r.get(key) is not None], color=color, label=label,
                    alpha=0.35 if key == REWARD[0] else 1.0)  # fmt: skip
            ax.set_title(f"{title} (a distilled run's: its cross-entropy)" if key == "loss" and OBJECTIVE in panels
                         else title)  # fmt: skip
            for event in run["rollbacks"]:
                ax.axvline(event["from_step"], color=color, linestyle=":", alpha=0.8)
        loss = axes[0]
        scored = [r for r in run["eval"] if "eval_loss" in r]
        if scored:
            loss.plot([r["step"] for r in scored], [r["eval_loss"] for r in scored], color=color, linestyle="--",
                      marker="o", label=f"{label} (eval)")  # fmt: skip
        if REWARD in panels:
            _rewards(axes[panels.index(REWARD)], run, color, label)
        # At the foot of the panel: a skipped step's loss is often not a number.
        loss.plot(run["skipped"], [0.02] * len(run["skipped"]), "x", color="red", transform=loss.get_xaxis_transform(),
                  label="skipped steps" if n == 0 else None)  # fmt: skip
    axes[0].legend(fontsize=8)
    for ax in axes[-2:]:
        ax.set_xlabel("step")
    if len(panels) > len(PANELS):
        axes[len(PANELS)].legend(fontsize=8)
    _goodput_bars(shares, accounts)
    fig.tight_layout()
    return fig


def _rewards(ax, run: dict, color: str, label: str) -> None:
    """Beside the rollouts' rewards (drawn faint with the other panels): their moving average, and the held-out
    prompts' greedy reward at each evaluation (step 0: before training)."""
    smoothed = [r for r in run["train"] if r.get("rl/reward_smoothed") is not None]
    ax.plot([r["step"] for r in smoothed], [r["rl/reward_smoothed"] for r in smoothed], color=color,
            label=f"{label} (smoothed)")  # fmt: skip
    held = [r for r in run["eval"] if "eval_reward" in r]
    ax.plot([r["step"] for r in held], [r["eval_reward"] for r in held], color=color, linestyle="--", marker="o",
            label=f"{label} (held-out)")  # fmt: skip


def _goodput_bars(ax, runs: list[tuple[str, dict]]) -> None:
    """One bar per run (label, its seconds by bucket): each bucket's share of its accounted wall time."""
    for y, (_, seconds) in enumerate(runs):
        total, left = sum(seconds.values()), 0.0
        for n, name in enumerate(BUCKETS):
            share = seconds[name] / total if total else 0.0
            ax.barh(y, share, left=left, color=f"C{n}", label=name.replace("_", " ") if y == 0 else None)
            left += share
    ax.set_yticks(range(len(runs)), [label for label, _ in runs])
    ax.set_xlim(0, 1)
    ax.set_title("where the wall time went (goodput: the share of training steps)")
    if runs:
        ax.legend(fontsize=8, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.15))


def write(workdirs: list[str], out: str) -> str:
    """Draw the runs into the PNG file `out` (a local path, or one in a bucket)."""
    import io

    picture = io.BytesIO()
    figure(workdirs).savefig(picture, format="png", dpi=100)
    target = path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(picture.getvalue())
    return out


def _label(workdir: str, workdirs: list[str]) -> str:
    """The run's directory name, with its parent's where two runs share a name."""
    name = os.path.basename(os.path.normpath(workdir))
    same = [w for w in workdirs if os.path.basename(os.path.normpath(w)) == name]
    return name if len(same) == 1 else os.path.join(*os.path.normpath(workdir).split(os.sep)[-2:])
