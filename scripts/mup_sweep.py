"""A learning-rate sweep across widths, with and without muP: does the best rate transfer?

    python scripts/mup_sweep.py --config configs/tiny.py [--widths 128,256,512] [--lrs 1e-3,3e-3,1e-2,3e-2]
        [--steps 100] [--out runs/mup_sweep]

The config's width is the muP base width; wider models add heads of the same
size. Writes <out>/mup_sweep.png (final loss against learning rate, one line per
width; standard parametrisation left, muP right) and <out>/mup_sweep.md with
the best learning rate per width. Under muP the minima line up.
"""

import os

from absl import flags

from trainer.config import forms
from trainer.planning import experiments
from trainer.run import cli

_CONFIG = cli.define_config_flag()
_WIDTHS = flags.DEFINE_list("widths", ["128", "256", "512"], "d_model values; the first is the base width.")
_LRS = flags.DEFINE_list("lrs", ["1e-3", "3e-3", "1e-2", "3e-2"], "Learning rates to try.")
_STEPS = flags.DEFINE_integer("steps", 100, "Steps per run.")
_OUT = flags.DEFINE_string("out", "runs/mup_sweep", "Where to write the plot and the table.")


def main():
    widths, lrs = [int(w) for w in _WIDTHS.value], [float(x) for x in _LRS.value]
    base = forms.with_changes(_CONFIG.value, {"train.steps": _STEPS.value, "train.eval_every": 0})
    base = experiments.widened(base, widths[0], widths[0], mup=False)
    batches = experiments.fixed_batches(base, _STEPS.value)
    panels, rows = {}, []
    for mup in (False, True):
        title = "muP" if mup else "standard"
        panels[title] = {}
        for width in widths:
            cfg = experiments.widened(base, width, widths[0], mup)
            finals = [experiments.final_loss(experiments.loss_curve(
                forms.with_changes(cfg, {"optim.lr": lr}), batches)) for lr in lrs]  # fmt: skip
            panels[title][f"d_model={width}"] = (lrs, finals)
            best = min(zip(finals, lrs, strict=True), key=lambda p: p[0] if p[0] == p[0] else float("inf"))
            rows.append(f"| {title} | {width} | " + " | ".join(f"{f:.3f}" for f in finals) + f" | {best[1]:.0e} |")
            print(rows[-1])
    os.makedirs(_OUT.value, exist_ok=True)
    experiments.plot(os.path.join(_OUT.value, "mup_sweep.png"), panels, "learning rate", "final loss", logx=True)
    with open(os.path.join(_OUT.value, "mup_sweep.md"), "w") as f:
        f.write(f"{_STEPS.value} steps per run of {cli.config_path()} on {experiments.devices_note()}\n\n")
        f.write("| parametrisation | d_model | " + " | ".join(f"lr {x:g}" for x in lrs) + " | best lr |\n")
        f.write("| --- | --- | " + " | ".join("---" for _ in lrs) + " | --- |\n")
        f.write("\n".join(rows) + "\n")
    print(f"wrote {_OUT.value}/mup_sweep.png and mup_sweep.md")


if __name__ == "__main__":
    cli.run(main)
