"""plan.py --search from end to end: its refusals (each before any compile), the devices it plans for, the
rounds of trainer/planning/search.py, and the report it prints or writes as JSON."""

from __future__ import annotations

from parallelism.chips import CHIPS, chip_of
from trainer.config.errors import ConfigError
from trainer.planning import search as rounds
from trainer.planning.plan import plan
from trainer.planning.targets import _GPU_COUNTS, GENERATIONS, parse_target, target_devices


def check(cfg, target: str, slices: int, fixed: dict, compiles: int, trial: int) -> None:
    """What the search refuses before it builds anything."""
    if compiles < 1:
        raise ConfigError(f"--search_compiles must be at least 1, not {compiles}.")
    if trial < 0:
        raise ConfigError(f"--trial takes a number of steps, not {trial}.")
    if trial and target:
        raise ConfigError("--trial times each finalist on this machine's own devices, which are not "
                          f"{target}'s: drop --target (on a TPU VM or GPU host the search then plans its own "
                          "chips) or drop --trial.")  # fmt: skip
    if trial and (cfg.data.format != "text" or cfg.model.lora.rank or cfg.distill.teacher):
        raise ConfigError("--trial times pretraining steps; this config's step takes more than a batch (a "
                          "reference, a frozen base or a teacher): plan it without --trial.")  # fmt: skip
    batch = cfg.train.global_batch_size
    if slices > 1 and batch % slices:
        raise ConfigError(f"--slices {slices}: the global batch of {batch} sequences (train.global_batch_size) does "
                          f"not split over {slices} slices; choose a slice count that divides {batch}.")  # fmt: skip
    for key in ("mesh.dcn_data", "mesh.dcn_fsdp"):
        if key in fixed and slices % fixed[key]:
            raise ConfigError(f"--fix {key}={fixed[key]} does not divide the {slices} slices (--slices).")


def run(cfg, *, target: str = "", slices: int = 1, fixed: dict | None = None, compiles: int = 8, trial: int = 0,
        chip: str = "h100", devices=None, progress=lambda line: None) -> dict:  # fmt: skip
    """The search on `target` (its compiler, no device needed) or on `devices` (this machine's) judged as
    `chip`s; a JSON-able report."""
    fixed = fixed or {}
    check(cfg, target, slices, fixed, compiles, trial)
    hardware = parse_target(target) if target else None
    if hardware is not None:
        devices, chip_name = target_devices(hardware, slices), hardware.chip_name
    else:
        chip_name = chip_of(devices[0].device_kind) or chip
        if chip_name not in CHIPS:
            raise ConfigError(f"unknown chip '{chip_name}'; the peak table knows {', '.join(CHIPS)}.")
    on = CHIPS[chip_name]
    if hardware is not None:
        compile_layout = lambda c: plan(c, devices=devices, target=target, slices=slices)  # noqa: E731
    else:
        compile_layout = lambda c: plan(c, devices=devices, chip=chip_name, on_chip=True)  # noqa: E731
    found = rounds.search(cfg, devices, on, compile_layout, slices=slices, fixed=fixed, compiles=compiles,
                          trial=trial, progress=progress)  # fmt: skip
    where = f"{target} x {slices}" if hardware is not None else f"{len(devices)} {devices[0].platform} devices"
    if not found["candidates"]:
        raise ConfigError(_nothing_fits(cfg, hardware, devices, slices, fixed, on, where))
    own = found["own"]
    base = own.layout if isinstance(own, rounds.Candidate) else rounds.layout_of(cfg)
    report = {
        "target": target, "slices": slices, "devices": len(devices), "device_kind": devices[0].device_kind,
        "chip": chip_name, "where": where, "fixed": fixed, "considered": found["considered"],
        "meshes": found["meshes"], "fit_arithmetic": len(found["candidates"]),
        "screen_seconds": found["screen_seconds"], "not_searched": found["not_searched"],
        "assumptions": list(rounds.ASSUMPTIONS),
        "top": [_row(c, base) for c in found["candidates"]],
        "compiled": [_row(c, base) for c in found["compiled"]],
        "own": _row(own, base) if isinstance(own, rounds.Candidate) else {"refused": own},
        "best": _row(found["best"], base) if found["best"] is not None else None,
    }  # fmt: skip
    if report["best"] is not None and isinstance(own, rounds.Candidate) and own.compiled:
        report["gain"] = _gain(own, found["best"])
    return report


def _row(c: rounds.Candidate, base: dict) -> dict:
    return {"layout": c.layout, "describe": rounds.describe(c.layout),
            "changes": {k: v for k, v in c.layout.items() if base.get(k) != v},
            "memory_bytes": c.memory_bytes, "predicted": c.predicted, "compiled": c.compiled,
            "measured_seconds": c.measured_seconds}  # fmt: skip


def _gain(own: rounds.Candidate, best: rounds.Candidate) -> dict:
    """How much faster the winner's compiled program is than the user's, and the collectives it sends less of."""
    if not own.compiled.get("fits") or "step_seconds" not in own.compiled:
        return {"own_fits": False}
    mine, theirs = own.compiled.get("collectives", {}), best.compiled.get("collectives", {})
    return {
        "own_fits": True,
        "speedup": own.compiled["step_seconds"] / best.compiled["step_seconds"],
        "collectives_sent": {k: (mine.get(k, 0.0), theirs.get(k, 0.0)) for k in sorted({*mine, *theirs})},
    }


def _nothing_fits(cfg, hardware, devices, slices: int, fixed: dict, chip, where: str) -> str:
    """The sentence for a search that found no layout fitting by arithmetic: under a pin, or at any layout."""
    if fixed and rounds.screen(cfg, devices, chip, slices, {})["candidates"]:
        pins = " ".join(f"--fix {k}={v}" for k, v in fixed.items())
        return (f"no layout of this config fits {where} under {pins}; layouts without the pin do: drop it, or "
                "plan a larger target.")  # fmt: skip
    if hardware is None:
        return f"no layout of this config fits {where} as {chip.device_kinds[0]} chips; plan for a larger target."
    larger = smallest_fitting(cfg, hardware, slices)
    hint = (
        f"the smallest {hardware.generation} target that holds it is {larger}: plan with --target {larger}"
        if (larger)
        else f"no {hardware.generation} target holds it at {slices} slice(s): add slices (--slices)"
    )
    return f"no layout of this config fits {where} ({chip.usable_hbm_bytes / 2**30:.2f} GiB a device); {hint}."


# The leanest layout: FSDP over every device, full remat; the search varies the rest (the chunked loss,
# bfloat16 moments, the most microbatches the batch allows).
LEAN = {"mesh.data": 1, "mesh.tensor": 1, "mesh.stage": 1, "mesh.context": 1, "mesh.expert": 1, "model.remat": "full"}


def smallest_fitting(cfg, hardware, slices: int) -> str | None:
    """The smallest target of the same generation on which the leanest layout fits by arithmetic."""
    if hardware.is_gpu:
        names = [f"{hardware.generation}-{n}" for n in _GPU_COUNTS if n > hardware.chips]
    else:
        g = GENERATIONS[hardware.generation]
        names = [f"{hardware.generation}-{c * g.cores_per_chip}" for c in g.chip_counts if c > hardware.chips]
    for name in names:
        larger = parse_target(name)
        pins = {**LEAN, "mesh.dcn_data": slices, "mesh.dcn_fsdp": 1}
        if rounds.screen(cfg, target_devices(larger, slices), larger.chip, slices, pins)["candidates"]:
            return name
    return None
