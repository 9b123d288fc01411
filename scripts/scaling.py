"""The scaling-law lab: an isoFLOP sweep, the fits of Hoffmann et al. (2022), and a checked prediction.

    python scripts/scaling.py sweep --config configs/tiny.py --budgets 3e12,1e13,3e13 [--sizes 5]
        [--out runs/scaling] [--list] [--config.key=value ...]
    python scripts/scaling.py fit --out runs/scaling [--points table.csv] [--resamples 200] [--json]
    python scripts/scaling.py predict --out runs/scaling --budget 1e13 [--train [--neighbours 1]] [--json]

sweep trains, for each FLOP budget, `--sizes` models of one ladder (the
config's shape scaled), each on budget / FLOPs-per-token tokens with its own
cosine schedule; every point is an ordinary run directory under --out, finished
points are skipped, `--list` prints one train.py command per point instead (for
a scheduler). fit reads each point's final eval loss (or --points: a CSV with
columns n_params, tokens, loss and optionally flops) and fits Approach 2
(isoFLOP parabolas) and Approach 3 (L = E + A/N^alpha + B/D^beta), writing
fit.json, points.csv and isoflops.png, frontier.png, contours.png into --out.
predict gives each fit's compute-optimal N, D and loss at --budget and writes a
config for the ladder's nearest model; with --train it trains that model and
its ladder neighbours at the budget and reports predicted against measured loss.
See trainer/planning/scaling_lab.py.
"""

import json
import sys

from absl import flags

from trainer.config.errors import ConfigError
from trainer.run import cli

_CONFIG = cli.define_config_flag(required=False)
_BUDGETS = flags.DEFINE_list("budgets", [], "sweep: training FLOP budgets, e.g. 3e12,1e13,3e13.")
_SIZES = flags.DEFINE_integer("sizes", 5, "sweep: model sizes per budget (3 or more).")
_TOKENS_PER_PARAM = flags.DEFINE_float("tokens_per_param", 20.0, "sweep: centre each budget's sizes on this ratio.")
_LIST = flags.DEFINE_bool("list", False, "sweep: print one train.py command per point instead of training.")
_OUT = flags.DEFINE_string("out", "runs/scaling", "The sweep's directory (and where fit writes).")
_POINTS = flags.DEFINE_string("points", None, "fit: a CSV of n_params, tokens, loss [, flops] to fit instead.")
_BUDGET = flags.DEFINE_float("budget", None, "predict: the FLOP budget to predict for.")
_TRAIN = flags.DEFINE_bool("train", False, "predict: train the predicted model and its ladder neighbours.")
_NEIGHBOURS = flags.DEFINE_integer("neighbours", 1, "predict --train: ladder neighbours on each side.")
_RESAMPLES = flags.DEFINE_integer("resamples", 200, "fit: bootstrap resamples for the intervals.")
_JSON = flags.DEFINE_bool("json", False, "fit / predict: print one JSON object.")

COMMANDS = ("sweep", "fit", "predict")


def main(args):
    from trainer.planning import scaling_lab

    if len(args) != 1 or args[0] not in COMMANDS:
        raise ConfigError(f"say one of {', '.join(COMMANDS)} (got {' '.join(args) or 'nothing'}).")
    command = args[0]
    if command == "sweep":
        if _CONFIG.value is None or not _BUDGETS.value:
            raise ConfigError("sweep needs --config and --budgets (e.g. --budgets 3e12,1e13,3e13).")
        budgets = [_number("--budgets", b) for b in _BUDGETS.value]
        scaling_lab.sweep(_CONFIG.value, budgets, _SIZES.value, _OUT.value, cli.config_args(sys.argv[1:]),
                          list_only=_LIST.value, tokens_per_param=_TOKENS_PER_PARAM.value)  # fmt: skip
    elif command == "fit":
        result = scaling_lab.fit(_OUT.value, _POINTS.value, resamples=_RESAMPLES.value)
        _say(json.dumps(result) if _JSON.value else scaling_lab.describe_fit(result))
    else:
        if _BUDGET.value is None or _BUDGET.value <= 0:
            raise ConfigError("predict needs --budget, a positive number of training FLOPs (e.g. --budget 1.2e14).")
        result = scaling_lab.predict(_OUT.value, _BUDGET.value, train=_TRAIN.value, neighbours=_NEIGHBOURS.value)
        _say(json.dumps(result) if _JSON.value else scaling_lab.describe_prediction(result))


def _say(text: str) -> None:
    """The result, once: on several processes every process computes it, process 0 prints it."""
    import jax

    if jax.process_index() == 0:
        print(text)


def _number(flag: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ConfigError(f"{flag} takes positive numbers of FLOPs such as 3e12; {text!r} is not one.")
    return value


if __name__ == "__main__":
    cli.run(main, takes_args=True)
