"""What a config costs before it runs: parameters, FLOPs, and compiled memory per device.

The train step is compiled ahead of time on abstract inputs (shapes and
shardings, no arrays), so a 1B model can be planned on a laptop with simulated
devices. XLA's memory figures are per device: on a TPU target the HBM heap
XLA:TPU assigns (the state and batch, and the block of temporaries the
runtime allocates), judged against what the chip offers a program; on
simulated CPUs arguments, outputs not aliased to donated inputs, and
temporaries (trainer/training/step.py, memory_per_device).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import time

import jax
import jax.numpy as jnp

from parallelism import collectives, hlo, pipeline
from parallelism.chips import CHIPS, gpu_memory_share
from trainer.config import microbatch_size
from trainer.config.errors import ConfigError
from trainer.config.forms import with_changes
from trainer.model.flops import FORMULA, count_params, inactive_params, matmul_params
from trainer.model.sampling import make_generate
from trainer.model.splash import hlo_call_cost
from trainer.planning import fit as fitting
from trainer.planning import memory, scaling
from trainer.planning.targets import Target, check_kernel_compiles, parse_target, target_devices
from trainer.storage import compile_cache
from trainer.training import rollouts, sdc
from trainer.training.setup import build
from trainer.training.state import param_shardings
from trainer.training.step import OutOfHbm, compile_with_heap


def moe_volumes(cfg, abstract_params: dict, mesh_shape: dict[str, int]) -> dict:
    """collectives.textbook's MoE arguments: every expert's weights, the MoE layers, top-k, and the exchange's
    buffer over its copies (a capacity's factor; dropless pads each destination's room to all of them)."""
    m = cfg.model.moe
    if not m.num_experts:
        return {}
    stacks = [layers["moe"] for layers in abstract_params.values() if isinstance(layers, dict) and "moe" in layers]
    exchanged = m.capacity_factor if m.impl == "capacity" else mesh_shape.get("expert", 1)
    return {"expert_params": sum(math.prod(e[w].shape) for e in stacks for w in ("w_gate", "w_up", "w_down")),
            "moe_layers": (cfg.model.n_layers - m.dense_layers) // m.every, "experts_per_token": m.experts_per_token,
            "exchanged": exchanged, "recomputed": cfg.model.remat != "none"}  # fmt: skip


# What a plan reads from a kept compile beyond the lowered program, which its key (the lowered text, without
# op names) cannot see: a new value makes compiles kept before it stale. 2: the op names of a local layer's
# splash calls carry its window (splash.hlo_call_cost).
KEPT_READS = "2"


def plan(cfg, *, compile_step: bool = True, devices=None, sharding: bool = False, tokens: float = 0,
         budget: float = 0, chip: str = "h100", chips: int = 0, mfu: float = 0.4, target: str = "",
         slices: int = 1, fit: bool = False, fit_compiles: int = 3, on_chip: bool = False) -> dict:  # fmt: skip
    """Counts, FLOPs, memory per device from arithmetic and, with `compile_step`, from XLA; the
    Chinchilla-optimal tokens and the time to train `tokens` (default: those) on `chips` x `chip`
    at `mfu`; with `budget` (FLOPs), the compute-optimal model for it; with `sharding`, where
    every parameter lives and what the compiled step communicates, beside the textbook volumes.
    With `target` (a Cloud TPU type, e.g. 'v5e-4', or GPU hosts, 'h100-8') and `slices`, the step is
    compiled by that hardware's compiler for its devices: memory against the chip's HBM, cost and roofline
    too; with `fit`, when it does not fit, the fastest variant that does (trainer/planning/fit.py). With
    `on_chip` and no target, the step compiled for the given devices is judged as if they were `chip`s: its
    fit against that chip's HBM and its cost at its rates (plan.py --search on this machine's devices)."""
    compile_cache.use(compile_cache.place(cfg.train.compile_cache, None))
    hardware = parse_target(target) if target else None
    if hardware is not None:
        chip = hardware.chip_name
    if chip not in CHIPS:
        raise ConfigError(f"unknown chip '{chip}'; the peak table knows {', '.join(CHIPS)}.")
    if not 0 < mfu <= 1 or tokens < 0 or budget < 0:
        raise ConfigError(f"--mfu must lie in (0, 1] (got {mfu}); --tokens and --budget cannot be negative.")
    if fit and hardware is None:
        raise ConfigError("--fit searches for what fits a target's memory; name the hardware with --target.")
    if fit:
        fitting.check(cfg, fit_compiles)
    if hardware is not None:
        if compile_step:
            check_kernel_compiles(cfg, hardware)
        devices = target_devices(hardware, slices) if devices is None else devices
    setup = build(cfg, devices)
    t, seq = cfg.train, cfg.data.seq_len
    counts = count_params(setup.model.abstract_params)
    fpt = setup.flops_per_token()
    result = {
        "n_params": counts["total"],
        "n_params_non_embedding": counts["non_embedding"],
        "n_params_embedding": counts["embedding"],
        "n_params_active": counts["total"] - inactive_params(setup.spec.arch, setup.model.abstract_params),
        "n_params_trained": sum(x.size for x in jax.tree.leaves(setup.abstract_state().params)),
        "flops_per_token": fpt,
        "flops_formula": FORMULA
        + " + DPO's reference forward, a third of it" * setup.preference
        + " + the teacher's forward, 2 N_teacher + its attention (distill.mode=online)" * bool(setup.teacher)
        + " (a local layer's keys: its window's; latent attention's head_dim: (qk + v) / 2)"
        * bool(setup.spec.arch.sliding_window or setup.spec.arch.mla.kv_rank)
        + " + the MTP modules' head and attention" * bool(setup.spec.arch.mtp.depth)
        + " - the frozen weights' gradients, 2N (model.lora)" * setup.adapted,
        "tokens_per_step": t.global_batch_size * seq,
        "flops_per_step": fpt * t.global_batch_size * seq,
        "mesh": dict(setup.mesh.shape),
        "devices": setup.mesh.size,
        "device_kind": setup.mesh.devices.flat[0].device_kind,
    }
    result["bytes_per_device"] = memory.bytes_per_device(cfg, setup)
    result["heap_interval_bytes"] = memory.heap_interval(result["bytes_per_device"]["total"])
    chips = chips or setup.mesh.size
    # Pretraining from scratch is sized by Chinchilla; a fine-tune (from another run's weights, on conversations,
    # preferences or prompts, or adapters) is sized by its own train.steps, and Chinchilla says nothing of it.
    pretraining = not (cfg.checkpoint.init_from or setup.adapted or cfg.data.format != "text")
    if pretraining:
        result["chinchilla_tokens"] = scaling.TOKENS_PER_PARAM * counts["total"]
        result["chinchilla_fit_loss"] = float(scaling.CHINCHILLA.loss(counts["total"], result["chinchilla_tokens"]))
    run_tokens = tokens or (result["chinchilla_tokens"] if pretraining else t.steps * result["tokens_per_step"])
    result["training"] = {
        "objective": "pretraining" if pretraining else "fine-tuning",
        "tokens": run_tokens,
        "flops": fpt * run_tokens,
        "steps": math.ceil(run_tokens / result["tokens_per_step"]),
        "chip": chip,
        "chips": chips,
        "mfu": mfu,
        "seconds": scaling.seconds_to_train(fpt * run_tokens, chip, chips, mfu),
    }
    if budget:
        result["budget"] = {
            "flops": budget,
            "rule_of_thumb": scaling.rule_of_thumb_optimum(budget),
            "fit": scaling.CHINCHILLA.optimum(budget),
            "seconds": scaling.seconds_to_train(budget, chip, chips, mfu),
        }
    if cfg.mesh.stage > 1:
        result["pipeline"] = pipeline_plan(cfg, setup)
    if not compile_step:
        return result
    start = time.perf_counter()
    lowered = setup.train_step().lower(setup.abstract_state(), setup.abstract_batch(), *setup.step_inputs())
    platform = setup.mesh.devices.flat[0].platform
    if hardware is None:
        compiled = _compiled(lowered, platform)
    else:  # minutes on a TPU topology: what the plan reads from it is kept (trainer/storage/compile_cache.py)
        devices_here = setup.mesh.devices.flatten().tolist()
        key = [lowered.as_text(), target, str(slices), str(len(devices_here)), devices_here[0].device_kind,
               os.environ.get("XLA_FLAGS", ""), KEPT_READS]  # fmt: skip
        compiled, result["compile_kept"] = compile_cache.remembered(
            "plans", key, lambda: _compiled(lowered, platform, aside=True)
        )
    if "out_of_memory" in compiled:
        # XLA:TPU refuses to compile a step whose heap exceeds the chip's HBM: for a plan that is the
        # verdict, with the heap it needed, not a failure (for a target, or a TPU VM's own chips).
        result.update(fits=False, compiled_bytes_per_device=compiled["heap"], out_of_memory=compiled["out_of_memory"])
        if hardware is not None:
            result.update(target_fields(hardware, slices))
        compiled = None
    result["compile_seconds"] = time.perf_counter() - start
    if compiled is not None:
        breakdown = dict(compiled["breakdown"])
        result["compiled_bytes_per_device"] = breakdown.pop("total")
        result["compiled_breakdown"] = breakdown
        if hardware is None and on_chip:
            result.update(judged(CHIPS[chip], compiled["hlo"], result))
        if hardware is not None:
            result.update(on_target(hardware, slices, compiled["hlo"], result))
            if cfg.train.sdc_check_every and platform == "tpu":  # the checked steps' program beside the step's
                result["sdc_checker"] = {"every": cfg.train.sdc_check_every,
                                         **_checked(lowered, hardware, compiled["hlo"])}  # fmt: skip
            if cfg.model.quant.matmul:  # the same step unquantised, compiled too: the cost beside its own
                plain = with_changes(cfg, {"model.quant.matmul": ""})
                result["cost_unquantised"] = plan(plain, devices=devices, target=target, slices=slices).get("cost")
    if cfg.data.format == "prompts":  # GRPO: the rollout's program beside the step's
        result["rollout"] = rollout_plan(cfg, setup, platform, hardware, slices)
        if "fits" in result and "compiled_breakdown" in result:  # the reference sits beside the step too
            beside = result["rollout"]["bytes_per_device"].get("reference", 0)
            step_fits = result["compiled_bytes_per_device"] + beside <= hardware.chip.usable_hbm_bytes
            result["fits"] = step_fits and result["rollout"].get("fits", True)
    if fit and not result["fits"]:
        n_matmul = matmul_params(setup.spec.arch, setup.model.abstract_params)
        compile_variant = lambda variant: plan(variant, devices=devices, target=target, slices=slices)  # noqa: E731
        result["fit"] = fitting.search(cfg, devices, hardware.chip.usable_hbm_bytes, n_matmul, compile_variant,
                                       fit_compiles)  # fmt: skip
    if compiled is None:
        return result
    if sharding:
        result["sharding"] = sharding_table(setup)
    if sharding or hardware is not None or on_chip:
        result["state_bytes_per_device"] = memory.state_bytes(setup)
        result["collectives"] = {
            "measured": collectives.parse(compiled["hlo"]),
            "textbook": collectives.textbook(
                counts["total"],
                dict(setup.mesh.shape),
                n_layers=cfg.model.n_layers,
                d_model=cfg.model.d_model,
                seq_len=seq,
                micro_rows=microbatch_size(cfg),
                microbatches=t.grad_accum_steps,
                act_bytes=jnp.dtype(cfg.precision.compute_dtype).itemsize,
                kv_width=setup.spec.arch.n_kv_heads * setup.spec.arch.head_dim,
                context_attention=cfg.model.context_attention,
                **moe_volumes(cfg, setup.model.abstract_params, dict(setup.mesh.shape)),
            ),  # fmt: skip
        }
    return result


def rollout_plan(cfg, setup, platform: str, hardware: Target | None, slices: int) -> dict:
    """A GRPO rollout's memory per device: the arithmetic (memory.rollout_bytes) and the sampler's program
    compiled for the same devices (trainer/model/sampling.py, the batch of completions at once), whose
    arguments hold the weights but not what stays resident beside it (the optimiser state, and the
    reference with rl.beta), added for the verdict as `resident_bytes_per_device`."""
    rl, rows = cfg.rl, cfg.train.global_batch_size
    arithmetic = memory.rollout_bytes(cfg, setup)
    out = {"bytes_per_device": arithmetic}
    generate = make_generate(setup.spec, setup.shard, max_new_tokens=rl.max_new_tokens, temperature=rl.temperature,
                             top_p=rl.top_p, with_logprobs=True, split_batch=True)  # fmt: skip
    prompt = jax.ShapeDtypeStruct((rows, cfg.data.seq_len - rl.max_new_tokens), jnp.int32)
    keys = jax.eval_shape(lambda: rollouts.row_keys(0, 0, rows // rl.group_size, rl.group_size))
    lowered = generate.lower(setup.abstract_params(), prompt, 0, jax.ShapeDtypeStruct((rows,), jnp.int32), keys)
    compiled = _compiled(lowered, platform, aside=hardware is not None)
    resident = arithmetic["optimizer"] + arithmetic.get("reference", 0)
    out["resident_bytes_per_device"] = resident
    if "out_of_memory" in compiled:
        return {**out, "fits": False, "compiled_bytes_per_device": compiled["heap"],
                "out_of_memory": compiled["out_of_memory"]}  # fmt: skip
    breakdown = dict(compiled["breakdown"])
    out["compiled_bytes_per_device"], out["compiled_breakdown"] = breakdown.pop("total"), breakdown
    if hardware is not None:
        out["fits"] = out["compiled_bytes_per_device"] + resident <= hardware.chip.usable_hbm_bytes
    return out


def _compiled(lowered, platform: str, aside: bool = False) -> dict:
    """What a plan reads from the compiled step: its HLO text and XLA's memory per device, or the
    compiler's refusal and the heap it needed. `aside`: a target's executable, which no device here could
    load, is not kept."""
    try:
        with compile_cache.standing_aside() if aside else contextlib.nullcontext():
            compiled, breakdown = compile_with_heap(lowered, platform)
    except OutOfHbm as e:
        return {"out_of_memory": str(e), "heap": e.heap}
    return {"hlo": compiled.as_text(), "breakdown": breakdown}


def _checked(lowered, hardware: Target, step_hlo: str) -> dict:
    """The step compiled with libtpu's silent-data-corruption checker (trainer/training/sdc.py): its flags, its
    heap, and whether the compiled program differs from the step's (the checker acts below the HLO: only
    its schedule's configuration shows)."""
    options = sdc.compiler_options(hardware.chip_name)
    with compile_cache.standing_aside():
        compiled, breakdown = compile_with_heap(lowered, "tpu", options)
    return {"flags": options, "compiled_bytes_per_device": breakdown["total"],
            "differs_from_step": compiled.as_text() != step_hlo}  # fmt: skip


def on_target(hardware: Target, slices: int, compiled_hlo: str, result: dict) -> dict:
    """The verdict against the chip's HBM, and the cost read from the compiled HLO with its roofline.

    XLA's cost_analysis() counts a loop body once (a 71x under-count for
    llm_1b's scans), so FLOPs and HBM bytes come from the HLO with loops counted
    by their trips (parallelism/hlo.py). The roofline is the larger of FLOPs /
    peak and bytes / bandwidth: no step can be faster; the MFU ceiling is the
    model FLOPs per device over what the chip can do in that time.
    """
    return {**target_fields(hardware, slices), **judged(hardware.chip, compiled_hlo, result)}


def judged(chip, compiled_hlo: str, result: dict) -> dict:
    """on_target's verdict and cost, on any chip of parallelism/chips.py."""
    used, cost = result["compiled_bytes_per_device"], hlo_cost(hlo.read(compiled_hlo), chip)
    roofline = cost["roofline_seconds"]
    model_flops = result["flops_per_step"] / result["devices"]
    cost["mfu_ceiling"] = model_flops / (chip.peak_flops * roofline) if roofline else 0.0
    return {"fits": used <= chip.usable_hbm_bytes, "cost": cost}


def hlo_cost(module: hlo.Module, chip) -> dict:
    """FLOPs and HBM bytes of a compiled step, ours or another program's (benchmarks/vs_maxtext.py): the
    HLO's matmuls and traffic with loops counted by their trips, and its Pallas kernels by their schedule;
    the roofline on `chip` (parallelism/chips.py) is whichever of FLOPs / peak and bytes / bandwidth is longer."""
    kernels, matmuls = kernel_cost(module), hlo.matmuls_by_operand(module)
    flops = sum(f for f, _ in matmuls.values()) + kernels["flops"]
    traffic = hlo.bytes_accessed(module) + kernels["bytes"]
    # Quantised training's dots (trainer/model/low_precision.py) at the chip's int8 or fp8 rate, if it has one.
    low = {"s8": chip.int8_ops, "f8e4m3fn": chip.fp8_ops, "f8e5m2": chip.fp8_ops}
    dots = sum(f / (low.get(kind) or chip.peak_flops) for kind, (f, _) in matmuls.items())
    compute_seconds = kernels["flops"] / chip.peak_flops + dots
    memory_seconds = traffic / chip.hbm_bytes_per_second
    return {
        "flops": flops,
        "matmuls": {kind: {"flops": f, "dots": n} for kind, (f, n) in sorted(matmuls.items())},
        "bytes_accessed": traffic,
        "kernels": kernels,
        "compute_seconds": compute_seconds,
        "memory_seconds": memory_seconds,
        "roofline_seconds": max(compute_seconds, memory_seconds),
        "bound": "compute" if compute_seconds >= memory_seconds else "memory",
    }


# A Pallas call's own estimate, in its backend config: "cost_estimate":{"flops":"N",...,"bytes_accessed":"B"
_COST_ESTIMATE = re.compile(r'"cost_estimate":\{"flops":"(\d+)"[^}]*?"bytes_accessed":"(\d+)"')


def kernel_cost(module: hlo.Module) -> dict:
    """FLOPs and HBM bytes of the step's Pallas kernels, each splash call counted from the kernel's own
    schedule (trainer/model/splash.py); a kernel of another kind by the cost estimate its author gave
    pallas_call, which the call carries in its backend config (megablox's gmm: 2 x rows x d x n, every row
    of its operand counted), named in `estimated`; one with neither as reading its operands and writing its
    results once, with no FLOPs, named in `uncounted`."""
    out = {"calls": 0, "flops": 0.0, "bytes": 0.0, "estimated": [], "uncounted": []}
    for inst, times in hlo.custom_kernels(module):
        cost = hlo_call_cost(inst.line)
        estimate = _COST_ESTIMATE.search(inst.line)
        if cost is None and estimate:
            cost = (float(estimate.group(1)), float(estimate.group(2)))
            out["estimated"] = sorted({*out["estimated"], inst.name.split(".")[0]})
        if cost is None:
            # The operands' shapes are written out in the call's layout constraints, up to their closing "}}".
            operands = inst.rest.partition("operand_layout_constraints=")[2].partition("}}")[0]
            cost = (0.0, hlo.array_bytes(inst.shape) + hlo.array_bytes(operands))
            out["uncounted"] = sorted({*out["uncounted"], inst.name.split(".")[0]})
        out["calls"] += times
        out["flops"] += times * cost[0]
        out["bytes"] += times * cost[1]
    return out


def target_fields(hardware: Target, slices: int) -> dict:
    """Where the verdict's limit comes from: what XLA:TPU offers a program, or what JAX's allocator lets a
    process hold of a GPU (parallelism/chips.py), which a plan that fits the whole HBM can still exceed."""
    usable = "what XLA:TPU offers a program" if not hardware.is_gpu else gpu_memory_share()[1]
    return {"target": hardware.name, "topology": hardware.topology, "slices": slices,
            "hbm_bytes_per_device": hardware.chip.hbm_bytes,
            "usable_hbm_bytes_per_device": hardware.chip.usable_hbm_bytes, "usable_hbm_because": usable}  # fmt: skip


def pipeline_plan(cfg, setup) -> dict:
    """The GPipe bubble and what each stage holds (every device of a stage holds the same)."""
    stages, m = cfg.mesh.stage, cfg.train.pipeline_microbatches
    return {
        "stages": stages,
        "pipeline_microbatches": m,
        "layers_per_stage": cfg.model.n_layers // stages,
        "bubble_fraction": pipeline.bubble_fraction(stages, m),
        "bubble_formula": "(stages - 1) / (pipeline_microbatches + stages - 1)",
        "state_bytes_per_device": memory.state_bytes(setup),
    }


def sharding_table(setup) -> list[dict]:
    """One row per parameter: shape, logical axes, mesh placement and bytes on each device."""
    shardings = param_shardings(setup.model, setup.shard)
    names = dict(jax.tree_util.tree_leaves_with_path(setup.model.logical_names, is_leaf=lambda x: isinstance(x, tuple)))
    rows = []
    for (path, array), sharding in zip(
        jax.tree_util.tree_leaves_with_path(setup.model.abstract_params), jax.tree.leaves(shardings), strict=True
    ):
        shard = sharding.shard_shape(array.shape)
        rows.append({
            "name": ".".join(str(k.key) for k in path),
            "shape": list(array.shape),
            "logical": list(names[path]),
            "spec": str(tuple(sharding.spec)),
            "bytes_per_device": math.prod(shard) * array.dtype.itemsize,
        })  # fmt: skip
    return rows
