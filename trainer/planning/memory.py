"""Memory per device from arithmetic: what the planner sets beside XLA's compiled figure.

Weights, gradients and optimiser state come from the state's shardings (every
array's shard shape on one device), so FSDP, tensor and stage sharding are
exact. The split follows the mixed-precision textbook (ZeRO's accounting),
with the working buffers XLA:TPU was seen to hold at its peak
(benchmarks/memory_calibration.py compiles the grid the README's memory table
shows, and tests/test_memory_calibration.py holds this file to it):

- `params`: the weights as the matmuls read them, in the compute dtype
  (bf16: 2 bytes per parameter). Our step casts them a layer at a time, so
  this is an upper bound on what is resident.
- `master_weights`: the fp32 copy the optimiser updates, when compute is not fp32.
- `grads`: fp32 gradients, twice over with gradient accumulation (the running sum).
- `optimizer`: the optimiser's state as stored (AdamW fp32: 8 bytes per parameter).
- `update`: the optimiser's fp32 update. It is made after the backward pass has
  freed the activations, so it counts only by what it exceeds them: the peak
  is the larger of the two phases (XLA:TPU's live ranges at small's peak hold
  the gradients and no update).
- `reference`: DPO's frozen reference weights, stored as the parameters are (fp32), so that at the start
  the policy and its reference score every pair alike; GRPO's with rl.beta > 0 (rollout_bytes has the
  rollout's own memory, KV cache included).
- `teacher`: distilling online, the teacher's weights (fp32, sharded by their own logical axes) and its
  features for a microbatch (teacher_bytes); it has no gradients or optimiser state.
- `gathered`: what FSDP all-gathers beyond the device's own shard (gathered_bytes).
- `activations`: what the backward pass keeps for one microbatch under the remat
  policy, the fp32 logits, and under remat the larger of the logits (less the
  microbatch's gradient, which the loss phase does not hold yet) and the layer
  being recomputed; elements per token and layer are counted from the model's
  shapes below.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from trainer.config import microbatch_size
from trainer.model import quantised
from trainer.model.attention import context_kernel
from trainer.model.sampling import PREFILL_CHUNK
from trainer.optim import averaging

# How far the total may be from XLA:TPU's heap on compiles it was never fitted to: within 35% in all 32 of
# benchmarks/memory_calibration.py's held-out set (within 10% in 23), the bound stated before they were compiled.
HELDOUT_ERROR = 0.35


def heap_interval(total: int) -> tuple[float, float]:
    """The heaps the held-out error allows for an arithmetic `total`: total / (1 + e) to total / (1 - e)."""
    return total / (1 + HELDOUT_ERROR), total / (1 - HELDOUT_ERROR)


def shard_bytes(tree, itemsize: int | None = None) -> int:
    """Bytes of one device's shards of abstract arrays (at `itemsize` bytes per element if given)."""
    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * (itemsize or x.dtype.itemsize) for x in jax.tree.leaves(tree)
    )


def layer_activation_elements(spec, seq_len: int, tensor: int, act_bytes: int, platform: str,
                              context: int = 1, expert: int = 0) -> dict[str, float]:  # fmt: skip
    """Elements per token one layer keeps for the backward pass, under each remat policy.

    Head and MLP-width tensors are split over `tensor`; the residual-width ones
    are not. Where attention materialises its scores (on `platform`, see
    materialises_scores), an fp32 array of heads x seq per token, counted in
    compute-dtype elements of `act_bytes`: without remat XLA:TPU keeps two per
    layer in fp32 compute and 1.5 in bf16 (the fp32 softmax and its bf16 copy;
    small, remat none: XLA:TPU's heap 24.2 GiB on v5p-8, 24.8 counted so, 36.9
    with three), and as many for the layer being recomputed. Fused kernels keep
    only their output and statistics.

    Over a context axis (trainer/model/context.py) a device holds seq / context of the tokens, and
    attention is flash attention in XLA: a layer keeps its inputs, output and log-sum-exp, and only the
    layer being worked on holds scores. The program scores TILE keys at a time, but the compilers keep
    about a whole block's (ring: seq / context keys; all_gather: seq) at once. Chosen after seeing two
    compiles, llm_1b_128k on v5p-32 at 8k / 32k tokens and context 4: counted so 2.91 / 15.11 GiB against
    heaps of 2.82 / 14.78. On the three other context compiles of docs/mesh.md's table, not looked at
    first, it is off by up to 2x (32k, context 8: 5.48 against 10.80). XLA:CPU, micro model at 8k and
    context 4: 325 MiB with 512-key tiles, 708 untiled. Why the tiles do not bring it to queries x TILE
    is not known yet. The splash kernel over the gathered keys (all_gather on a TPU) holds no scores in
    memory, and keeps the gathered keys and values for its backward.

    An MoE layer (`expert` > 0: the expert axis's size) counts its tokens' experts_per_token copies
    through the experts and its shared experts as one MLP of that many times the expert width, plus the
    exchange's buffers: the copies sent, received and returned, each as large as the exchange's room
    (dropless: expert x the copies; capacity: capacity_factor x), in the layer kept without remat and in
    the recomputed one with it (the latter added after moe_1b's expert 8 compiles on v5p-32 showed it
    missing; held out at expert 4 x fsdp 4: docs/moe.md).
    """
    a = spec.arch
    d, f = a.d_model, a.d_ff / tensor
    exchange = 0.0
    if expert:
        m, run = a.moe, spec.execution
        f = (m.experts_per_token + m.shared_experts) * a.expert_d_ff / tensor
        room = expert if run.moe_impl == "dropless" else run.capacity_factor
        exchange = 3 * m.experts_per_token * d * room
    q, kv = a.n_heads * a.head_dim / tensor, a.n_kv_heads * a.head_dim / tensor
    latents = 0.0
    if a.mla.kv_rank:  # latent attention: per-head keys and values expanded from latents every device holds
        qk, v = a.attention_dims
        q, kv = a.n_heads * qk / tensor, a.n_heads * (qk + v) / 2 / tensor
        latents = a.mla.q_rank + a.mla.kv_rank + a.mla.rope_dim
    split = context > 1
    e = spec.execution
    in_xla = split and context_kernel(e.attention, e.context_attention, platform) == "xla"
    keys = seq_len // context if split and e.context_attention == "ring" else seq_len
    scores = (4 / act_bytes) * a.n_heads * keys / tensor if in_xla or materialises_scores(spec, platform) else 0
    kept_scores = 0 if split else scores
    gathered_kv = 2 * kv * (context - 1) if split and e.context_attention == "all_gather" else 0
    # The splash kernel over the gathered keys keeps them for its backward; XLA's blocks gather them again.
    kept_kv = gathered_kv if split and not in_xla else 0
    log_sum_exp = (4 / act_bytes) * a.n_heads / tensor if split else 0
    # q, k, v; the attention's out projection; gate, up. The down projection's output is only added to the
    # residual, which the next layer keeps as its input: no backward reads it, so nothing keeps it (llm_1b,
    # save_dots, fsdp=2 x tensor=2 on v5p-8: XLA:TPU's heap holds, per layer, two residual-width arrays,
    # q, k, v, gate and up).
    projections = q + 2 * kv + d + 2 * f + latents
    elementwise = (
        4 * d  # layer input, two norm outputs, the residual after attention
        + projections
        + q + kv  # rotated queries and keys
        + q  # attention output before its projection
        + 2 * f  # silu(gate) and the gated product
    )  # fmt: skip
    # Under mixed precision XLA:TPU also keeps the MLP's gate and up in fp32 for the elementwise silu
    # (llm_1b, remat none, splash: 85.6k elements per token and layer compiled, 50.7k counted above,
    # 4 f in bf16 elements), and the PV matmul reads the softmax in bf16 beside the fp32 one.
    mixed = act_bytes < 4
    whole = elementwise + (4 * f if mixed else 0) + log_sum_exp + exchange
    return {
        "none": whole + kept_kv + (1.5 if mixed else 2) * kept_scores,
        "full": d,
        "save_dots_no_batch": d + projections + log_sum_exp,
        # + the fp32 scores and the attention's output where they are matmuls' (a fused kernel's output is
        # not a dot: remat recomputes it).
        "save_dots": d + projections + log_sum_exp + (kept_scores + q if kept_scores else 0),
        # The layer being recomputed under remat, its backward at once: its scores as a layer keeps them
        # without remat, but not the fp32 gate and up. llm_1b under full remat on v5p-8, the heap beyond
        # the state, gradients, weights and kept inputs: with splash at fsdp=2 x tensor=2 1.85 GiB, and
        # 1.85 / 1.97 with 8 layers / a quarter of the vocabulary (1.86 counted, 2.86 with them). With
        # dot_product at fsdp=4, seq 1024 / 2048 / 4096 / 8192 at the same tokens: heaps of 11.08 /
        # 14.19 / 21.99 / 38.11 GiB, counted 11.76 / 14.76 / 20.76 / 32.76 (the scores once: 10.76 /
        # 12.76 / 16.76 / 24.76); the compiler keeps more of them per token the longer the sequence.
        # An MoE layer's exchange buffers are the recomputed layer's too (moe_1b on v5p-32 under full remat:
        # left out until 2026-11-26, when the dropless compile's heap, 17.11 GiB, was 64% above the count).
        "recomputed": elementwise + gathered_kv + (1.5 if mixed else 2) * scores + exchange,
    }


def materialises_scores(spec, platform: str) -> bool:
    """Whether attention writes its (heads, seq, seq) scores to memory: XLA's attention does, and so does
    `dot_product` wherever JAX has no fused kernel for it (it picks cuDNN's on a GPU only)."""
    kind = spec.execution.attention
    return kind == "xla" or (kind == "dot_product" and platform not in ("gpu", "cuda", "rocm"))


def activation_bytes(cfg, spec, mesh_shape: dict[str, int], platform: str, gradient_bytes: int) -> int:
    """Bytes one device keeps for the backward pass of one microbatch, at the peak; under remat, beside
    the microbatch's gradient (`gradient_bytes`), which the backward pass makes and the loss does not hold."""
    t = cfg.train
    rows = microbatch_size(cfg) / (mesh_shape["data"] * mesh_shape["fsdp"] * mesh_shape.get("expert", 1))
    context = mesh_shape.get("context", 1)
    tokens, tensor = rows * cfg.data.seq_len / context, mesh_shape["tensor"]
    act = jnp.dtype(cfg.precision.compute_dtype).itemsize
    per_layer = layer_activation_elements(spec, cfg.data.seq_len, tensor, act, platform, context)
    layers_here = spec.arch.n_layers // mesh_shape["stage"]
    kept = tokens * layers_here * per_layer[spec.execution.remat] * act
    moe = spec.arch.moe
    if moe.num_experts:  # the MoE layers' in place of as many dense ones'
        expert = layer_activation_elements(spec, cfg.data.seq_len, tensor, act, platform, context,
                                           mesh_shape.get("expert", 1))  # fmt: skip
        moe_layers = moe.moe_layers(spec.arch.n_layers)
        kept += tokens * moe_layers * (expert[spec.execution.remat] - per_layer[spec.execution.remat]) * act
        per_layer = {k: max(v, expert[k]) for k, v in per_layer.items()}
    if mesh_shape["stage"] > 1:
        # GPipe holds every microbatch's activations until its backward starts.
        m = t.pipeline_microbatches
        kept *= (m + mesh_shape["stage"] - 1) / m
    # fp32 logits, for every position or one loss chunk's at a time. XLA:TPU computes their gradient
    # (softmax minus the one-hot target) in the same buffer; XLA:CPU keeps both (a loss chunk saved
    # 30.3 MB there, 29.4 predicted with two copies).
    chunk = spec.execution.loss_chunk
    copies = 1 if platform == "tpu" else 2
    logits = copies * (rows * chunk / context if chunk else tokens) * 4 * spec.arch.vocab_size / tensor
    # Beside them, the final features in the compute dtype and fp32 and their fp32 gradient (small,
    # fsdp=2 x tensor=2 on v5p: f32 and bf16 [32, 1024, 768] buffers at the peak, with the logits).
    logits += tokens * spec.arch.d_model * (8 + act)
    if spec.execution.remat == "none":
        return int(kept + logits)
    # Under remat the loss is done with before the last layer is recomputed: XLA:TPU's peak is the larger
    # of the two phases, and the loss's holds the logits where the backward pass holds the microbatch's
    # gradient and the recomputed layer. llm_1b, full remat, fsdp=2 x tensor=2 on v5p-8: counted so
    # 9.71 GiB, the heap 9.71; without accumulation the loss phase 8.41, the heap 8.40 (small: heaps of
    # 2.9-3.3 GiB on five of six meshes and chips, 4.7 counting both). At fsdp=4 v5e's latency-hiding
    # scheduler (it orders work to overlap communication) holds both: small 4.39 GiB, llm_1b 10.66; 2.82
    # and 8.67 with xla_tpu_enable_latency_hiding_scheduler=false. The README's memory table shows it.
    return int(kept + max(logits - gradient_bytes, tokens * per_layer["recomputed"] * act))


def attention_weights(a) -> float:
    """One layer's attention weights (elements): q, k, v and out projections, or latent attention's."""
    if not a.mla.kv_rank:
        return (2 * a.n_heads * a.head_dim + 2 * a.n_kv_heads * a.head_dim) * a.d_model
    m, (qk, v) = a.mla, a.attention_dims
    query = (a.d_model + a.n_heads * qk) * m.q_rank if m.q_rank else a.d_model * a.n_heads * qk
    return (
        query
        + a.d_model * (m.kv_rank + m.rope_dim)
        + m.kv_rank * a.n_heads * (m.nope_dim + v)
        + a.n_heads * v * a.d_model
    )


def _holds_reference(cfg) -> bool:
    return cfg.data.format == "preference" or (cfg.data.format == "prompts" and cfg.rl.beta > 0)


def gathered_bytes(spec, mesh_shape: dict[str, int], act_bytes: int) -> int:
    """What FSDP gathers whole beyond a device's own shard: the embedding and output head in the
    compute dtype with the head's fp32 gradient before it is reduce-scattered, and two layers' weights
    (the one computing and the next, prefetched). XLA:TPU's buffers for llm_1b at fsdp=4 hold exactly
    these (bf16[32768,2048] twice, f32[2048,32768], bf16 layer matrices)."""
    fsdp = mesh_shape["fsdp"] * mesh_shape.get("context", 1)  # the rules shard weights over both
    expert = mesh_shape.get("expert", 1)  # and over the expert axis, but for the experts' own weights
    if fsdp * expert == 1:
        return 0
    a, tensor = spec.arch, mesh_shape["tensor"]
    head = a.vocab_size * a.d_model / tensor
    heads = 1 if a.tie_embeddings else 2
    attention = attention_weights(a) / tensor
    mlp = 3 * a.d_ff * a.d_model / tensor
    if a.moe.num_experts:  # a device gathers its own experts' weights (its 1/expert of them) and the router
        m = a.moe
        mlp = (3 * a.expert_d_ff * (m.num_experts / expert + m.shared_experts) / tensor + m.num_experts) * a.d_model
        return int((heads * head * act_bytes + head * 4) * (1 - 1 / (fsdp * expert))
                   + 2 * (attention * (1 - 1 / (fsdp * expert)) + mlp * (1 - 1 / fsdp)) * act_bytes)  # fmt: skip
    return int((heads * head * act_bytes + head * 4 + 2 * (attention + mlp) * act_bytes) * (1 - 1 / fsdp))


def state_bytes(setup) -> dict[str, int]:
    """Bytes of the parameters (as stored, fp32) and the optimiser state on one device, from the shardings;
    under model.lora the state's parameters are the adapters, `frozen` is the base beside them and
    `quantised` the part of it a QLoRA base holds quantised (values and scales)."""
    state = setup.abstract_state()
    base = setup.step_inputs()[0] if setup.adapted else {}
    return {"params": shard_bytes(state.params), "optimizer": shard_bytes(state.opt_state),
            "average": shard_bytes(averaging.find(state.opt_state)),  # the part of it that optim.ema_* keeps
            "frozen": shard_bytes(base), "quantised": shard_bytes(quantised.held(base))}  # fmt: skip


def rollout_bytes(cfg, setup, state: dict[str, int] | None = None) -> dict[str, int]:
    """A GRPO rollout's memory per device (data.format=prompts; trainer/training/rollouts.py), beside the
    train step's: the weights as stored (the sampler reads the state's own) and the optimiser state, both
    resident; the reference where rl.beta asks for it; FSDP's gathered weights; the KV cache of the batch of
    completions (train.global_batch_size rows of data.seq_len, key/value heads split over tensor, latent
    attention's latent whole, as the sampler places it; held twice); a prefill chunk's attention scores
    (trainer/model/sampling.py PREFILL_CHUNK); one position's fp32 logits a row (twice: top-p sorts a copy).
    The rows are split over the data-parallel axes as a training batch's are. The two doublings are
    XLA:TPU's buffers in one compile (llm_1b's rollout on v5e-8), not a fit over many."""
    state, a, shape = state or state_bytes(setup), setup.spec.arch, setup.mesh.shape
    compute = jnp.dtype(cfg.precision.compute_dtype).itemsize
    seq, tensor = cfg.data.seq_len, shape["tensor"]
    rows = cfg.train.global_batch_size // (shape["data"] * shape["fsdp"] * shape["expert"])
    if a.mla.kv_rank:
        per_token_layer = (a.mla.kv_rank + a.mla.rope_dim) * compute
    else:
        ways = tensor if a.n_kv_heads % tensor == 0 else 1
        per_token_layer = 2 * a.n_kv_heads // ways * a.head_dim * compute
    # A linear layer's (trainer/model/delta.py) is its fp32 state and its convolution's last inputs, whatever the
    # length: split over tensor by head, as its weights are.
    lin = a.linear
    linear_layer = (lin.value_heads * lin.key_dim * lin.value_dim * 4 + (lin.conv_kernel - 1) * compute
                    * (2 * lin.key_heads * lin.key_dim + lin.value_heads * lin.value_dim)) // (
                    tensor if lin.key_heads % tensor == 0 else 1)  # fmt: skip
    cache = sum(rows * (linear_layer if stack == "linear_layers" else
                        (min(seq, a.sliding_window) if stack == "local_layers" else seq) * per_token_layer)
                for stack, _ in a.stacks())  # fmt: skip
    heads = a.n_heads // tensor if a.n_heads % tensor == 0 else a.n_heads
    chunk = min(seq - cfg.rl.max_new_tokens, PREFILL_CHUNK)
    out = {
        "weights": state["params"] + state.get("frozen", 0),
        "optimizer": state["optimizer"],
        **({"reference": state["params"]} if cfg.rl.beta > 0 and not state.get("frozen") else {}),
        "gathered": gathered_bytes(setup.spec, dict(setup.mesh.shape), compute),
        # Twice: the decoding loop carries the cache and its update (XLA:TPU held two copies for llm_1b).
        "kv_cache": 2 * cache,
        # A prefill chunk's fp32 attention scores and their softmax, over the whole cache.
        "prefill_scores": 2 * rows * heads * chunk * seq * 4,
        "logits": 2 * rows * a.vocab_size * 4,
    }
    out["total"] = sum(out.values())
    return out


def teacher_bytes(cfg, setup) -> int:
    """An online teacher's bytes on one device: its weights' shards (fp32) and one microbatch's features."""
    shape = setup.mesh.shape
    rows = microbatch_size(cfg) / (shape["data"] * shape["fsdp"] * shape.get("expert", 1))
    features = rows * cfg.data.seq_len * setup.teacher.spec.arch.d_model * 4
    return int(shard_bytes(setup.teacher.abstract_params()) + features)


def bytes_per_device(cfg, setup, spec=None, state: dict[str, int] | None = None) -> dict[str, int]:
    """The analytic breakdown, per device, with its total. `spec` and `state` (from state_bytes) let a
    search vary remat, loss chunk and accumulation over one built setup."""
    spec, state = spec or setup.spec, state or state_bytes(setup)
    compute = jnp.dtype(cfg.precision.compute_dtype).itemsize
    fp32 = state["params"]  # the trained parameters, stored fp32 (under model.lora: the adapters)
    stored = fp32 + state.get("frozen", 0)  # every weight the model applies (model.lora's frozen base too)
    shape = dict(setup.mesh.shape)
    activations = activation_bytes(cfg, spec, shape, setup.mesh.devices.flat[0].platform, stored)
    out = {
        # The weights in the compute dtype; a quantised base is dequantised a layer at a time instead.
        "params": (stored - state.get("quantised", 0)) * compute // 4,
        "master_weights": stored if compute != 4 else 0,
        "grads": fp32 * (2 if cfg.train.grad_accum_steps > 1 else 1),
        "optimizer": state["optimizer"],
        # DPO's reference: a second copy, but under model.lora the base with the adapters off (none); GRPO's
        # with rl.beta, held beside the step for the rollouts (trainer/training/rollouts.py)
        **({"reference": fp32} if _holds_reference(cfg) and not state.get("frozen") else {}),
        # Distilling online: the teacher's weights as stored (fp32, sharded by their own axes) and its features
        # (tokens x its width, fp32) beside the student's step, with no gradients or optimiser state.
        **({"teacher": teacher_bytes(cfg, setup)} if setup.teacher is not None else {}),
        "update": max(0, fp32 - activations),
        "gathered": gathered_bytes(spec, shape, compute),
        "activations": activations,
    }
    out["total"] = sum(out.values())
    return out
