"""Parameter counts, FLOPs per token and model FLOPs utilisation (MFU).

FLOPs per token (training, forward + backward), PaLM's convention:

    6 * N  +  12 * n_layers * n_heads * head_dim * seq_len

N counts every parameter that takes part in a matmul: all parameters except an
untied input embedding table (a lookup, not a matmul); a tied table is counted
once, as the output projection. With a mixture of experts N is the active
parameters: of each MoE layer's experts only the experts_per_token a token goes
to (the router and any shared experts are counted whole), as MaxText and
DeepSeek count them. The attention term is the QK^T and AV matmuls
at full length: the causal half that a kernel may skip is NOT subtracted, so
MFU figures compare directly with PaLM's and MaxText's. A local layer
(model.sliding_window) counts the window's keys instead of seq_len; a linear-attention layer
(model.layer_types) its chunked rule's matmuls instead (trainer/model/delta.py forward_flops), which do not
grow with seq_len.

MFU = FLOPs per token * tokens per second / peak FLOP/s of all devices. The
peak is the chip's dense bf16 figure from parallelism/chips.py; on a CPU it is measured
with a large fp32 matmul, once, for the whole host (simulated devices share its
cores).
"""

from __future__ import annotations

import functools
import math
import time

import jax
import jax.numpy as jnp

from parallelism.chips import CHIPS, chip_of
from trainer.model import adapters, delta, quantised
from trainer.model.spec import Architecture


def count_params(abstract_params: dict) -> dict[str, int]:
    abstract_params = quantised.as_stored(abstract_params)  # a QLoRA base's weights as applied, not its scales
    total = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_params))
    embedding = math.prod(abstract_params["embed"].shape)
    head = math.prod(abstract_params["lm_head"].shape) if "lm_head" in abstract_params else 0
    return {"total": total, "embedding": embedding, "non_embedding": total - embedding - head}


def inactive_params(arch: Architecture, abstract_params: dict) -> int:
    """Parameters a token does not meet: in each MoE layer the experts it is not routed to (and the router's
    bias, which only picks)."""
    moe = abstract_params.get("layers", {}).get("moe")
    if moe is None:
        return 0
    layers, experts = moe["router_bias"].shape
    expert = sum(math.prod(moe[w].shape) for w in ("w_gate", "w_up", "w_down")) // (layers * experts)
    return layers * (expert * (experts - arch.moe.experts_per_token) + experts)


FORMULA = "6 * N_matmul + 12 * n_layers * n_heads * head_dim * seq_len"


def matmul_params(arch: Architecture, abstract_params: dict) -> int:
    """N of the formula: every parameter but an untied input embedding table and the experts a token skips."""
    counts = count_params(abstract_params)
    lookup = 0 if arch.tie_embeddings else counts["embedding"]
    return counts["total"] - lookup - inactive_params(arch, abstract_params)


def attention_forward_flops(arch: Architecture, seq_len: int) -> float:
    """Forward FLOPs per token of the QK^T and AV matmuls at full length (2 matmuls x 2 FLOPs a multiply-add),
    a local layer's over the keys its window holds (min(seq_len, sliding_window), as MaxText counts Gemma 3's);
    training runs them three times (forward, and two in the backward pass)."""
    keys = sum(min(seq_len, arch.sliding_window) if arch.is_local(i) else seq_len for i in range(arch.n_layers)
               if not arch.is_linear(i))  # fmt: skip
    linear = sum(arch.is_linear(i) for i in range(arch.n_layers)) * delta.forward_flops(arch.linear)
    return 2.0 * arch.n_heads * sum(arch.attention_dims) * keys + linear  # QK^T over the q/k width, PV the value's


def forward_flops(arch: Architecture, abstract_params: dict, seq_len: int) -> float:
    """A forward pass's FLOPs per token: 2 * N_matmul + the attention's (a distillation teacher's cost)."""
    forward = 2.0 * matmul_params(arch, abstract_params) + attention_forward_flops(arch, seq_len)
    # Multi-token prediction's modules: their parameters are in N, their attention and their uses of the
    # shared head (counted once in N) are not
    depth = arch.mtp.depth
    return forward + depth * (2.0 * arch.vocab_size * arch.d_model + 2.0 * arch.n_heads * sum(arch.attention_dims)
                              * seq_len)  # fmt: skip


def flops_per_token(arch: Architecture, abstract_params: dict, seq_len: int, reference: bool = False) -> float:
    """Training FLOPs per token: FORMULA; with `reference` (DPO), also a forward pass of the reference weights
    (2 * N_matmul + the attention's forward), a third more; under model.lora less the frozen weights'
    gradients (2 * their N): activations' gradients still flow through them, theirs are not taken."""
    total = forward_flops(arch, abstract_params, seq_len) * (4 if reference else 3)
    if arch.lora.rank:  # low-rank adapters: the frozen base's weight gradients (2 * its N) are never computed
        total -= 2.0 * matmul_params(arch, adapters.split(abstract_params)[1])
    return total


@functools.cache
def measured_cpu_peak() -> float:
    """FLOP/s of a 2048^2 fp32 matmul on this host: the CPU's practical ceiling."""
    n = 2048
    a = jnp.ones((n, n), jnp.float32)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        matmul(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def peak_flops(devices: list[jax.Device]) -> float | None:
    """Peak FLOP/s of all the devices together; None for an unknown accelerator."""
    if devices[0].platform == "cpu":
        return measured_cpu_peak()
    chip = chip_of(devices[0].device_kind)
    return None if chip is None else CHIPS[chip].peak_flops * len(devices)
