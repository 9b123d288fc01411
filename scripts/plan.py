"""Plan a run before launching it: python scripts/plan.py --config configs/llm_1b.py [--json]

Prints parameter counts, FLOPs per token and per step, memory per device
(arithmetic, beside the compiled train step's figure for the configured mesh,
compiled ahead of time without allocating any parameters), the
Chinchilla-optimal token count and how long training takes on a named chip.
--simulate_devices N plans for N devices on this host's CPU; --tokens T asks
"how long for T tokens", --budget C "how big a model for C FLOPs".

--target v5e-4 (any Cloud TPU type: v4-8 ... v4-4096, v5litepod-N or v5e-N,
v5p-8 ... v5p-12288, v6e-N) compiles the step with the TPU compiler for that
slice, on this machine, with no TPU (needs libtpu: pip install -e ".[tpu]"),
and says whether it fits the chip's HBM, what it costs and how fast it could
run at best; --fit, when it does not fit, screens variants (remat, accumulation,
loss chunk, bf16 moments, data/fsdp/tensor split) by arithmetic, compiles the
most promising and prints the fastest that fits as the train.py command to run;
--slices N plans N such slices joined by the data-centre network
(the mesh's dcn_data / dcn_fsdp axes). --target h100-8 (h100-N, h200-N; 8 GPUs a
host) does the same with XLA's GPU compiler, no GPU needed (pip install -e ".[gpu]").

--search finds the fastest layout of the config on the target that fits, over every axis
(trainer/planning/search.py): the mesh (stage, data, fsdp, expert, context, tensor and the
slices' split), pipeline microbatches, context attention, remat, accumulation, loss chunk,
moments and the attention kernel, predicted by a cost model you can read
(trainer/planning/cost.py), then the best --search_compiles compiled for the target (your
own layout among them) and ranked by the compiled program. --fix KEY=VALUE holds a key;
--trial K runs each finalist K steps on this machine's devices (no --target) and picks by
measured time. It prints the winner as a train.py command and as config lines.
"""

import json
import sys

from absl import flags

from parallelism import accelerators
from trainer.run import cli

_CONFIG = cli.define_config_flag()
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object instead of a table.")
_SIMULATE = flags.DEFINE_integer("simulate_devices", 0, "Plan for this many simulated CPU devices.")
_NO_COMPILE = flags.DEFINE_bool("no_compile", False, "Skip the compiled memory analysis.")
_TOKENS = flags.DEFINE_float("tokens", 0, "Tokens to train on (default: Chinchilla's 20 per parameter).")
_BUDGET = flags.DEFINE_float("budget", 0, "A compute budget in FLOPs: print the compute-optimal model for it.")
_CHIP = flags.DEFINE_string(
    "chip", "h100", "Chip for the time estimate: tpu-v4, tpu-v5e, tpu-v5p, tpu-v6e, a100, h100, h200."
)
_CHIPS = flags.DEFINE_integer("chips", 0, "How many chips (default: the mesh's device count).")
_MFU = flags.DEFINE_float("mfu", 0.4, "Model FLOPs utilisation assumed for the time estimate.")
_TARGET = flags.DEFINE_string("target", "", "TPU slice or GPU hosts to compile for: v5e-4, v5p-128, h100-8, ...")
_SLICES = flags.DEFINE_integer("slices", 1, "With --target: how many such slices (multi-slice, over DCN).")
_FIT = flags.DEFINE_bool("fit", False, "With --target: if the config does not fit, find the fastest variant that does.")
_FIT_COMPILES = flags.DEFINE_integer("fit_compiles", 3, "With --fit: how many screened variants to compile.")
_SEARCH = flags.DEFINE_bool("search", False, "Find the fastest layout that fits, over every axis (see above).")
_SEARCH_COMPILES = flags.DEFINE_integer("search_compiles", 8, "With --search: layouts compiled, yours included.")
_FIX = flags.DEFINE_multi_string("fix", [], "With --search: hold a layout key, e.g. --fix mesh.tensor=4.")
_TRIAL = flags.DEFINE_integer("trial", 0, "With --search: time each finalist this many steps here, pick by that.")
_TOP = flags.DEFINE_integer("top", 10, "With --search: rows of the predicted table.")
_SHARDING = flags.DEFINE_bool(
    "sharding", False, "Also print where each parameter lives and the step's collectives (from its HLO)."
)


def print_sharding(result):
    mib = 2**20
    rows = [(r["name"], str(tuple(r["shape"])), ",".join(r["logical"]), r["spec"], f"{r['bytes_per_device'] / mib:.2f}")
            for r in result["sharding"]]  # fmt: skip
    header = ("parameter", "shape", "logical axes", "mesh placement", "MiB/device")
    widths = [max(len(x) for x in col) for col in zip(header, *rows, strict=True)]
    for row in (header, *rows):
        print("  ".join(x.ljust(w) if i < 4 else x.rjust(w) for i, (x, w) in enumerate(zip(row, widths, strict=True))))
    state = result["state_bytes_per_device"]
    print(f"per device: parameters {state['params'] / mib:.1f} MiB, optimiser state {state['optimizer'] / mib:.1f} MiB")


def print_target(result):
    gib, hbm, usable = 2**30, result["hbm_bytes_per_device"], result["usable_hbm_bytes_per_device"]
    if "out_of_memory" in result:
        needed = result["compiled_bytes_per_device"]
        heap = f"a heap of {needed / gib:.2f} GiB per device, " if needed else ""
        print(f"target            {result['target']} x {result['slices']} ({result['topology']}, {hbm / gib:.0f} GiB "
              f"HBM per device): does NOT fit, {heap}{usable / gib:.2f} usable; the compiler refused: "
              f"{result['out_of_memory']}")  # fmt: skip
        return
    c, used = result["cost"], result["compiled_bytes_per_device"]
    verdict = "fits" if result["fits"] else f"does NOT fit: {(used - usable) / gib:.2f} GiB over"
    if "rollout" in result and not result["fits"] and used <= usable:  # GRPO: the reference, or the rollout
        verdict = "does NOT fit: with the reference beside the step, or in the rollout (above)"
    print(f"target            {result['target']} x {result['slices']} ({result['topology']}, "
          f"{result['devices']} x {result['device_kind']}): {used / gib:.2f} GiB per device "
          f"of {usable / gib:.2f} usable ({hbm / gib:.0f} GiB HBM; {result['usable_hbm_because']}), "
          f"{verdict}")  # fmt: skip
    print(f"cost per device   {c['flops']:.4g} FLOPs, {c['bytes_accessed'] / 1e9:.4g} GB of HBM traffic (from the "
          f"compiled HLO, loops counted); roofline {c['roofline_seconds']:.3g} s a step ({c['bound']}-bound), "
          f"so MFU at most {c['mfu_ceiling']:.0%}")  # fmt: skip
    low = {k: v for k, v in c["matmuls"].items() if k == "s8" or k.startswith("f8")}
    if low:  # model.quant: which of the compiled dots are quantised, and the step's cost without it
        said = ", ".join(f"{v['dots']} {k} dots ({v['flops'] / c['flops']:.0%} of the FLOPs)" for k, v in low.items())
        print(f"quantised         {said}; the roofline takes them at the chip's {'/'.join(low)} rate")
        plain = result.get("cost_unquantised")
        if plain:
            print(f"                  unquantised: {plain['flops']:.4g} FLOPs, {plain['bytes_accessed'] / 1e9:.4g} GB, "
                  f"roofline {plain['roofline_seconds']:.3g} s ({plain['bound']}-bound): quantised "
                  f"{c['roofline_seconds'] / plain['roofline_seconds']:.2f}x; the compiler's model of both, not a "
                  "measurement")  # fmt: skip
    if "sdc_checker" in result:  # train.sdc_check_every: the checked steps' program, compiled beside the step
        checker = result["sdc_checker"]
        flags = " ".join(f"--{k}={str(v).lower()}" for k, v in checker["flags"].items())
        print(f"sdc checker       every {checker['every']} steps: compiled with {flags}: "
              f"{checker['compiled_bytes_per_device'] / gib:.2f} GiB per device")  # fmt: skip
    if c["kernels"]["estimated"]:
        print(f"                  counted by their own cost estimates: {', '.join(c['kernels']['estimated'])}")
    if c["kernels"]["uncounted"]:
        names = ", ".join(c["kernels"]["uncounted"])
        print(f"                  not counted: the FLOPs of {names} (only their operands' and results' bytes): "
              "the FLOPs and roofline above are too low, the MFU ceiling too high")  # fmt: skip


def print_collectives(result):
    mib = 2**20
    measured, textbook = result["collectives"]["measured"], result["collectives"]["textbook"]
    print(f"\n{'collective':<18} {'count':>7} {'result MiB':>12} {'sent MiB':>10} {'textbook sent MiB':>18}")
    for kind in sorted(set(measured) | set(textbook)):
        m = measured.get(kind, {"count": 0, "bytes": 0, "sent": 0})
        print(f"{kind:<18} {m['count']:>7} {m['bytes'] / mib:>12.1f} {m['sent'] / mib:>10.1f} "
              f"{textbook.get(kind, 0) / mib:>18.1f}")  # fmt: skip


def print_fit(search):
    gib = 2**30
    print(
        f"\nfit: {search['considered']} variants, {search['valid']} valid, {search['pass_arithmetic']} fit "
        f"by arithmetic (screened in {search['screen_seconds']:.1f}s); compiled on the target, cheapest first:"
    )
    for c in search["compiled"]:
        changes = " ".join(f"{k}={v}" for k, v in c["changes"].items()) or "(as configured)"
        head = f"  {changes}\n      arithmetic {c['arithmetic_bytes'] / gib:.2f} GiB, "
        if c["out_of_memory"]:
            print(f"{head}the compiler refused ({c['out_of_memory']})")
            continue
        verdict = "fits" if c["fits"] else "does NOT fit"
        print(f"{head}XLA {c['compiled_bytes_per_device'] / gib:.2f} GiB {verdict}; roofline "
              f"{c['roofline_seconds']:.3g} s ({c['bound']}-bound), recompute +{c['recompute']:.0%}; "
              f"compiled in {c['compile_seconds']:.0f}s")  # fmt: skip
    best = search["best"]
    if best is None:
        print("none of the compiled variants fits; try --fit_compiles with a larger number, or more chips.")
        return
    print(f"fastest that fits: roofline {best['roofline_seconds']:.3g} s a step, MFU at most "
          f"{best['mfu_ceiling']:.0%}. Run:\n  {search['command']}")  # fmt: skip


def command_args(changes: dict) -> list[str]:
    """This command's --config flags with `changes` applied, for train.py."""
    kept = [a for a in cli.config_args(sys.argv[1:]) if a.split("=")[0].removeprefix("--config.") not in changes]
    return kept + [f"--config.{k}={v}" for k, v in changes.items()]


def print_scaling(result):
    t = result["training"]
    if "chinchilla_tokens" in result:  # pretraining; a fine-tune is sized by its own train.steps
        print(f"Chinchilla        {result['chinchilla_tokens']:.3g} tokens (20 per parameter); Hoffmann et al.'s "
              f"fit predicts loss {result['chinchilla_fit_loss']:.3f} there")  # fmt: skip
    print(f"{t['objective']:17s} {t['tokens']:.3g} tokens = {t['steps']:,} steps = {t['flops']:.3g} FLOPs: "
          f"{_duration(t['seconds'])} on {t['chips']} x {t['chip']} at {t['mfu']:.0%} MFU")  # fmt: skip
    if "budget" in result:
        b, rule, fit = result["budget"], result["budget"]["rule_of_thumb"], result["budget"]["fit"]
        print(f"budget {b['flops']:.3g} FLOPs: {rule['n_params']:.3g} parameters x {rule['tokens']:.3g} tokens "
              f"(20 per parameter), or {fit['n_params']:.3g} x {fit['tokens']:.3g} by the fit "
              f"(loss {fit['loss']:.3f}); {_duration(b['seconds'])} on {t['chips']} x {t['chip']}")  # fmt: skip


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.2g} seconds"
    if seconds < 3600:
        return f"{seconds / 60:.1f} minutes"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.1f} hours"
    return f"{seconds / 86400:.1f} days"


def print_rollout(r: dict) -> None:
    """GRPO's sampling of a batch of completions: its own program, beside the step's."""
    gib, m = 2**30, r["bytes_per_device"]
    print(f"rollout           {m['total'] / gib:.2f} GiB a device by arithmetic: " + ", ".join(
        f"{k.replace('_', ' ')} {v / gib:.2f}" for k, v in m.items() if k != "total"))  # fmt: skip
    if "compiled_bytes_per_device" in r:
        verdict = "" if "fits" not in r else " (fits)" if r["fits"] else " (does NOT fit)"
        refused = f"; the compiler refused: {r['out_of_memory']}" if "out_of_memory" in r else ""
        print(f"                  {r['compiled_bytes_per_device'] / gib:.2f} GiB compiled (the sampler's program) + "
              f"{r['resident_bytes_per_device'] / gib:.2f} resident beside it (optimiser state, reference){verdict}"
              f"{refused}")  # fmt: skip


def print_search(r: dict) -> None:
    gib = 2**30
    print(f"search            {r['where']} ({r['devices']} x {r['device_kind']}, judged as {r['chip']}): "
          f"{r['considered']:,} layouts over {r['meshes']} meshes, {r['fit_arithmetic']:,} fit by arithmetic "
          f"(screened in {r['screen_seconds']:.1f} s)")  # fmt: skip
    for axis, why in r["not_searched"].items():
        print(f"not searched      {axis}: {why}")
    if r["fixed"]:
        print("fixed             " + " ".join(f"{k}={v}" for k, v in r["fixed"].items()))
    print("assumed           " + "\n                  ".join(r["assumptions"]))
    columns = f"{'':>3} {'layout':<64} {'GiB':>6} {'compute':>8} {'memory':>7} {'collect.':>8} {'step s':>7} {'MFU':>5}"
    print(f"\npredicted by arithmetic, fastest first (seconds a step; collectives: exposed + overlapped):\n"
          f"{columns}  bottleneck")  # fmt: skip
    for i, row in enumerate(r["top"][: _TOP.value], 1):
        p = row["predicted"]
        sent = p["weight_collective_seconds"] + p["activation_collective_seconds"]
        print(f"{i:>3} {row['describe'][:64]:<64} {row['memory_bytes'] / gib:>6.2f} {p['compute_seconds']:>8.3g} "
              f"{p['memory_seconds']:>7.3g} {sent:>8.3g} {p['step_seconds']:>7.3g} {p['mfu']:>5.0%}  "
              f"{p['bottleneck']}")  # fmt: skip
    measured = any(row["measured_seconds"] for row in r["compiled"])
    print(f"\ncompiled ({'XLA' if not r['target'] else r['target']}), as the program runs:\n"
          f"{columns} {'predicted':>9}{' measured' if measured else ''}")  # fmt: skip
    own = r["own"]
    for i, row in enumerate(r["compiled"], 1):
        c, mark = row["compiled"], " (yours)" if row["layout"] == own.get("layout") else ""
        if "step_seconds" not in c:
            print(f"{i:>3} {row['describe'][:64]:<64} does NOT fit: {c.get('out_of_memory') or 'over the HBM'}{mark}")
            continue
        fits = "" if c["fits"] else " does NOT fit"
        sent = c["weight_collective_seconds"] + c["activation_collective_seconds"]
        trial = f" {row['measured_seconds']:>8.3g}" if row["measured_seconds"] else ""
        print(f"{i:>3} {row['describe'][:64]:<64} {c['compiled_bytes_per_device'] / gib:>6.2f} "
              f"{c['compute_seconds']:>8.3g} {c['memory_seconds']:>7.3g} {sent:>8.3g} {c['step_seconds']:>7.3g} "
              f"{c['mfu']:>5.0%} {row['predicted']['step_seconds']:>9.3g}{trial}{fits}{mark}")  # fmt: skip
    if "refused" in own:
        print(f"\nyour layout cannot run here: {own['refused']}")
    best = r["best"]
    if best is None:
        print("\nnone of the compiled layouts fits; raise --search_compiles, or plan a larger target.")
        return
    uncounted = best["compiled"].get("uncounted_kernels")
    if uncounted:
        print(f"\nnot counted in the compiled figures: the FLOPs inside {', '.join(uncounted)}")
    gain = r.get("gain", {})
    if not best["changes"]:
        print("\nyour layout is the fastest that fits; nothing to change.")
        return
    how = "by the trial's measured steps" if best["measured_seconds"] else "on the compiled program"
    if gain.get("own_fits"):
        moved = ", ".join(f"{k} {a / gib:.2f} -> {b / gib:.2f} GiB" for k, (a, b) in gain["collectives_sent"].items()
                          if abs(a - b) > 0.01 * max(a, b))  # fmt: skip
        print(f"\nfastest that fits: {best['describe']}, {gain['speedup']:.2f}x your layout {how}"
              + (f"; sent a device a step: {moved}" if moved else ""))  # fmt: skip
    else:
        print(f"\nfastest that fits: {best['describe']} ({how}; your layout does not fit)")
    print(f"run:\n  {r['command']}\nor put in the config:")
    for line in r["config_lines"]:
        print(f"  {line}")


def config_lines(changes: dict) -> list[str]:
    """A layout's changes as lines of a configs/*.py get_config(), where the config is `c`."""
    return [f"c.{key} = {value!r}" for key, value in changes.items()]


def main():
    # Before JAX starts a backend: a target's devices are libtpu's or the CUDA plugin's descriptions and
    # simulated ones the CPU's, so this machine's own TPU or GPU is never started. JAX has already read the
    # JAX_PLATFORMS variable (trainer.run.cli imports it), hence its option; XLA_FLAGS is read when the CPU starts.
    import jax  # (trainer imported it, without the plugins' noise)

    if _TARGET.value or _SIMULATE.value:
        jax.config.update("jax_platforms", "cpu")
    if _SIMULATE.value:
        accelerators.simulate_devices(_SIMULATE.value)
    accelerators.start()  # the backends this plan may use, started without the others' noise
    if _SEARCH.value:
        return search()
    from trainer.planning.plan import plan

    result = plan(_CONFIG.value, compile_step=not _NO_COMPILE.value, sharding=_SHARDING.value, tokens=_TOKENS.value,
                  budget=_BUDGET.value, chip=_CHIP.value, chips=_CHIPS.value, mfu=_MFU.value, target=_TARGET.value,
                  slices=_SLICES.value, fit=_FIT.value, fit_compiles=_FIT_COMPILES.value)  # fmt: skip
    if "fit" in result and result["fit"]["best"]:
        result["fit"]["command"] = "python scripts/train.py " + " ".join(command_args(result["fit"]["best"]["changes"]))
    if _JSON.value:
        print(json.dumps(result))
        return
    gib = 2**30
    active = result["n_params_active"]
    routed = f", {active:,} active per token" if active != result["n_params"] else ""
    print(f"parameters        {result['n_params']:,} ({result['n_params_non_embedding']:,} non-embedding{routed})")
    if result["n_params_trained"] != result["n_params"]:  # model.lora: the adapters train, the base is frozen
        trained = result["n_params_trained"]
        print(
            f"trained           {trained:,} adapter parameters ({100 * trained / (result['n_params'] - trained):.3f}% "
            "of the frozen base's); optimiser state over them alone"
        )
    print(f"FLOPs per token   {result['flops_per_token']:.4g}  = {result['flops_formula']}")
    print(f"FLOPs per step    {result['flops_per_step']:.4g}  ({result['tokens_per_step']:,} tokens)")
    print(f"mesh              {result['mesh']} on {result['devices']} x {result['device_kind']}")
    if "pipeline" in result:
        p, mib = result["pipeline"], 2**20
        state = p["state_bytes_per_device"]
        print(
            f"pipeline          {p['stages']} stages x {p['layers_per_stage']} layers, "
            f"{p['pipeline_microbatches']} pipeline microbatches; "
            f"bubble {p['bubble_fraction']:.1%} = {p['bubble_formula']}"
        )
        print(
            f"per stage device  parameters {state['params'] / mib:.1f} MiB, "
            f"optimiser state {state['optimizer'] / mib:.1f} MiB (the compiled figure below is per device too)"
        )
    m = result["bytes_per_device"]
    print(f"memory per device {m['total'] / gib:.2f} GiB by arithmetic: " + ", ".join(
        f"{k.replace('_', ' ')} {v / gib:.2f}" for k, v in m.items() if k != "total"))  # fmt: skip
    low, high = result["heap_interval_bytes"]
    print(f"                  a TPU heap of {low / gib:.2f} to {high / gib:.2f} GiB: the arithmetic's error on "
          "compiles it was not fitted to (35%; docs/planning.md); --target compiles to know")  # fmt: skip
    if "compiled_breakdown" in result:
        b, used = result["compiled_breakdown"], result["compiled_bytes_per_device"]
        if "heap" in b:
            how = f"XLA:TPU's HBM heap (arguments {b['arguments'] / gib:.2f}, live at the peak {b['peak'] / gib:.2f})"
        elif "peak" in b:
            how = f"XLA's peak (arguments {b['arguments'] / gib:.2f})"
        else:
            how = (f"XLA (arguments {b['arguments'] / gib:.2f}, temporaries {b['temporaries'] / gib:.2f}, "
                   f"outputs not aliased {(b['outputs'] - b['aliased']) / gib:.2f})")  # fmt: skip
        kept = " (kept from an earlier compile: train.compile_cache)" if result.get("compile_kept") else ""
        print(f"                  {used / gib:.2f} GiB compiled, {how}; compiled in {result['compile_seconds']:.1f}s"
              f"{kept}")  # fmt: skip
    elif "out_of_memory" in result and "target" not in result:
        needed = result["compiled_bytes_per_device"]
        heap = f"a heap of {needed / gib:.2f} GiB per device; " if needed else ""
        print(f"                  does NOT fit these {result['device_kind']} chips: {heap}the compiler refused: "
              f"{result['out_of_memory']}")  # fmt: skip
    if "rollout" in result:
        print_rollout(result["rollout"])
    if "target" in result:
        print_target(result)
    print_scaling(result)
    if "sharding" in result:
        print_sharding(result)
    if "collectives" in result:
        print_collectives(result)
    if "fit" in result:
        print_fit(result["fit"])


def search():
    from trainer.planning import layout
    from trainer.planning.search import parse_fixed

    cfg = _CONFIG.value
    progress = (lambda line: print(line, file=sys.stderr, flush=True)) if _JSON.value else (
        lambda line: print(line, flush=True))  # fmt: skip
    report = layout.run(cfg, target=_TARGET.value, slices=_SLICES.value, fixed=parse_fixed(_FIX.value, cfg),
                        compiles=_SEARCH_COMPILES.value, trial=_TRIAL.value, chip=_CHIP.value,
                        devices=None if _TARGET.value else jax_devices(), progress=progress)  # fmt: skip
    if report["best"] is not None:
        changes = report["best"]["changes"]
        report["command"] = "python scripts/train.py " + " ".join(command_args(changes))
        report["config_lines"] = config_lines(changes)
    if _JSON.value:
        print(json.dumps(report))
        return
    print_search(report)


def jax_devices():
    import jax

    return jax.devices()


if __name__ == "__main__":
    cli.run(main, uses_devices=False)
