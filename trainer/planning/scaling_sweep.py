"""An isoFLOP sweep: for each compute budget, a ladder of model sizes, each trained on what the budget buys.

The ladder is the base config's shape scaled (one rule, as Chinchilla grew
width and depth together): head size, grouped-query ratio, MLP ratio and the
aspect ratio d_model / n_layers stay the base config's; d_model takes every
multiple of head_dim x (n_heads / n_kv_heads); n_layers = max(2, d_model /
aspect) rounded. For a budget C, the `sizes` consecutive rungs centred on the
one nearest the rule-of-thumb optimum (`tokens_per_param` x N tokens) are
trained, each for C / FLOPs-per-token tokens (trainer/model/flops.py: 6 N plus
attention), with its warmup and cosine decay fitted to its own length
(Hoffmann et al.'s correction to Kaplan et al.'s fixed schedule) and one
evaluation at the end, on the base config's `train.eval_batches` held-out
batches (the fitted loss: raise it, e.g. to 32, for a less noisy fit).

N here is the parameters that take part in matmuls (trainer/model/flops.py), the N
of C = 6 N D: an untied input embedding (a lookup) is not counted.

Each point is an ordinary run directory, <out>/C<budget>/d<d_model>, with its
config.json and metrics.jsonl: it resumes like any run, and a finished one
(its final evaluation written) is skipped when the sweep runs again. `out` may be
a local directory or a `gs://` bucket (every path goes through etils.epath); on
several processes every process trains each point and process 0 alone writes
the lab's own files.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import jax
import numpy as np

from trainer.config import forms
from trainer.config.errors import ConfigError
from trainer.model.flops import flops_per_token, matmul_params
from trainer.storage import workdir as wd
from trainer.storage.metrics import read_records
from trainer.storage.workdir import saved_config
from trainer.training.setup import build

MIN_STEPS = 40  # fewer steps than this is warmup and little else
SWEEP_FILE = "sweep.json"
POINT_COLUMNS = ("budget", "n_params", "tokens", "flops", "loss", "d_model", "n_layers")
# The keys a point sets over the base config (make_point): what its train.py command line must carry.
POINT_KEYS = ("model.d_model", "model.n_layers", "model.n_heads", "model.n_kv_heads", "model.d_ff", "train.steps",
              "optim.warmup_steps", "optim.decay_steps", "train.eval_every",
              "checkpoint.every_steps", "checkpoint.keep", "train.log_every", "train.sample_prompts")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Rung:
    d_model: int
    n_layers: int
    n_params: int  # matmul parameters: the N of C = 6 N D
    flops_per_token: float
    changes: dict  # the config keys that make this shape


@dataclasses.dataclass(frozen=True)
class Point:
    budget: float
    rung: Rung
    steps: int
    tokens: int
    workdir: str
    cfg: object  # ml_collections.ConfigDict

    @property
    def flops(self) -> float:
        return self.rung.flops_per_token * self.tokens


def ladder(base, max_budget: float, at_least: int = 3) -> list[Rung]:
    """The base config's shape at every allowed width, smallest first, up to the largest that trains
    MIN_STEPS steps on `max_budget` FLOPs (and no fewer than `at_least` rungs)."""
    max_fpt = max_budget / (MIN_STEPS * base.train.global_batch_size * base.data.seq_len)
    m = base.model
    head_dim, group = m.head_dim or m.d_model // m.n_heads, m.n_heads // m.n_kv_heads
    aspect, ffn = m.d_model / m.n_layers, m.d_ff / m.d_model
    step = head_dim * group
    rungs, width = [], step
    while True:
        heads = width // head_dim
        changes = {"model.d_model": width, "model.n_layers": max(2, round(width / aspect)),
                   "model.n_heads": heads, "model.n_kv_heads": heads // group,
                   "model.d_ff": 8 * max(1, round(width * ffn / 8))}  # fmt: skip
        n, fpt = _sizes(forms.with_changes(base, changes))
        if fpt > max_fpt and len(rungs) >= at_least:
            return rungs
        rungs.append(Rung(width, changes["model.n_layers"], n, fpt, changes))
        width += step


def _sizes(cfg) -> tuple[int, float]:
    """(matmul parameters, training FLOPs per token) of a config's model, from its abstract shapes only."""
    setup = build(cfg, devices=jax.devices()[:1])
    params, arch = setup.model.abstract_params, setup.spec.arch
    return matmul_params(arch, params), flops_per_token(arch, params, cfg.data.seq_len)


def point_name(budget: float) -> str:
    return "C" + f"{budget:.2g}".replace("+", "")


def plan_points(base, budgets: list[float], sizes: int, out: str, tokens_per_param: float = 20.0) -> list[Point]:
    """Every point of the sweep, smallest budget first; refuses a budget the ladder cannot serve."""
    if sizes < 3:
        raise ConfigError(f"--sizes={sizes} gives no isoFLOP profile to fit a parabola to; use 3 or more.")
    rungs = ladder(base, max(budgets), at_least=sizes)
    tokens_per_step = base.train.global_batch_size * base.data.seq_len
    points = []
    for budget in sorted(budgets):
        usable = [r for r in rungs if budget / r.flops_per_token >= MIN_STEPS * tokens_per_step]
        if len(usable) < sizes:
            small = rungs[sizes - 1]
            need = MIN_STEPS * tokens_per_step * small.flops_per_token
            raise ConfigError(
                f"budget {budget:.3g} FLOPs is too small for {sizes} sizes of the ladder: the largest of its "
                f"{sizes} smallest models (d_model {small.d_model}, {small.n_params:,} parameters) would train "
                f"fewer than {MIN_STEPS} steps of {tokens_per_step:,} tokens; use budgets of at least {need:.2g}."
            )
        guess = math.sqrt(budget / (6 * tokens_per_param))
        centre = min(range(len(usable)), key=lambda i: abs(math.log(usable[i].n_params / guess)))
        first = min(max(0, centre - sizes // 2), len(usable) - sizes)
        for rung in usable[first : first + sizes]:
            points.append(make_point(base, budget, rung, point_dir(out, budget, rung)))
    return points


def point_dir(out: str, budget: float, rung) -> str:
    """A sweep point's workdir: <out>/C<budget>/d<d_model>."""
    return os.path.join(out, point_name(budget), f"d{rung.d_model}")


def make_point(base, budget: float, rung: Rung, workdir: str) -> Point:
    """The config that trains `rung` for budget / FLOPs-per-token tokens, schedule fitted to that length."""
    tokens_per_step = base.train.global_batch_size * base.data.seq_len
    steps = max(1, round(budget / rung.flops_per_token / tokens_per_step))
    cfg = forms.with_changes(base, {
        **rung.changes,
        "train.steps": steps,
        "optim.warmup_steps": min(base.optim.warmup_steps, steps // 10),
        "optim.decay_steps": 0,  # cosine/linear decay to the end of this run
        "train.eval_every": steps,
        "checkpoint.every_steps": max(1, steps // 4),
        "checkpoint.keep": 1,
        "train.log_every": max(1, steps // 20),
        "train.sample_prompts": (),  # a point is judged by its loss; the ladder's contexts may be short
    })  # fmt: skip
    return Point(budget, rung, steps, steps * tokens_per_step, workdir, cfg)


def final_loss(workdir: str) -> float | None:
    """The run's evaluation at its last step, once it has trained all its batches; None until then."""
    cfg_dict, records = saved_config(workdir), read_records(workdir)
    if cfg_dict is None or records is None:
        return None
    target = cfg_dict["train"]["steps"] * cfg_dict["train"]["global_batch_size"]
    done = [r["step"] for r in records if (r.get("sequences") or 0) >= target]
    evals = [r["eval_loss"] for r in records if done and r["step"] >= done[0] and r.get("eval_loss") is not None]
    return evals[-1] if evals else None


def command_line(point: Point, script_args: list[str]) -> str:
    """The train.py command that runs this point: the sweep's own config flags, then the point's keys."""
    values = forms.flatten(point.cfg)
    flags = [f"--config.{k}={values[k]}" for k in POINT_KEYS]
    return " ".join(["python scripts/train.py", *script_args, f"--workdir={point.workdir}", *flags])


def write_sweep(out: str, base, script_args: list[str], budgets: list[float], sizes: int) -> None:
    """What `predict` needs later: the base config and the flags the sweep was run with (process 0 writes)."""
    record = {"config": base.to_dict(), "script_args": script_args, "budgets": budgets, "sizes": sizes}
    if jax.process_index() == 0:
        wd.write_file(wd.path(out) / SWEEP_FILE, json.dumps(record, indent=2, default=list))


def read_sweep(out: str) -> dict:
    file = wd.path(out) / SWEEP_FILE
    if not file.exists():
        raise ConfigError(f"{out} holds no sweep ({SWEEP_FILE} is missing); run `scaling.py sweep --out {out}` first.")
    record = json.loads(file.read_text())
    record["base"] = forms.from_dict(record["config"])
    return record


def finished_points(out: str) -> list[dict]:
    """One row per finished point under <out>/C*/d*: budget, N, D, C, final eval loss and shape."""
    rows, root = [], wd.path(out)
    for budget_dir in sorted(d.name for d in root.iterdir()) if root.is_dir() else []:
        if not budget_dir.startswith("C"):
            continue
        for name in sorted(d.name for d in (root / budget_dir).iterdir()):
            workdir = os.path.join(out, budget_dir, name)
            loss = final_loss(workdir)
            if loss is None:
                continue
            cfg = forms.from_dict(saved_config(workdir))
            n, fpt = _sizes(cfg)
            tokens = cfg.train.steps * cfg.train.global_batch_size * cfg.data.seq_len
            rows.append({"budget": float(budget_dir[1:]), "n_params": n, "tokens": tokens, "flops": fpt * tokens,
                         "loss": loss, "d_model": cfg.model.d_model, "n_layers": cfg.model.n_layers})  # fmt: skip
    return sorted(rows, key=lambda r: (r["budget"], r["n_params"]))


def flops_per_token_of(rows: list[dict]):
    """FLOPs per token as a function of N, interpolated in log N between the sweep's points (6 N without them)."""
    known = sorted({(r["n_params"], r["flops"] / r["tokens"]) for r in rows if r.get("tokens")})
    if not known:
        return lambda n: 6 * np.asarray(n, float)
    log_n = np.log([k[0] for k in known])
    log_ratio = np.log([k[1] / k[0] for k in known])
    return lambda n: np.asarray(n, float) * np.exp(np.interp(np.log(n), log_n, log_ratio))
