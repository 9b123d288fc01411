"""A layout's step time, predicted from arithmetic and read from its compiled program: plan.py --search's cost.

One device's step is modelled as three streams of work, each at the chip's data-sheet rate
(parallelism/chips.py):

- compute: the step's FLOPs on one device (the model's 6N + attention, trainer/model/flops.py, plus what the
  remat policy and the chunked loss recompute) at the chip's peak;
- memory: the HBM bytes the step moves: the weights each microbatch reads (forward, the backward's two
  matmuls, and the recomputed forward), the optimiser's update (the fp32 weights, gradients and moments
  read and written once), and the activations the backward keeps, written once and read once;
- collectives: the textbook's bytes each device sends (parallelism/collectives.py textbook_parts) at the
  chip's ICI rate, and the part that crosses slices (dcn_data's gradient all-reduce, dcn_fsdp's gathers
  and scatters) at its DCN rate.

Assumptions, stated because the compiler decides them: compute and HBM traffic overlap (the step takes the
longer, the roofline); the weights' collectives (FSDP's gathers and scatters, the data and slice all-reduces)
overlap with compute, as XLA's latency-hiding scheduler orders them, so only what exceeds the roofline
shows; the activations' collectives (tensor's all-reduces, context's key/value passes, expert's all-to-alls,
the pipeline's stage-to-stage sends) do not, since the next matmul waits for them. GPipe's bubble stretches
the roofline by (m + p - 1) / m. What the model cannot see: inside a Pallas kernel (splash) it counts the
FLOPs of its matmuls but not the kernel's own re-reads of keys and values; the compiler's fusion of
elementwise work; collectives that XLA does not overlap after all.

The compiled ranking (`compiled_time`) takes FLOPs and HBM bytes from the compiled program's HLO (loops
counted by their trips; Pallas kernels by their schedule, trainer/planning/plan.py hlo_cost) and each
collective's bytes from the same HLO (collectives.parse), split between weights and activations, ICI and
DCN, in the arithmetic's proportions for that collective. The compiled FLOPs already hold a pipeline's
bubble (its stages compute on padding), so it is not added again.
"""

from __future__ import annotations

import jax.numpy as jnp

from parallelism import pipeline
from parallelism.chips import Chip
from parallelism.collectives import textbook_parts
from trainer.config import microbatch_size


def collective_parts(cfg, setup, spec, counts: dict, moe: dict) -> dict:
    """{"weights": {kind: bytes}, "activations": {kind: bytes}, "dcn": bytes} each device sends a step."""
    shape = dict(setup.mesh.shape)
    stages = shape["stage"]
    act = jnp.dtype(cfg.precision.compute_dtype).itemsize
    a = spec.arch
    parts = textbook_parts(
        counts["total"] // stages, shape, n_layers=a.n_layers // stages, d_model=a.d_model,
        seq_len=cfg.data.seq_len, micro_rows=microbatch_size(cfg), microbatches=cfg.train.grad_accum_steps,
        act_bytes=act, kv_width=a.n_kv_heads * a.head_dim, context_attention=spec.execution.context_attention,
        **{**moe, "recomputed": spec.execution.remat != "none"} if moe else {},
    )  # fmt: skip
    ways = shape["data"] * shape["fsdp"] * shape["expert"]
    if stages > 1:  # GPipe: each tick sends a pipeline microbatch's activations on, forward and backward
        m = cfg.train.pipeline_microbatches
        piece = microbatch_size(cfg) / m / ways * cfg.data.seq_len * a.d_model * act / shape["tensor"]
        ticks = cfg.train.grad_accum_steps * (m + stages - 1)
        sent = parts["activations"]
        sent["collective-permute"] = sent.get("collective-permute", 0) + 2 * ticks * piece
    # What crosses slices. dcn_data: the gradients' all-reduce between slices, each device's FSDP shard of
    # them; dcn_fsdp: the slices' share of the weights' two gathers and one scatter.
    weights = act * counts["total"] / (stages * shape["tensor"])
    shard = weights / (shape["fsdp"] * shape["context"] * shape["expert"])
    dcn = 0.0
    s_data, s_fsdp = cfg.mesh.dcn_data, cfg.mesh.dcn_fsdp
    if s_data > 1:
        dcn += cfg.train.grad_accum_steps * 2 * (s_data - 1) / s_data * shard
    if s_fsdp > 1:
        dcn += cfg.train.grad_accum_steps * 3 * (s_fsdp - 1) / s_fsdp * shard * s_fsdp
    parts["dcn"] = dcn
    return parts


def hbm_bytes(cfg, setup, spec, counts: dict, state: dict, activations: int) -> float:
    """The HBM bytes one device moves in a step (the module docstring's three terms)."""
    shape = dict(setup.mesh.shape)
    act = jnp.dtype(cfg.precision.compute_dtype).itemsize
    expert_params = counts.get("expert_params", 0)
    # The weights a device multiplies by: its tensor and stage shard, and of the experts its own.
    applied = ((counts["total"] - expert_params) + expert_params / shape["expert"]) / (shape["tensor"] * shape["stage"])
    reads = 3 + (spec.execution.remat != "none")
    weights = cfg.train.grad_accum_steps * reads * applied * act
    update = 2 * (state["params"] + state["optimizer"]) + 2 * state["params"]  # weights, moments, gradients
    return weights + update + 2 * cfg.train.grad_accum_steps * activations


def predict(cfg, setup, spec, chip: Chip, counts: dict, state: dict, activations: int, flops_per_token: float,
            recompute: float, moe: dict) -> dict:  # fmt: skip
    """The predicted step of one layout: each stream's seconds, the step's, its bottleneck and MFU."""
    devices = setup.mesh.size
    tokens = cfg.train.global_batch_size * cfg.data.seq_len / devices
    compute = flops_per_token * tokens * (1 + recompute) / chip.peak_flops
    hbm = hbm_bytes(cfg, setup, spec, counts, state, activations) / chip.hbm_bytes_per_second
    parts = collective_parts(cfg, setup, spec, counts, moe)
    return combine(cfg, chip, compute, hbm, parts, flops_per_token * tokens, stretch=True)


def combine(cfg, chip: Chip, compute: float, hbm: float, parts: dict, model_flops: float, stretch: bool) -> dict:
    """Seconds a step by the overlap the module docstring states; `stretch` adds GPipe's bubble."""
    stages, m = cfg.mesh.stage, cfg.train.pipeline_microbatches
    bubble = pipeline.bubble_fraction(stages, m) if stages > 1 else 0.0
    roofline = max(compute, hbm) / (1 - bubble if stretch else 1)
    dcn = parts["dcn"] / chip.dcn_bytes_per_second if parts["dcn"] else 0.0
    weights = max(0.0, sum(parts["weights"].values()) - parts["dcn"]) / chip.ici_bytes_per_second + dcn
    activations = sum(parts["activations"].values()) / chip.ici_bytes_per_second
    step = roofline + activations + max(0.0, weights - roofline)
    streams = {"compute": compute, "memory": hbm, "collectives (ICI)": weights - dcn + activations,
               "collectives (DCN)": dcn}  # fmt: skip
    return {
        "step_seconds": step,
        "compute_seconds": compute,
        "memory_seconds": hbm,
        "weight_collective_seconds": weights,
        "activation_collective_seconds": activations,
        "dcn_seconds": dcn,
        "bubble": bubble,
        "bottleneck": max(streams, key=streams.get),
        "mfu": model_flops / (chip.peak_flops * step) if step else 0.0,
    }


def compiled_time(cfg, chip: Chip, report: dict, arithmetic: dict, model_flops: float) -> dict:
    """The step time of a compiled layout: `report` is plan()'s for it (cost and measured collectives),
    `arithmetic` its collective_parts, whose proportions split each measured collective."""
    cost, measured = report["cost"], report["collectives"]["measured"]
    parts = {"weights": {}, "activations": {}, "dcn": 0.0}
    for kind, m in measured.items():
        w, a = arithmetic["weights"].get(kind, 0.0), arithmetic["activations"].get(kind, 0.0)
        share = w / (w + a) if w + a else 1.0  # a collective the textbook has none of: a weight's, overlapped
        parts["weights"][kind] = m["sent"] * share
        parts["activations"][kind] = m["sent"] * (1 - share)
    weight_bytes = sum(arithmetic["weights"].values())
    if weight_bytes and arithmetic["dcn"]:
        parts["dcn"] = sum(parts["weights"].values()) * min(1.0, arithmetic["dcn"] / weight_bytes)
    return combine(cfg, chip, cost["compute_seconds"], cost["memory_seconds"], parts, model_flops, stretch=False)
