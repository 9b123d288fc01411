"""Train the same model on the same data with each optimiser; write the loss curves and a table.

    python scripts/compare_optimizers.py --config configs/tiny.py [--steps 200] [--out runs/optimizers]
        [--optimizers adamw,lion,adafactor,sgd,muon] [--lrs lion=3e-4,sgd=0.3]

Writes <out>/optimizers.png (loss per step, one line per optimiser) and
<out>/optimizers.md (final loss = mean of the last 10 steps). Each optimiser
runs at its own learning rate (defaults below, scaled from the config's
AdamW rate), with the config's schedule, clipping and weight decay.
"""

import os

from absl import flags

from trainer.config import forms
from trainer.planning import experiments
from trainer.run import cli

_CONFIG = cli.define_config_flag()
_STEPS = flags.DEFINE_integer("steps", 200, "Steps per optimiser.")
_OUT = flags.DEFINE_string("out", "runs/optimizers", "Where to write the plot and the table.")
_OPTIMIZERS = flags.DEFINE_list("optimizers", ["adamw", "lion", "adafactor", "sgd", "muon"], "Which to run.")
_LRS = flags.DEFINE_list("lrs", [], "name=lr overrides, e.g. lion=3e-4.")

# Learning rates relative to AdamW's that work for each (Lion's sign updates are larger, SGD's smaller).
LR_FACTOR = {"adamw": 1.0, "lion": 0.3, "adafactor": 1.0, "sgd": 100.0, "muon": 1.0}


def main():
    cfg = forms.with_changes(_CONFIG.value, {"train.steps": _STEPS.value, "train.eval_every": 0})
    overrides = {k: float(v) for k, v in (item.split("=") for item in _LRS.value)}
    batches = experiments.fixed_batches(cfg, _STEPS.value)
    curves, rows = {}, []
    for name in _OPTIMIZERS.value:
        lr = overrides.get(name, cfg.optim.lr * LR_FACTOR.get(name, 1.0))
        losses = experiments.loss_curve(forms.with_changes(cfg, {"optim.name": name, "optim.lr": lr}), batches)
        curves[name] = (list(range(1, len(losses) + 1)), losses)
        rows.append(f"| {name} | {lr:.2e} | {losses[0]:.3f} | {experiments.final_loss(losses):.3f} |")
        print(rows[-1])
    os.makedirs(_OUT.value, exist_ok=True)
    experiments.plot(os.path.join(_OUT.value, "optimizers.png"), {"training loss": curves}, "step", "loss")
    with open(os.path.join(_OUT.value, "optimizers.md"), "w") as f:
        f.write(f"{_STEPS.value} steps of {cli.config_path()} on {experiments.devices_note()}\n\n")
        f.write("| optimiser | lr | first loss | final loss (last 10) |\n| --- | --- | --- | --- |\n")
        f.write("\n".join(rows) + "\n")
    print(f"wrote {_OUT.value}/optimizers.png and optimizers.md")


if __name__ == "__main__":
    cli.run(main)
