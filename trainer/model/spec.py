"""What a model is (its architecture), how it runs (its execution), and how its weights are told apart.

The architecture defines the function: a checkpoint's weights mean the same
only under the same architecture, so a resume compares it. The execution
(remat, scan, attention kernel, compute dtype, loss chunking, pipeline stages)
may change between any two runs of the same weights.

Every weight carries logical axis names (trainer/model/primitives.py); whether a
weight is a matrix, and a hidden one, is read from them here, once, for weight
decay, muP and Muon.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from trainer.config import ADAPTER_TARGETS

# Named rematerialisation policies: what the backward pass may keep from the forward.
REMAT = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.dots_saveable,
    "save_dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
LAYERS = "layers"  # the logical axis of the stacked blocks


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE's frequency scaling for long context (`model.rope_scaling.*`): Llama 3's (kind llama3) or YaRN's
    (kind yarn: gpt-oss, DeepSeek-V3, Kimi K2, OLMo 3); factor 1 leaves the frequencies alone."""

    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192
    kind: str = "llama3"
    beta_fast: float = 32.0  # YaRN: pairs turning more than this often over original_max_len keep their frequency
    beta_slow: float = 1.0  # ... and those turning fewer times than this are slowed by `factor`
    mscale: float = 0.0  # YaRN's attention temperature: 0 = the paper's 0.1 ln(factor) + 1 on cos and sin
    mscale_all_dim: float = 0.0  # DeepSeek's: with mscale, cos and sin get m(mscale) / m(mscale_all_dim) and the
    # softmax m(mscale_all_dim)^2 (latent attention)
    truncate: bool = True  # YaRN: the ramp's ends rounded to whole pairs (gpt-oss: false)

    @property
    def yarn(self) -> bool:
        return self.kind == "yarn" and self.factor != 1

    def _m(self, scale: float) -> float:
        return 0.1 * scale * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0

    @property
    def attention_factor(self) -> float:
        """What YaRN multiplies cos and sin by (1 without it)."""
        if not self.yarn:
            return 1.0
        if self.mscale and self.mscale_all_dim:
            return self._m(self.mscale) / self._m(self.mscale_all_dim)
        return self._m(1.0)

    @property
    def softmax_factor(self) -> float:
        """What DeepSeek's latent attention multiplies its softmax scale by under YaRN (1 without it)."""
        return self._m(self.mscale_all_dim) ** 2 if self.yarn and self.mscale_all_dim else 1.0


@dataclasses.dataclass(frozen=True)
class Experts:
    """A mixture of experts in place of some layers' MLP (`model.moe.*`); num_experts 0: every layer dense.

    Of the layers after the first `dense_layers`, every `every`-th is a mixture: `num_experts` SwiGLU MLPs
    `d_ff` wide, of which a router picks `experts_per_token` for each token, plus `shared_experts` always on
    (one MLP shared_experts x d_ff wide)."""

    num_experts: int = 0
    experts_per_token: int = 2
    shared_experts: int = 0
    shared_gate: bool = False  # the shared experts' output times sigmoid(x . w_shared_gate) (Qwen3.5-MoE's)
    d_ff: int = 0
    dense_layers: int = 0
    every: int = 1
    router: str = "softmax"  # or "sigmoid" (DeepSeek-V3's scores)
    routed_scale: float = 1.0  # the chosen experts' normalised weights times this
    groups: int = 1  # DeepSeek-V3's group-limited routing: experts in `groups` groups, ...
    groups_per_token: int = 1  # ... a token's picked from its best groups (by their two best scores) only

    def moe_layers(self, n_layers: int) -> int:
        return (n_layers - self.dense_layers) // self.every if self.num_experts else 0

    def stacks(self, n_layers: int) -> list[tuple[str, int]]:
        """Where each layer's weights live, in the model's order: (stack, place in it). Stacks of like
        blocks run as one scan each: `dense_layers` (the dense first layers), `dense_between` (the dense
        layers between MoE ones when every > 1) and `layers` (the MoE layers; a dense model's every layer)."""
        if not self.num_experts:
            return [("layers", i) for i in range(n_layers)]
        out = [("dense_layers", i) for i in range(self.dense_layers)]
        for unit in range(self.moe_layers(n_layers)):
            out += [("dense_between", unit * (self.every - 1) + j) for j in range(self.every - 1)]
            out.append(("layers", unit))
        return out


@dataclasses.dataclass(frozen=True)
class Latent:
    """Multi-head latent attention (`model.mla.*`, DeepSeek-V2/V3; trainer/model/latent.py); kv_rank 0: off."""

    kv_rank: int = 0
    q_rank: int = 0
    nope_dim: int = 128
    rope_dim: int = 64
    v_dim: int = 128


@dataclasses.dataclass(frozen=True)
class LinearAttention:
    """Gated DeltaNet's shapes (`model.linear.*`; trainer/model/delta.py), for the layers model.layer_types
    names linear_attention: key_heads q and k heads of key_dim, value_heads v heads of value_dim (a multiple
    of key_heads), and the convolution's kernel."""

    key_heads: int = 16
    value_heads: int = 32
    key_dim: int = 128
    value_dim: int = 128
    conv_kernel: int = 4


@dataclasses.dataclass(frozen=True)
class MultiToken:
    """Multi-token prediction's modules (`model.mtp.depth`; trainer/model/mtp.py); 0: none."""

    depth: int = 0


@dataclasses.dataclass(frozen=True)
class Adapters:
    """Low-rank adapters (LoRA, `model.lora.*`; trainer/model/primitives.py Adapter) beside the projections
    `targets` names; rank 0: none. q, k, v, o: attention's query, key, value and output projections (q's
    covers an output gate's projection too, as Qwen3.5's q_proj holds both); gate, up, down: the gated MLP's,
    in dense layers and a mixture's shared experts (routed experts take none); qkv, z, out: a Gated DeltaNet
    layer's (trainer/model/delta.py) q, k and v together (one A, as in_proj_qkv), its gate and its output."""

    rank: int = 0
    alpha: float = 16.0
    targets: tuple[str, ...] = ADAPTER_TARGETS
    base: str = ""  # "", int8 or nf4 (QLoRA: trainer/model/quantised.py)

    def on(self, target: str) -> bool:
        return self.rank > 0 and target in self.targets

    @property
    def quantised(self) -> str:
        """How the frozen base is stored: "" (its param dtype), int8 or nf4."""
        return self.base if self.rank > 0 else ""


@dataclasses.dataclass(frozen=True)
class Architecture:
    """What defines the model's function: the same weights mean the same thing only under the same values.

    A run resumes or evaluates a checkpoint only under the architecture it was
    trained with. The field names are the `model.*` config keys.
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    head_dim: int = 0  # each head's width; 0 (the config's default) becomes d_model / n_heads
    rope_theta: float = 10_000.0
    rope_scaling: RopeScaling = RopeScaling()
    norm_eps: float = 1e-5
    qk_norm: bool = False  # RMSNorm over each query and key head's vector, before RoPE (Qwen3)
    tie_embeddings: bool = False
    mup_base_width: int = 0  # muP: hidden init and learning rate scale with d_model / this; logits divided by it
    moe: Experts = Experts()
    # Sliding-window attention: a local layer's query sees itself and the sliding_window - 1 tokens before it.
    sliding_window: int = 0  # 0: every layer global
    global_every: int = 0  # with a window, every this-many-th layer is global (Gemma 3: 6); 0: all local (Mistral)
    local_rope_theta: float = 0.0  # the local layers' RoPE base (Gemma 3: 10k beside 1M); 0: rope_theta
    attention_sinks: bool = False  # each head's learned logit of a key with no value, in every softmax (gpt-oss)
    # Gemma's details: embeddings times sqrt(d_model), a norm on each sublayer's output before the residual
    # add, the MLP's gate through tanh-approximated GELU (GeGLU), scores scaled by attn_scale_dim^-0.5.
    embed_scale: bool = False
    post_norms: bool = False
    mlp_activation: str = "silu"  # one of ACTIVATIONS
    attn_scale_dim: int = 0  # 0: head_dim
    mla: Latent = Latent()
    mtp: MultiToken = MultiToken()
    lora: Adapters = Adapters()
    # Hybrids (Qwen3.5, Qwen3-Next): each layer's kind, linear_attention (Gated DeltaNet, model.linear.*) or
    # full_attention; () is every layer full attention.
    layer_types: tuple[str, ...] = ()
    linear: LinearAttention = LinearAttention()
    centred_norms: bool = False  # the norms scale by 1 + a weight that starts at 0 (Qwen3.5's), not by the weight
    rope_fraction: float = 1.0  # the share of each head's width RoPE rotates (its first dims; Qwen3.5: 0.25)
    attention_gate: bool = False  # attention's output times sigmoid of a gate the query projection also gives

    def __post_init__(self):
        # One value for one model: a config's 0 and its d_model / n_heads spelled out are the same architecture.
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)

    def is_local(self, layer: int) -> bool:
        """Whether `layer` (0-based) attends over the sliding window."""
        return bool(self.sliding_window) and not (self.global_every and (layer + 1) % self.global_every == 0)

    def is_linear(self, layer: int) -> bool:
        """Whether `layer` (0-based) is a Gated DeltaNet layer."""
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

    def moe_stack(self, stack: str) -> bool:
        """Whether the blocks of `stack` have experts: a mixture's `layers`, and in a hybrid with experts (every
        layer a mixture) both stacks."""
        return bool(self.moe.num_experts) and stack in ("layers", "linear_layers")

    def stacks(self) -> list[tuple[str, int]]:
        """Where each layer's weights live, in the model's order: (stack, place in it). A stack holds like
        blocks (run as scans, trainer/model/decoder.py): the mixture's (Experts.stacks), with a window
        `local_layers` for the local layers beside `layers` for the global ones (validation refuses windows
        with experts), and in a hybrid `linear_layers` beside `layers` for the full-attention ones."""
        if not (self.sliding_window or self.layer_types):
            return self.moe.stacks(self.n_layers)
        other = "linear_layers" if self.layer_types else "local_layers"
        out, seen = [], {other: 0, "layers": 0}
        for i in range(self.n_layers):
            stack = other if self.is_linear(i) or self.is_local(i) else "layers"
            out.append((stack, seen[stack]))
            seen[stack] += 1
        return out

    @property
    def width_multiplier(self) -> float:
        """muP's m = d_model / base width (1 without muP); see trainer/optim/mup.py."""
        return self.d_model / self.mup_base_width if self.mup_base_width else 1.0

    @classmethod
    def from_config(cls, cfg) -> Architecture:
        values = {f.name: cfg.model[f.name] for f in dataclasses.fields(cls)}
        moe = {f.name: values["moe"][f.name] for f in dataclasses.fields(Experts)}
        mla = {f.name: values["mla"][f.name] for f in dataclasses.fields(Latent)}
        lora = values["lora"]
        lora = Adapters(int(lora["rank"]), float(lora["alpha"]), tuple(lora["targets"]), lora["base"])
        linear = LinearAttention(**{f.name: values["linear"][f.name] for f in dataclasses.fields(LinearAttention)})
        return cls(**{**values, "rope_scaling": RopeScaling(**values["rope_scaling"]), "moe": Experts(**moe),
                      "mla": Latent(**mla), "mtp": MultiToken(values["mtp"]["depth"]), "lora": lora,
                      "layer_types": tuple(values["layer_types"]), "linear": linear})  # fmt: skip

    @property
    def rope_dim(self) -> int:
        """The width RoPE rotates: a head's, or with latent attention its RoPE part's."""
        return self.mla.rope_dim if self.mla.kv_rank else int(self.head_dim * self.rope_fraction)

    @property
    def attention_dims(self) -> tuple[int, int]:
        """(a query and key head's width, a value head's): head_dim both, or latent attention's."""
        m = self.mla
        return (m.nope_dim + m.rope_dim, m.v_dim) if m.kv_rank else (self.head_dim, self.head_dim)

    @property
    def expert_d_ff(self) -> int:
        return self.moe.d_ff or self.d_ff


@dataclasses.dataclass(frozen=True)
class Execution:
    """How the function is computed: any of these may change between two runs on the same weights."""

    remat: str = "none"
    scan_layers: bool = True
    attention: str = "xla"
    context_attention: str = "ring"  # how attention crosses mesh.context (trainer/model/context.py)
    compute_dtype: str = "float32"
    loss_chunk: int = 0  # sequence positions per chunk of the loss's logits (0 = all at once)
    stages: int = 1  # pipeline stages (mesh.stage); see parallelism/pipeline.py
    pipeline_microbatches: int = 1  # microbatches the pipeline's forward pass is cut into (train.pipeline_microbatches)
    moe_impl: str = "dropless"  # how experts compute (model.moe.impl, trainer/model/moe.py)
    capacity_factor: float = 1.25  # model.moe.capacity_factor, for moe_impl capacity
    grouped_matmul: str = "auto"  # model.moe.grouped_matmul, for moe_impl dropless
    adapter_dropout: float = 0.0  # model.lora.dropout: of the adapters' inputs, in training steps only
    quant_matmul: str = ""  # model.quant.matmul: "", int8 or fp8 (trainer/model/low_precision.py)
    quant_targets: tuple[str, ...] = ()  # model.quant.targets: the matmuls it applies to

    @classmethod
    def from_config(cls, cfg) -> Execution:
        m = cfg.model
        return cls(remat=m.remat, scan_layers=m.scan_layers, attention=m.attention,
                   context_attention=m.context_attention, compute_dtype=cfg.precision.compute_dtype,
                   loss_chunk=m.loss_chunk, stages=cfg.mesh.stage,
                   pipeline_microbatches=cfg.train.pipeline_microbatches, moe_impl=m.moe.impl,
                   capacity_factor=m.moe.capacity_factor, grouped_matmul=m.moe.grouped_matmul,
                   adapter_dropout=float(m.lora.dropout), quant_matmul=m.quant.matmul,
                   quant_targets=tuple(m.quant.targets))  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model to build: its architecture, how it runs, and how its weights start."""

    arch: Architecture
    execution: Execution = Execution()
    init_std: float = 0.02

    @property
    def hidden_init_std(self) -> float:
        return self.init_std / self.arch.width_multiplier**0.5

    @classmethod
    def from_config(cls, cfg) -> ModelSpec:
        return cls(Architecture.from_config(cfg), Execution.from_config(cfg), cfg.model.init_std)


def for_inference(spec: ModelSpec) -> ModelSpec:
    """The spec that scores, evaluates and decodes: experts without a capacity. A capacity (fixed expert
    buffers, trainer/model/moe.py) is a training-time economy; outside training a token dropped for the sake
    of others in its batch would make a request's score depend on what it was batched with."""
    if not spec.arch.moe.num_experts or spec.execution.moe_impl == "dropless":
        return spec
    return dataclasses.replace(spec, execution=dataclasses.replace(spec.execution, moe_impl="dropless"))


def is_matrix(names: tuple) -> bool:
    """A weight matrix (embeddings, head, projections): two or more axes besides the layer stack.

    Norm scales are vectors: decaying a gain towards zero fights the
    normalisation instead of regularising, so weight decay applies to matrices only.
    """
    return len([n for n in names if n != LAYERS]) >= 2


def is_hidden(names: tuple) -> bool:
    """A matrix inside the blocks (stacked over layers): muP scales its init and learning rate,
    Muon orthogonalises its updates."""
    return names[0] == LAYERS and is_matrix(names)
