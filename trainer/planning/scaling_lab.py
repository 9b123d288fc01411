"""The scaling-law lab behind scripts/scaling.py: sweep, fit, predict (and check the prediction by training).

- sweep: train every point of an isoFLOP sweep (trainer/planning/scaling_sweep.py)
  in this process, skipping finished ones, a progress line with an ETA per point.
- fit: read the final held-out losses (or a CSV table of n_params, tokens, loss
  [, flops]), fit Approach 2 and Approach 3 (trainer/planning/scaling_fit.py)
  with bootstrap intervals, write fit.json, points.csv and three PNGs.
- predict: the compute-optimal N, D and loss of each fit at a new budget, the
  ladder's model nearest to it as a config file for scripts/train.py, and with
  `train`, that model and its ladder neighbours trained at the budget: predicted
  against measured loss, and where the measured optimum fell.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import time

import jax
import numpy as np
from etils import epath

from parallelism.distributed import barrier
from trainer.config.errors import ConfigError
from trainer.planning import scaling_fit, scaling_sweep
from trainer.planning.scaling import Law
from trainer.storage import workdir as wd

FIT_FILE = "fit.json"
POINTS_FILE = "points.csv"


def _primary() -> bool:
    """Whether this process writes and speaks for the lab: every process trains, process 0 alone writes."""
    return jax.process_index() == 0


def _quiet(*_args, **_kwargs) -> None:
    pass


def run_points(points: list[scaling_sweep.Point], say=print) -> list[float]:
    """Train each point not yet finished; returns every point's final eval loss."""
    from trainer.run.loop import train

    say = say if _primary() else _quiet
    todo = sum(p.flops for p in points if scaling_sweep.final_loss(p.workdir) is None)
    done_flops, seconds, losses = 0.0, 0.0, []
    for i, p in enumerate(points, 1):
        head = (f"[{i}/{len(points)}] C={p.budget:.2g} d_model={p.rung.d_model} ({p.rung.n_layers} layers, "
                f"N={p.rung.n_params:,}, {p.tokens:,} tokens, {p.steps} steps)")  # fmt: skip
        loss = scaling_sweep.final_loss(p.workdir)
        if loss is None:
            start = time.perf_counter()
            train(p.cfg, p.workdir)
            # Process 0 writes the run's records (into a bucket, at its close); the others read them only then.
            barrier(f"point {i} trained")
            seconds += time.perf_counter() - start
            done_flops += p.flops
            loss = scaling_sweep.final_loss(p.workdir)
            if loss is None:  # stopped by a signal: the point resumes when the sweep is run again
                raise SystemExit(f"{head}: interrupted; run the same command again to resume")
            eta = (todo - done_flops) * seconds / done_flops
            say(f"{head}: eval loss {loss:.4f} in {seconds:.0f}s so far; ETA {eta / 60:.1f} min")
        else:
            say(f"{head}: finished before, eval loss {loss:.4f}")
        losses.append(loss)
    return losses


def sweep(base, budgets: list[float], sizes: int, out: str, script_args: list[str], list_only: bool = False,
          tokens_per_param: float = 20.0, say=print) -> None:  # fmt: skip
    points = scaling_sweep.plan_points(base, budgets, sizes, out, tokens_per_param)
    say = say if _primary() else _quiet
    if list_only:
        for p in points:
            say(scaling_sweep.command_line(p, script_args))
        return
    scaling_sweep.write_sweep(out, base, script_args, budgets, sizes)
    run_points(points, say)
    say(f"sweep done: {len(points)} points under {out}; next: python scripts/scaling.py fit --out {out}")


def read_points(out: str, table: str | None) -> list[dict]:
    """The rows to fit: the sweep's finished points, or a CSV table (flops = 6 N D when it has no flops column)."""
    if table is None:
        rows = scaling_sweep.finished_points(out)
        if not rows:
            raise ConfigError(f"{out} has no finished points (no run there has its final evaluation); "
                              "run `scaling.py sweep` on it first, or pass --points with a table.")  # fmt: skip
        return rows
    if not epath.Path(table).exists():
        raise ConfigError(f"--points {table} does not exist; pass a CSV file with columns n_params, tokens, loss.")
    reader = csv.DictReader(io.StringIO(epath.Path(table).read_text()))
    missing = [c for c in ("n_params", "tokens", "loss") if c not in (reader.fieldnames or [])]
    if missing:
        found = ", ".join(reader.fieldnames or []) or "none"
        raise ConfigError(f"--points {table} has no column {', '.join(missing)}; it needs n_params, tokens "
                          f"and loss (flops optional), found {found}.")  # fmt: skip
    rows = [{k: float(v) for k, v in r.items() if v not in ("", None)} for r in reader]
    for r in rows:
        r.setdefault("flops", 6 * r["n_params"] * r["tokens"])
    return rows


def fit(out: str, table: str | None = None, resamples: int = 200, plots: bool = True) -> dict:
    """Both fits of the points, their intervals and the tokens per parameter at each budget's optimum."""
    rows = read_points(out, table)
    n, tokens, loss = (np.array([r[k] for r in rows], float) for k in ("n_params", "tokens", "loss"))
    # A sweep's points are grouped and fitted by their nominal budget (steps are whole, so C differs by < 1%).
    flops = np.array([r.get("budget", r["flops"]) for r in rows], float)
    fpt = scaling_sweep.flops_per_token_of(rows if table is None else [])
    try:
        a2 = scaling_fit.approach2(n, flops, loss, fpt)
    except ValueError as e:
        a2, a2_error = None, str(e)
    law, objective = scaling_fit.approach3(n, tokens, loss)
    budgets = [float(np.median(flops[idx])) for idx in scaling_fit.group_by_budget(flops)]
    result = {
        "points": len(rows),
        "approach2": a2,
        "approach3": {
            "E": law.E,
            "A": law.A,
            "B": law.B,
            "alpha": law.alpha,
            "beta": law.beta,
            "a": law.beta / (law.alpha + law.beta),
            "b": law.alpha / (law.alpha + law.beta),
            "huber_objective": objective,
        },  # fmt: skip
        "intervals": scaling_fit.bootstrap(n, tokens, flops, loss, fpt, law, resamples=resamples),
        "optimum_at_budgets": [_optima(c, a2, law, fpt) for c in budgets],
        "flops_per_token": "interpolated between the sweep's models" if table is None else "6 N",
    }
    if a2 is None:
        result["approach2_error"] = a2_error
    if plots:
        from trainer.planning import scaling_plots

        result["plots"] = [os.path.join(out, name) for name in scaling_plots.NAMES]
        if _primary():
            scaling_plots.write_all(out, n, tokens, flops, loss, a2, law, fpt)
    if _primary():
        wd.write_file(wd.path(out) / FIT_FILE, json.dumps(result, indent=2))
        if table is None:
            table_text = io.StringIO()
            writer = csv.DictWriter(table_text, fieldnames=scaling_sweep.POINT_COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
            wd.write_file(wd.path(out) / POINTS_FILE, table_text.getvalue())
    return result


def _optima(c: float, a2: dict | None, law: Law, fpt) -> dict:
    """Each fit's optimum at budget c, with its tokens per parameter."""
    out = {"flops": c}
    fits = {"approach3": law.best_split(c, fpt)}
    if a2 is not None:
        fits["approach2"] = scaling_fit.approach2_predict(a2, c, fpt)
    for name, o in fits.items():
        out[name] = {**o, "tokens_per_param": o["tokens"] / o["n_params"]}
    return out


def read_fit(out: str) -> dict:
    file = wd.path(out) / FIT_FILE
    if not file.exists():
        raise ConfigError(f"{out} has no {FIT_FILE}; run `scaling.py fit --out {out}` first.")
    return json.loads(file.read_text())


def predict(out: str, budget: float, train: bool = False, neighbours: int = 1, say=print) -> dict:
    """Each fit's optimum at `budget`, a config for the ladder's nearest model, and with `train` the check:
    that model and `neighbours` rungs either side trained at the budget, and every size trained there so far
    (under <out>/check/C<budget>/) compared with the prediction, with the measured profile's vertex."""
    fitted, record = read_fit(out), scaling_sweep.read_sweep(out)
    say = say if _primary() else _quiet
    base = record["base"]
    rungs = scaling_sweep.ladder(base, budget)
    fpt = scaling_sweep.flops_per_token_of(
        [{"n_params": r.n_params, "tokens": 1.0, "flops": r.flops_per_token} for r in rungs])  # fmt: skip
    law = Law(**{k: fitted["approach3"][k] for k in ("E", "A", "B", "alpha", "beta")})
    result = _optima(budget, fitted["approach2"], law, fpt)
    target = result["approach3"]["n_params"]
    pick = min(range(len(rungs)), key=lambda i: abs(math.log(rungs[i].n_params / target)))
    chosen = scaling_sweep.make_point(base, budget, rungs[pick], _check_dir(out, budget, rungs[pick]))
    result["model"] = {"d_model": chosen.rung.d_model, "n_layers": chosen.rung.n_layers,
                       "n_params": chosen.rung.n_params, "tokens": chosen.tokens, "steps": chosen.steps,
                       "predicted_loss": float(law.loss(chosen.rung.n_params, chosen.tokens))}  # fmt: skip
    result["config_file"] = _write_config_file(out, chosen, result)
    result["command"] = f"python scripts/train.py --config {result['config_file']} --workdir {chosen.workdir}"
    if not train:
        return result
    indices = range(max(0, pick - neighbours), min(len(rungs), pick + neighbours + 1))
    points = [scaling_sweep.make_point(base, budget, rungs[i], _check_dir(out, budget, rungs[i])) for i in indices]
    run_points(points, say)
    # Every size trained at this budget so far (an earlier --train may have trained others) shapes the profile.
    every = [scaling_sweep.make_point(base, budget, r, _check_dir(out, budget, r)) for r in rungs]
    trained = [(p, scaling_sweep.final_loss(p.workdir)) for p in every]
    points, losses = [p for p, loss in trained if loss is not None], [loss for _, loss in trained if loss is not None]
    n = np.array([p.rung.n_params for p in points], float)
    measured = {"points": [{"d_model": p.rung.d_model, "n_params": p.rung.n_params, "tokens": p.tokens,
                            "predicted_loss": float(law.loss(p.rung.n_params, p.tokens)), "loss": loss}
                           for p, loss in zip(points, losses, strict=True)]}  # fmt: skip
    measured["loss_of_predicted_model"] = scaling_sweep.final_loss(chosen.workdir)
    minima = scaling_fit.isoflop_minima(n, np.full(len(n), budget), np.array(losses), fpt)
    if minima and minima[0].get("n_params"):
        measured["optimum"] = {k: minima[0][k] for k in ("n_params", "tokens", "loss", "inside")}
    best = int(np.argmin(losses))
    measured["best_trained"] = {"d_model": points[best].rung.d_model, "n_params": points[best].rung.n_params}
    result["measured"] = measured
    if _primary():
        wd.write_file(wd.path(out) / f"check_{scaling_sweep.point_name(budget)}.json", json.dumps(result, indent=2))
    return result


def _check_dir(out: str, budget: float, rung) -> str:
    """Where the check's point for `rung` lives: the sweep's own workdir when the sweep finished that
    very point (same model, budget and steps: training it again would only repeat it), else check/."""
    swept = scaling_sweep.point_dir(out, budget, rung)
    if scaling_sweep.final_loss(swept) is not None:
        return swept
    return os.path.join(out, "check", scaling_sweep.point_name(budget), f"d{rung.d_model}")


def _write_config_file(out: str, point, result: dict) -> str:
    path = os.path.join(out, f"predicted_{scaling_sweep.point_name(point.budget)}.py")
    a3 = result["approach3"]
    text = (
        f'"""The compute-optimal model for {point.budget:.3g} training FLOPs, by the Approach 3 fit in {out}.\n\n'
        f"The fit's optimum: N = {a3['n_params']:,.0f}, D = {a3['tokens']:,.0f} tokens, loss {a3['loss']:.4f}.\n"
        f"This is the sweep ladder's nearest model: d_model {point.rung.d_model}, {point.rung.n_layers} layers,"
        f" N = {point.rung.n_params:,},\ntrained {point.steps} steps ({point.tokens:,} tokens); predicted eval "
        f"loss {result['model']['predicted_loss']:.4f}.\n\n"
        f"    python scripts/train.py --config {path} --workdir {point.workdir}\n"
        '"""\n\nfrom trainer.config.forms import from_dict\n\n\ndef get_config():\n'
        f"    return from_dict({point.cfg.to_dict()!r})\n"
    )
    if _primary():
        wd.write_file(wd.path(path), text)
    return path


def describe_fit(result: dict) -> str:
    """The fit as a few readable lines."""
    iv, a3 = result["intervals"], result["approach3"]

    def span(pair):
        return f"[{pair[0]:.3f}, {pair[1]:.3f}]"

    lines = [f"{result['points']} points; 90% bootstrap intervals in brackets"]
    a2 = result["approach2"]
    if a2 is None:
        lines.append(f"Approach 2: not fitted ({result['approach2_error']})")
    else:
        lines.append(f"Approach 2 (isoFLOP parabolas): N_opt ~ C^{a2['a']:.3f} {span(iv['approach2']['a'])}, "
                     f"D_opt ~ C^{a2['b']:.3f} {span(iv['approach2']['b'])}, L_min ~ C^{a2['g']:.4f}")  # fmt: skip
        for m in a2["minima"]:
            where = "inside" if m.get("inside") else "OUTSIDE (extrapolated)"
            lines.append(f"  C={m['flops']:.3g}: optimum N={m['n_params']:,.0f}, D={m['tokens']:,.0f}, "
                         f"loss {m['loss']:.4f}, {where} the sizes trained")  # fmt: skip
    lines.append(f"Approach 3: L = {a3['E']:.3f} + {a3['A']:.4g} / N^{a3['alpha']:.3f} + {a3['B']:.4g} / "
                 f"D^{a3['beta']:.3f}; alpha {span(iv['approach3']['alpha'])}, beta {span(iv['approach3']['beta'])};"
                 f" N_opt ~ C^{a3['a']:.3f} {span(iv['approach3']['a'])}, D_opt ~ C^{a3['b']:.3f}")  # fmt: skip
    lines.append("tokens per parameter at the optimum (Chinchilla: about 20):")
    for o in result["optimum_at_budgets"]:
        parts = [f"{k.replace('approach', 'Approach ')} {o[k]['tokens_per_param']:.1f}" for k in o if k != "flops"]
        lines.append(f"  C={o['flops']:.3g}: " + ", ".join(parts))
    if result.get("plots"):
        lines.append("plots: " + ", ".join(result["plots"]))
    return "\n".join(lines)


def describe_prediction(result: dict) -> str:
    lines = []
    for k in ("approach2", "approach3"):
        if k in result:
            o = result[k]
            lines.append(f"{k.replace('approach', 'Approach ')}: N={o['n_params']:,.0f}, D={o['tokens']:,.0f} "
                         f"({o['tokens_per_param']:.1f} tokens/parameter), loss {o['loss']:.4f}")  # fmt: skip
    m = result["model"]
    lines.append(f"nearest ladder model: d_model {m['d_model']}, {m['n_layers']} layers, N={m['n_params']:,}, "
                 f"{m['steps']} steps ({m['tokens']:,} tokens): predicted loss {m['predicted_loss']:.4f}")  # fmt: skip
    lines.append(f"config: {result['config_file']}\nrun:    {result['command']}")
    measured = result.get("measured")
    if measured:
        got = measured["loss_of_predicted_model"]
        lines.append(f"measured loss of that model: {got:.4f} (predicted {m['predicted_loss']:.4f}, "
                     f"error {100 * (got - m['predicted_loss']) / got:+.2f}%)")  # fmt: skip
        for p in measured["points"]:
            lines.append(f"  d_model {p['d_model']}: N={p['n_params']:,} measured {p['loss']:.4f}, "
                         f"predicted {p['predicted_loss']:.4f}")  # fmt: skip
        if "optimum" in measured:
            o = measured["optimum"]
            lines.append(f"measured optimum (parabola through these): N={o['n_params']:,.0f}, loss {o['loss']:.4f}"
                         f"{'' if o['inside'] else ' (outside the sizes trained)'}")  # fmt: skip
    return "\n".join(lines)
