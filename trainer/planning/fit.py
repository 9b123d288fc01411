"""plan.py --fit: when a config does not fit its target, find the fastest variant that does.

A variant changes how the step is computed and laid out, never what it computes:
the same model, batch, data and schedule. The levers are the remat policy,
gradient accumulation, the chunked loss, bfloat16 optimiser moments and the
split of a slice's devices between data, fsdp and tensor. Every variant is
screened by the memory arithmetic (trainer/planning/memory.py; one built setup per
mesh and moments dtype, so hundreds screen in seconds) and ranked by the FLOPs
it recomputes; the most promising that pass are compiled on the target, and the
fastest of those that fit by XLA's own memory figure (by the compiled roofline)
is the answer.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

from trainer.config import REMAT_POLICIES
from trainer.config.errors import ConfigError
from trainer.config.forms import flatten, with_changes
from trainer.model.flops import attention_forward_flops
from trainer.planning import memory
from trainer.training.mesh_fit import check_mesh_fit
from trainer.training.setup import build
from trainer.training.validation import validate

ACCUMULATION = (1, 2, 4, 8, 16, 32)
TENSOR = (1, 2, 4, 8)


@dataclasses.dataclass
class Variant:
    changes: dict  # dotted config keys -> values, only those that differ from the user's config
    cfg: object
    arithmetic_bytes: int
    recompute: float  # FLOPs recomputed per token, over the step's FLOPs per token

    @property
    def rank(self) -> tuple:
        """Cheapest first: least recompute, then fewer microbatches, less tensor parallelism, fp32 moments."""
        c = self.cfg
        return (round(self.recompute, 4), c.train.grad_accum_steps, c.mesh.tensor,
                c.precision.moments_dtype != "float32")  # fmt: skip


def recompute_fraction(cfg, spec, n_matmul_params: int) -> float:
    """Extra forward FLOPs per token the variant spends, as a fraction of 6N + attention (flops.py):
    full remat recomputes the layers' forward, save_dots_no_batch the attention's batched matmuls, the
    chunked loss the output head's forward."""
    a = spec.arch
    attention_forward = attention_forward_flops(a, cfg.data.seq_len)
    head = a.d_model * a.vocab_size
    total = 6 * n_matmul_params + 3 * attention_forward
    extra = {"none": 0, "save_dots": 0, "save_dots_no_batch": attention_forward,
             "full": 2 * (n_matmul_params - head) + attention_forward}[spec.execution.remat]  # fmt: skip
    if spec.execution.loss_chunk:
        extra += 2 * head
    return extra / total


def _loss_chunks(cfg) -> tuple[int, ...]:
    seq = cfg.data.seq_len
    chunk = next((c for c in (512, 256, 128) if c < seq and seq % c == 0), 0)
    return tuple(sorted({cfg.model.loss_chunk, chunk}))


def _meshes(setup) -> list[tuple[int, int, int]]:
    """(data, fsdp, tensor) splits of one slice's devices: the configured data size or 1, fsdp the rest."""
    shape = dict(setup.mesh.shape)
    per_slice = shape["data"] * shape["fsdp"] * shape["tensor"]
    out = []
    for data, tensor in itertools.product(sorted({shape["data"], 1}), TENSOR):
        if per_slice % (data * tensor) == 0:
            out.append((data, per_slice // (data * tensor), tensor))
    return out


def check(cfg, compiles: int) -> None:
    """Refuse what the search cannot do, before anything compiles."""
    if compiles < 1:
        raise ConfigError(f"--fit_compiles must be at least 1, not {compiles}.")
    if cfg.mesh.stage > 1:
        raise ConfigError("--fit does not search pipelined configs (mesh.stage > 1); set the stages yourself.")


def variants(cfg, devices, n_matmul_params: int) -> tuple[list[Variant], int]:
    """Every valid variant with its arithmetic memory, and how many were considered."""
    base = build(cfg, devices)
    shape = dict(base.mesh.shape)
    found, considered = [], 0
    moments = sorted({cfg.precision.moments_dtype, "bfloat16"})
    # Compared with the mesh as built, so that fsdp=-1 resolved to 4 is no change.
    configured = {**flatten(cfg), **{f"mesh.{a}": shape[a] for a in ("data", "fsdp", "tensor")}}
    for (data, fsdp, tensor), dtype in itertools.product(_meshes(base), moments):
        layout = {"mesh.data": data, "mesh.fsdp": fsdp, "mesh.tensor": tensor, "precision.moments_dtype": dtype}
        try:
            setup = build(with_changes(cfg, layout), devices)
        except ConfigError:
            continue  # heads or widths that do not divide over this tensor size
        state = memory.state_bytes(setup)
        for remat, accum, chunk in itertools.product(REMAT_POLICIES, ACCUMULATION, _loss_chunks(cfg)):
            considered += 1
            changes = {**layout, "model.remat": remat, "train.grad_accum_steps": accum, "model.loss_chunk": chunk}
            variant_cfg = with_changes(cfg, changes)
            try:
                validate(variant_cfg)
                check_mesh_fit(variant_cfg, setup.mesh)
            except ConfigError:
                continue
            execution = dataclasses.replace(setup.spec.execution, remat=remat, loss_chunk=chunk)
            spec = dataclasses.replace(setup.spec, execution=execution)
            total = memory.bytes_per_device(variant_cfg, setup, spec, state)["total"]
            differ = {k: v for k, v in changes.items() if configured[k] != v}
            found.append(Variant(differ, variant_cfg, total, recompute_fraction(variant_cfg, spec, n_matmul_params)))
    return found, considered


def search(cfg, devices, hbm_bytes: int, n_matmul_params: int, compile_variant, compiles: int = 3) -> dict:
    """Screen every variant by arithmetic and compile the most promising on the target: `compiles` of
    them, or up to twice as many while none fits. Each compile corrects the screen: the remaining
    variants with the same remat policy are judged by the arithmetic times XLA's ratio to it seen
    so far (the arithmetic's error is mostly in the activations, which the policy sets).
    `compile_variant(cfg)` returns plan's target report for a config. The answer is the fastest
    compiled variant that fits, by its roofline."""
    start = time.perf_counter()
    found, considered = variants(cfg, devices, n_matmul_params)
    ranked = sorted(found, key=lambda v: v.rank)
    screened_seconds = time.perf_counter() - start
    ratio: dict[str, float] = {}  # remat policy -> XLA's bytes over the arithmetic's, the largest seen
    compiled = []
    for v in ranked:
        policy = v.cfg.model.remat
        if v.arithmetic_bytes * ratio.get(policy, 1.0) > hbm_bytes:
            continue
        if any(c["fits"] and c["changes"] == _without_moments(v.changes) for c in compiled):
            continue  # bfloat16 moments cost precision and buy only memory: not where fp32 already fits
        if len(compiled) >= compiles and (any(c["fits"] for c in compiled) or len(compiled) >= 2 * compiles):
            break
        report = compile_variant(v.cfg)
        cost = report.get("cost", {})
        # A step the compiler refused is reported with the heap it needed; without XLA's report, at least
        # the HBM.
        used = report["compiled_bytes_per_device"] or hbm_bytes * 1.01
        ratio[policy] = max(ratio.get(policy, 0.0), used / v.arithmetic_bytes)
        compiled.append({
            "changes": v.changes, "arithmetic_bytes": v.arithmetic_bytes, "recompute": v.recompute,
            "compiled_bytes_per_device": report["compiled_bytes_per_device"], "fits": report["fits"],
            "compile_seconds": report["compile_seconds"], "out_of_memory": report.get("out_of_memory"),
            **{k: cost.get(k) for k in ("roofline_seconds", "bound", "mfu_ceiling")},
        })  # fmt: skip
    return {
        "considered": considered,
        "valid": len(found),
        "pass_arithmetic": sum(v.arithmetic_bytes <= hbm_bytes for v in found),
        "screen_seconds": screened_seconds,
        "compiled": compiled,
        "best": _best(compiled),
    }


def _without_moments(changes: dict) -> dict:
    return {k: v for k, v in changes.items() if k != "precision.moments_dtype"}


def _best(compiled: list[dict]) -> dict | None:
    """The fastest that fits; a roofline within 1% of it is a tie, won by the earlier (less intrusive) variant."""
    fitting = [c for c in compiled if c["fits"]]
    if not fitting:
        return None
    fastest = min(c["roofline_seconds"] for c in fitting)
    return next(c for c in fitting if c["roofline_seconds"] <= 1.01 * fastest)
