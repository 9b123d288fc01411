"""plan.py --search: the fastest layout of a config on a target that fits, searched over every axis we support.

A layout changes how the step is computed and placed, never what it computes: the same model, global batch,
data and schedule. Its keys (LAYOUT_KEYS) are the mesh's axes within a slice (stage, data, fsdp, expert,
context, tensor, with sequence parallelism beside tensor), the slices' split (dcn_data, dcn_fsdp), the
pipeline's microbatches, context attention's exchange (ring or all_gather), the remat policy, gradient
accumulation, the chunked loss, the moments' dtype and the attention kernel the target offers.

Three rounds:
1. screen: every layout is built (one setup per mesh, whose checks refuse what cannot work), its memory
   counted (trainer/planning/memory.py) and its step predicted (trainer/planning/cost.py); those that fit
   the chip's HBM by arithmetic are ranked by predicted time. Accumulation only adds work, so each layout
   takes the fewest microbatches that fit; bfloat16 moments only where float32 fits nowhere on that mesh.
2. compile: the user's own layout and the best predicted, up to `compiles` in all, are compiled for the
   target and ranked again by the compiled program (cost.compiled_time). A compile corrects the screen:
   what is left is judged by the arithmetic times XLA's ratio to it seen so far for the same remat policy
   (memory), and the next finalist is the fastest predicted once each stream's prediction is scaled by what
   the compiles of its remat policy and kernel showed (corrected_seconds).
3. trial (optional): each compiled finalist that fits runs `trial` steps on this machine's devices and the
   fastest measured wins.

The user's layout is always compiled, so the answer is never slower on the compiled program than the layout
the user gave.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time

from trainer.config import REMAT_POLICIES
from trainer.config.errors import ConfigError
from trainer.config.forms import flatten, with_changes
from trainer.model.attention import resolve
from trainer.model.flops import count_params, matmul_params
from trainer.planning import cost, memory
from trainer.planning.fit import ACCUMULATION, _loss_chunks, recompute_fraction
from trainer.planning.plan import moe_volumes
from trainer.planning.targets import cudnn_missing
from trainer.training.mesh_fit import check_mesh_fit
from trainer.training.setup import build
from trainer.training.validation import validate

MESH_AXES = ("stage", "data", "fsdp", "expert", "context", "tensor")
LAYOUT_KEYS = (*(f"mesh.{a}" for a in MESH_AXES), "mesh.dcn_data", "mesh.dcn_fsdp", "mesh.sequence_parallel",
               "train.pipeline_microbatches", "model.context_attention", "model.remat", "train.grad_accum_steps",
               "model.loss_chunk", "precision.moments_dtype", "model.attention")  # fmt: skip
TENSOR_MAX = 8  # tensor parallelism stays within a host's or a board's fastest links
STAGE_MAX = 8
CONTEXT_FROM = 16384  # tokens a sequence from which context parallelism is searched when whole sequences fit
KERNELS = {"tpu": ("splash", "xla"), "cuda": ("cudnn", "xla"), "gpu": ("cudnn", "xla")}
ASSUMPTIONS = (
    "compute and HBM traffic overlap: a step takes the longer of the two (the roofline)",
    "the weights' collectives (FSDP gathers and scatters, data and slice all-reduces) overlap with compute "
    "(XLA's latency-hiding scheduler): only what exceeds the roofline counts",
    "the activations' collectives (tensor, context, expert, pipeline sends) do not overlap: the next matmul "
    "waits for them",
    "collectives send at the data sheet's ICI rate per mesh axis (parallelism/chips.py), the slices' share at "
    "its DCN rate",
    "inside a Pallas kernel (splash) the model counts the matmuls' FLOPs, not the kernel's own re-reads",
    "GPipe is the one pipeline schedule the stage axis runs (parallelism/pipeline.py)",
)


@dataclasses.dataclass
class Candidate:
    layout: dict  # every LAYOUT_KEYS key -> its value
    cfg: object
    memory_bytes: int  # the arithmetic's total per device
    predicted: dict  # cost.predict
    parts: dict  # cost.collective_parts, which split the compiled collectives
    model_flops: float  # the model's FLOPs per device a step
    compiled: dict | None = None
    measured_seconds: float | None = None


def layout_of(cfg, setup=None) -> dict:
    """The layout keys' values in `cfg`, the mesh's as built (fsdp=-1 resolved) when `setup` is given."""
    values = flatten(cfg)
    out = {k: values[k] for k in LAYOUT_KEYS}
    if setup is not None:
        shape = dict(setup.mesh.shape)
        dcn = {"data": cfg.mesh.dcn_data, "fsdp": cfg.mesh.dcn_fsdp, "context": cfg.mesh.dcn_context}
        out.update({f"mesh.{a}": shape[a] // dcn.get(a, 1) for a in MESH_AXES})
    return out


def parse_fixed(texts: list[str], cfg) -> dict:
    """--fix mesh.tensor=4 ... -> {"mesh.tensor": 4}; a key outside the layout is refused by name."""
    values, out = flatten(cfg), {}
    for text in texts:
        key, sep, value = text.partition("=")
        if not sep or key not in LAYOUT_KEYS:
            raise ConfigError(f"--fix {text}: fix a layout key as KEY=VALUE, one of {', '.join(LAYOUT_KEYS)}.")
        kind = type(values[key])
        out[key] = value.lower() in ("1", "true", "yes") if kind is bool else kind(value)
    return out


def divisors(n: int, limit: int | None = None) -> list[int]:
    return [d for d in range(1, (limit or n) + 1) if n % d == 0]


def kernels(cfg, platform: str) -> tuple[str, ...]:
    """The attention kernels searched: the target's fused one and XLA's (XLA's alone for a GPU where cuDNN cannot
    be compiled here); on a CPU the config's own."""
    if platform in KERNELS and "cudnn" in KERNELS[platform] and cudnn_missing():
        return ("xla",)
    return KERNELS.get(platform, (resolve(cfg.model.attention, platform),))


def axis_sizes(cfg, per_slice: int, slices: int, platform: str, fixed: dict) -> tuple[dict, dict]:
    """({axis: sizes to try}, {axis: why it is not searched}) before any layout is built."""
    m, a, reasons = cfg.model, cfg.model, {}
    sizes = {"data": divisors(per_slice), "tensor": divisors(per_slice, TENSOR_MAX)}
    sizes["stage"] = [s for s in divisors(per_slice, STAGE_MAX) if a.n_layers % s == 0]
    if m.moe.num_experts:
        sizes["expert"] = [e for e in divisors(per_slice) if m.moe.num_experts % e == 0]
    else:
        sizes["expert"], reasons["expert"] = [1], "the model has no experts (model.moe.num_experts=0)"
    batch, seq = cfg.train.global_batch_size, cfg.data.seq_len
    if m.layer_types and "linear_attention" in m.layer_types:
        sizes["context"] = [1]
        reasons["context"] = "a hybrid's linear-attention layers carry their state through the whole sequence"
    elif seq < CONTEXT_FROM and batch >= per_slice * slices:
        sizes["context"] = [1]
        reasons["context"] = (f"each device holds whole sequences ({batch} of {seq} tokens over {per_slice * slices} "
                              f"devices): splitting one only adds key/value traffic (searched from {CONTEXT_FROM} "
                              "tokens, or a batch smaller than the devices)")  # fmt: skip
    else:
        sizes["context"] = [c for c in divisors(per_slice) if seq % (2 * c) == 0]
    if slices == 1:
        reasons["dcn_data, dcn_fsdp"] = "one slice (--slices N plans N of them)"
    if platform not in KERNELS:
        kernel = kernels(cfg, platform)[0]
        reasons["attention kernel"] = f"this machine's {platform} devices run {kernel} attention only"
    elif kernels(cfg, platform) == ("xla",):
        reasons["attention kernel"] = ("cuDNN's fused attention needs cuDNN's library to compile, which this machine "
                                       "lacks: xla attention alone (search on a GPU host for cudnn)")  # fmt: skip
    for key, value in fixed.items():
        axis = key.removeprefix("mesh.")
        if axis in sizes:
            sizes[axis] = [value] if value != -1 else sizes[axis]
    return sizes, reasons


def meshes(sizes: dict, per_slice: int) -> list[dict]:
    """Every (stage, data, fsdp, expert, context, tensor) of `sizes` over a slice's devices, fsdp the rest."""
    out = []
    for stage, data, expert, context, tensor in itertools.product(
        sizes["stage"], sizes["data"], sizes["expert"], sizes["context"], sizes["tensor"]
    ):
        used = stage * data * expert * context * tensor
        if per_slice % used == 0:
            out.append(dict(stage=stage, data=data, fsdp=per_slice // used, expert=expert, context=context,
                            tensor=tensor))  # fmt: skip
    return out


def splits(slices: int) -> list[tuple[int, int]]:
    """(dcn_data, dcn_fsdp) over `slices`."""
    return [(d, slices // d) for d in divisors(slices)]


@dataclasses.dataclass
class Basis:
    """What every layout on one built mesh shares: its setup, state bytes and the model's counts."""

    setup: object
    state: dict
    moe: dict
    counts: dict  # the parameters, and every expert's among them
    flops_per_token: float
    n_matmul: int

    @classmethod
    def of(cls, cfg, setup) -> Basis:
        moe = moe_volumes(cfg, setup.model.abstract_params, dict(setup.mesh.shape))
        counts = {"total": count_params(setup.model.abstract_params)["total"],
                  "expert_params": moe.get("expert_params", 0)}  # fmt: skip
        return cls(setup, memory.state_bytes(setup), moe, counts, setup.flops_per_token(),
                   matmul_params(setup.spec.arch, setup.model.abstract_params))  # fmt: skip

    def spec(self, cfg, platform: str):
        """The setup's model spec computed as `cfg` says (the keys a layout varies beside the mesh)."""
        execution = dataclasses.replace(
            self.setup.spec.execution, remat=cfg.model.remat, loss_chunk=cfg.model.loss_chunk,
            attention=resolve(cfg.model.attention, platform), context_attention=cfg.model.context_attention,
            pipeline_microbatches=cfg.train.pipeline_microbatches)  # fmt: skip
        return dataclasses.replace(self.setup.spec, execution=execution)

    def memory(self, cfg, platform: str) -> int:
        held = _moments_state(self.state, self.setup.cfg.precision.moments_dtype, cfg.precision.moments_dtype)
        return memory.bytes_per_device(cfg, self.setup, self.spec(cfg, platform), held)["total"]

    def candidate(self, changes: dict, cfg, chip, platform: str, total: int) -> Candidate:
        spec = self.spec(cfg, platform)
        held = _moments_state(self.state, self.setup.cfg.precision.moments_dtype, cfg.precision.moments_dtype)
        shape = dict(self.setup.mesh.shape)
        activations = memory.activation_bytes(cfg, spec, shape, platform, held["params"] + held.get("frozen", 0))
        recompute = recompute_fraction(cfg, spec, self.n_matmul)
        predicted = cost.predict(cfg, self.setup, spec, chip, self.counts, held, activations, self.flops_per_token,
                                 recompute, self.moe)  # fmt: skip
        parts = cost.collective_parts(cfg, self.setup, spec, self.counts, self.moe)
        tokens = cfg.train.global_batch_size * cfg.data.seq_len / self.setup.mesh.size
        return Candidate(changes, cfg, total, predicted, parts, self.flops_per_token * tokens)


def screen(cfg, devices, chip, slices: int, fixed: dict) -> dict:
    """Round 1: every layout built, counted and predicted; those that fit by arithmetic, fastest first."""
    start = time.perf_counter()
    platform = devices[0].platform
    per_slice = len(devices) // slices
    sizes, reasons = axis_sizes(cfg, per_slice, slices, platform, fixed)
    refusals: dict[str, str] = {}  # axis -> a sentence refusing a size above 1 with every other axis at 1
    valid_sizes: dict[str, set] = {a: set() for a in MESH_AXES}
    found, considered, built, hbm = [], 0, 0, chip.usable_hbm_bytes
    for mesh, (dcn_data, dcn_fsdp) in itertools.product(meshes(sizes, per_slice), splits(slices)):
        layout = {f"mesh.{a}": v for a, v in mesh.items()} | {"mesh.dcn_data": dcn_data, "mesh.dcn_fsdp": dcn_fsdp}
        layout["mesh.sequence_parallel"] = fixed.get("mesh.sequence_parallel", mesh["tensor"] > 1)
        if any(k in fixed and fixed[k] != v for k, v in layout.items()):
            continue
        microbatches = [1] if mesh["stage"] == 1 else [mesh["stage"] * k for k in (1, 2, 4)]
        try:
            # The mesh's own checks, on a batch every size divides (each microbatch is checked below).
            batch = cfg.train.global_batch_size * math.prod(mesh.values()) * slices
            probe = with_changes(cfg, {**layout, "train.pipeline_microbatches": microbatches[0],
                                       "train.grad_accum_steps": 1, "train.global_batch_size": batch})  # fmt: skip
            basis = Basis.of(probe, build(probe, devices))
            built += 1
        except (ConfigError, NotImplementedError) as e:
            for axis, size in mesh.items():
                if size > 1 and all(v == 1 for a, v in mesh.items() if a != axis):
                    refusals.setdefault(axis, str(e))
            continue
        for axis, size in mesh.items():
            valid_sizes[axis].add(size)
        for extra in _variants(cfg, mesh, platform, microbatches, fixed):
            for moments, accum in itertools.product(_moments(cfg, fixed), _accumulations(cfg, fixed)):
                considered += 1
                changes = {**layout, **extra, "train.grad_accum_steps": accum, "precision.moments_dtype": moments}
                variant = with_changes(cfg, changes)
                try:
                    check_mesh_fit(variant, basis.setup.mesh)
                except ConfigError:
                    continue
                total = basis.memory(variant, platform)
                if total > hbm:
                    continue
                try:
                    validate(variant)
                except ConfigError:
                    break  # another accumulation or moments dtype does not change what validate refuses
                found.append(basis.candidate(changes, variant, chip, platform, total))
                break  # more microbatches only add work; bfloat16 moments only where float32 fits nowhere
    for axis in MESH_AXES:
        if axis not in reasons and valid_sizes[axis] <= {1} and axis in refusals:
            reasons[axis] = refusals[axis]
    found.sort(key=lambda c: c.predicted["step_seconds"])
    return {"candidates": found, "considered": considered, "meshes": built, "not_searched": reasons,
            "screen_seconds": time.perf_counter() - start}  # fmt: skip


def _variants(cfg, mesh: dict, platform: str, microbatches: list[int], fixed: dict):
    """The keys beside the mesh: remat, loss chunk, kernel, context attention, pipeline microbatches."""
    exchanges = ("ring", "all_gather") if mesh["context"] > 1 else (cfg.model.context_attention,)
    for remat, chunk, kernel, exchange, m in itertools.product(
        REMAT_POLICIES, _loss_chunks(cfg), kernels(cfg, platform), exchanges, microbatches
    ):
        extra = {"model.remat": remat, "model.loss_chunk": chunk, "model.attention": kernel,
                 "model.context_attention": exchange, "train.pipeline_microbatches": m}  # fmt: skip
        if all(fixed.get(k, v) == v for k, v in extra.items()):
            yield extra


def _moments(cfg, fixed: dict) -> list[str]:
    if "precision.moments_dtype" in fixed:
        return [fixed["precision.moments_dtype"]]
    return list(dict.fromkeys([cfg.precision.moments_dtype, "bfloat16"]))


def _accumulations(cfg, fixed: dict) -> list[int]:
    if "train.grad_accum_steps" in fixed:
        return [fixed["train.grad_accum_steps"]]
    return sorted({*ACCUMULATION, cfg.train.grad_accum_steps})


def _moments_state(state: dict, configured: str, moments: str) -> dict:
    """The optimiser state's bytes with `moments`: AdamW's two moments are all of it but a counter and the
    weights' moving average (float32 whatever the moments are)."""
    if configured == moments:
        return state
    scale = 0.5 if moments == "bfloat16" else 2.0
    average = state.get("average", 0)
    return {**state, "optimizer": int((state["optimizer"] - average) * scale) + average}


def own_layout(cfg, devices, chip) -> Candidate | str:
    """The user's layout as configured, predicted as the search's are; or why it cannot run on `devices`."""
    platform = devices[0].platform
    if resolve(cfg.model.attention, platform) == "cudnn" and kernels(cfg, platform) == ("xla",):
        return (f"its cuDNN attention (model.attention={cfg.model.attention}) cannot be compiled on this machine, "
                "which lacks cuDNN's library")  # fmt: skip
    try:
        setup = build(cfg, devices)
    except (ConfigError, NotImplementedError) as e:
        return str(e)
    basis = Basis.of(cfg, setup)
    return basis.candidate(layout_of(cfg, setup), cfg, chip, platform, basis.memory(cfg, platform))


def search(cfg, devices, chip, compile_layout, *, slices: int = 1, fixed: dict | None = None, compiles: int = 8,
           trial: int = 0, progress=lambda line: None) -> dict:  # fmt: skip
    """The three rounds of the module docstring. `compile_layout(cfg)` is plan()'s report of a config compiled
    for the target; `progress` takes a line as each compile starts and ends."""
    fixed = fixed or {}
    screened = screen(cfg, devices, chip, slices, fixed)
    found, hbm = screened["candidates"], chip.usable_hbm_bytes
    own = own_layout(cfg, devices, chip)
    if not found and isinstance(own, str):
        return {**screened, "own": own}
    ratio: dict[str, float] = {}  # remat policy -> XLA's bytes over the arithmetic's, the largest seen
    # (remat policy, kernel) -> the compiled program's compute and HBM seconds over the prediction's, the
    # largest seen: the next finalist is the fastest by the prediction so corrected.
    slower: dict[tuple, tuple[float, float]] = {}
    compiled, seen, left = [], set(), list(found)
    while True:
        if len(compiled) >= compiles and (any(x.compiled["fits"] for x in compiled) or len(compiled) >= 2 * compiles):
            break
        if not compiled and isinstance(own, Candidate):
            c = own
        else:
            left = [x for x in left if x is not own and _family(x.layout) not in seen
                    and x.memory_bytes * ratio.get(x.layout["model.remat"], 1.0) <= hbm]  # fmt: skip
            if not left:
                break
            c = min(left, key=lambda x: corrected_seconds(x, slower))
        seen.add(_family(c.layout))
        progress(f"compiling {len(compiled) + 1}: {describe(c.layout)} (predicted {c.predicted['step_seconds']:.3g} s, "
                 f"{c.memory_bytes / 2**30:.2f} GiB by arithmetic){' - your layout' if c is own else ''}")  # fmt: skip
        start = time.perf_counter()
        report = compile_layout(c.cfg)
        used = report["compiled_bytes_per_device"] or hbm * 1.01
        policy = c.layout["model.remat"]
        ratio[policy] = max(ratio.get(policy, 0.0), used / c.memory_bytes)
        c.compiled = {"fits": report["fits"], "compiled_bytes_per_device": report["compiled_bytes_per_device"],
                      "out_of_memory": report.get("out_of_memory"), "seconds": time.perf_counter() - start,
                      "kept": bool(report.get("compile_kept"))}  # fmt: skip
        if "cost" in report:
            c.compiled.update(cost.compiled_time(c.cfg, chip, report, c.parts, c.model_flops))
            kind, p = (policy, c.layout["model.attention"]), c.predicted
            was = slower.get(kind, (0.0, 0.0))
            slower[kind] = tuple(max(w, c.compiled[s] / max(p[s], 1e-12))
                                 for w, s in zip(was, ("compute_seconds", "memory_seconds"), strict=True))  # fmt: skip
            c.compiled["uncounted_kernels"] = report["cost"]["kernels"]["uncounted"]
            c.compiled["collectives"] = {k: v["sent"] for k, v in report["collectives"]["measured"].items()}
        compiled.append(c)
        verdict = "fits" if c.compiled["fits"] else "does NOT fit"
        timed = f", {c.compiled['step_seconds']:.3g} s a step compiled" if "step_seconds" in c.compiled else ""
        progress(
            f"  {(c.compiled['compiled_bytes_per_device'] or 0) / 2**30:.2f} GiB, {verdict}{timed} "
            f"({c.compiled['seconds']:.0f} s{', kept from an earlier compile' if c.compiled['kept'] else ''})"
        )
    fitting = [c for c in compiled if c.compiled["fits"] and "step_seconds" in c.compiled]
    if trial and fitting:
        from trainer.planning.trial import step_seconds

        for c in fitting:
            progress(f"trial of {describe(c.layout)}: {trial} steps")
            c.measured_seconds = step_seconds(build(c.cfg, devices), trial)
            progress(f"  {c.measured_seconds:.3g} s a step measured (predicted {c.compiled['step_seconds']:.3g})")
    best = _best(fitting, own, by_trial=bool(trial))
    return {**screened, "own": own, "compiled": compiled, "best": best}


def corrected_seconds(c: Candidate, slower: dict) -> float:
    """A candidate's predicted step with its compute and HBM streams scaled by what the compiles of its remat
    policy and kernel showed them to be against their prediction (`slower`); its prediction as it is where
    none of its kind has been compiled yet."""
    p = c.predicted
    compute, memory = slower.get((c.layout["model.remat"], c.layout["model.attention"]), (1.0, 1.0))
    roofline = max(p["compute_seconds"] * compute, p["memory_seconds"] * memory) / (1 - p["bubble"])
    weights = p["weight_collective_seconds"]
    return roofline + p["activation_collective_seconds"] + max(0.0, weights - roofline)


def _family(layout: dict) -> tuple:
    """Layouts that differ only in accumulation, loss chunk or moments compile to near the same program."""
    return tuple(v for k, v in layout.items() if k not in ("train.grad_accum_steps", "model.loss_chunk",
                                                            "precision.moments_dtype"))  # fmt: skip


def _best(fitting: list[Candidate], own, by_trial: bool) -> Candidate | None:
    """The fastest that fits, by measured time after a trial, else by the compiled program's; within 1% of the
    user's own layout, the user's (nothing to change for nothing)."""
    if not fitting:
        return None
    time_of = (lambda c: c.measured_seconds) if by_trial else (lambda c: c.compiled["step_seconds"])  # noqa: E731
    best = min(fitting, key=time_of)
    if isinstance(own, Candidate) and own in fitting and time_of(own) <= 1.01 * time_of(best):
        return own
    return best


def describe(layout: dict) -> str:
    """A layout in one line: the mesh's axes above 1, then the other keys."""
    mesh = " x ".join(f"{a}={layout[f'mesh.{a}']}" for a in MESH_AXES if layout[f"mesh.{a}"] > 1) or "one device"
    slices = [f"{k.removeprefix('mesh.')}={layout[k]}" for k in ("mesh.dcn_data", "mesh.dcn_fsdp") if layout[k] > 1]
    rest = [f"remat={layout['model.remat']}", f"accum={layout['train.grad_accum_steps']}"]
    if layout["model.loss_chunk"]:
        rest.append(f"loss_chunk={layout['model.loss_chunk']}")
    rest.append(f"attention={layout['model.attention']}")
    if layout["mesh.stage"] > 1:
        rest.append(f"pipeline_microbatches={layout['train.pipeline_microbatches']}")
    if layout["mesh.context"] > 1:
        rest.append(f"context_attention={layout['model.context_attention']}")
    if layout["mesh.tensor"] > 1 and layout["mesh.sequence_parallel"]:
        rest.append("sequence_parallel")
    if layout["precision.moments_dtype"] != "float32":
        rest.append(f"moments={layout['precision.moments_dtype']}")
    return " ".join([mesh, *slices, *rest])
