"""Gated DeltaNet (Qwen3.5 and Qwen3-Next's linear-attention layers): a fixed-size state per head, updated by
the delta rule with a decay, in place of attention over every earlier key.

For each token t (per value head; q and k L2-normalised, q scaled by dk^-0.5):

    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T        S: (dk, dv)
    o_t = S_t^T q_t

with beta = sigmoid(b) the write strength and g = -exp(A_log) softplus(a + dt_bias) <= 0 the decay.
Two forms compute it and agree:

- `chunked` (training, prefill): in chunks of 64 tokens, the chunk's writes gathered into a few matmuls by
  the WY (UT-transform) form, as fla and transformers' torch_chunk_gated_delta_rule compute it; a scan over
  the chunks carries S. Cost grows linearly with the sequence (attention's quadratically).
- `recurrent` (decoding): the rule above, token by token.

Packed documents: a token's state starts afresh at its document's first token, as attention's segment mask
does: within a chunk the pairwise terms are masked to one document, the state carried into a chunk is read
only by the tokens of the document it belongs to, and carried out only from the chunk's last document.
Padding in decoding (position -1) writes nothing and decays nothing (beta 0, g 0).

Before the rule, q, k and v pass a depthwise causal convolution (`causal_conv`, kernel
linear_conv_kernel_dim, SiLU) over the sequence, also within a document; in decoding its state is the last
kernel - 1 inputs. After it, the output is normed per head and gated by SiLU(z) (`GatedRMSNorm`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from parallelism.rules import LogicalSharding
from trainer.model import quantised
from trainer.model.low_precision import einsum
from trainer.model.primitives import Adapter, RMSNorm, adapted, param, update
from trainer.model.quantised import weight
from trainer.model.spec import LinearAttention, ModelSpec

CHUNK = 64


def l2_normalised(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(|x|^2 + eps) over the last axis (fla's and transformers' l2norm)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def recurrent(q, k, v, g, beta, state=None, segment_ids=None):
    """The rule token by token. q, k (batch, t, heads, dk) (normalised, as many heads as v), v (batch, t,
    heads, dv), g and beta (batch, t, heads); `state` (batch, heads, dk, dv) or zeros; `segment_ids` (batch,
    t): the state restarts where the id changes. Returns (outputs (batch, t, heads, dv), the last state), fp32."""
    q, k, v, g, beta = (x.astype(jnp.float32) for x in (q, k, v, g, beta))
    b, t, h, dk = k.shape
    q = q * dk**-0.5
    state = jnp.zeros((b, h, dk, v.shape[-1]), jnp.float32) if state is None else state.astype(jnp.float32)
    ids = jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids
    starts = jnp.concatenate([jnp.zeros((b, 1), bool), ids[:, 1:] != ids[:, :-1]], axis=1)

    def step(s, xs):
        q_t, k_t, v_t, g_t, beta_t, start = xs
        s = jnp.where(start[:, None, None, None], 0.0, s) * jnp.exp(g_t)[..., None, None]
        delta = (v_t - jnp.einsum("bhkv,bhk->bhv", s, k_t)) * beta_t[..., None]
        s = s + jnp.einsum("bhk,bhv->bhkv", k_t, delta)
        return s, jnp.einsum("bhkv,bhk->bhv", s, q_t)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, starts))
    state, out = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(out, 0, 1), state


def chunked(q, k, v, g, beta, state=None, segment_ids=None, chunk: int = CHUNK):
    """The same rule in chunks (arguments and result as `recurrent`'s)."""
    q, k, v, g, beta = (x.astype(jnp.float32) for x in (q, k, v, g, beta))
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    q = q * dk**-0.5
    ids = jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    pad = -t % chunk
    if pad:  # tokens after the last that neither decay nor write (g 0, beta 0): the state passes them unchanged
        q, k, v, g, beta = (jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) for x in (q, k, v, g, beta))
        ids = jnp.pad(ids, ((0, 0), (0, pad)), mode="edge")
    n = (t + pad) // chunk

    def chunks(x):  # (b, t, h, ...) -> (b, h, n, chunk, ...)
        return jnp.moveaxis(x.reshape(b, n, chunk, h, *x.shape[3:]), 3, 1)

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    ids = ids.reshape(b, 1, n, chunk)
    before = jnp.concatenate([ids[:, :, :1, :1], ids[:, :, :-1, -1:]], axis=2)  # the id the carried state is of
    reads = (ids == before).astype(jnp.float32)  # (b, 1, n, chunk): which tokens read the carried state
    last = (ids == ids[..., -1:]).astype(jnp.float32)  # which tokens' writes are carried out
    same = ids[..., :, None] == ids[..., None, :]
    lower = jnp.tril(jnp.ones((chunk, chunk), bool))
    cum = jnp.cumsum(g, axis=-1)  # (b, h, n, chunk): the log decay from the chunk's start through each token
    # exp(cum_i - cum_j): the decay from token j to token i, for j <= i in one document (else 0, never exp of +)
    decay = jnp.exp(jnp.where(lower & same, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    strict = jnp.einsum("bhnik,bhnjk->bhnij", k_beta, k) * decay * (1 - jnp.eye(chunk))
    # (I + strict) u = v_beta and (I + strict) w = k_beta decayed: the chunk's writes as if S were 0, and how
    # much of the carried state each would have removed first (the WY form's T = (I + strict)^-1).
    both = unit_lower_solve(strict, jnp.concatenate([v_beta, k_beta * (jnp.exp(cum) * reads)[..., None]], -1))
    u, w = both[..., :dv], both[..., dv:]
    within = jnp.einsum("bhnik,bhnjk->bhnij", q, k) * decay
    q_in = q * (jnp.exp(cum) * reads)[..., None]
    k_out = k * (jnp.exp(cum[..., -1:] - cum) * last)[..., None]
    carried = jnp.exp(cum[..., -1]) * reads[..., -1]  # (b, h, n): the state's decay over the chunk, 0 past a start

    def step(s, xs):
        u, w, within, q_in, k_out, carried = xs
        fresh = u - jnp.einsum("bhik,bhkv->bhiv", w, s)
        out = jnp.einsum("bhik,bhkv->bhiv", q_in, s) + jnp.einsum("bhij,bhjv->bhiv", within, fresh)
        return s * carried[..., None, None] + jnp.einsum("bhik,bhiv->bhkv", k_out, fresh), out

    state = jnp.zeros((b, h, dk, dv), jnp.float32) if state is None else state.astype(jnp.float32)
    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (u, w, within, q_in, k_out, carried))
    state, out = jax.lax.scan(step, state, xs)  # out: (n, b, h, chunk, dv)
    out = jnp.moveaxis(out, 0, 2).reshape(b, h, n * chunk, dv)[:, :, :t]
    return jnp.moveaxis(out, 1, 2), state


@jax.custom_vjp
def unit_lower_solve(strict: jax.Array, rhs: jax.Array) -> jax.Array:
    """x with (I + strict) x = rhs, for strictly lower-triangular `strict` (..., C, C) and rhs (..., C, D).

    On a TPU or GPU, XLA's triangular solve (blocked, in matmuls). On a CPU, row by row, x_i = rhs_i -
    strict_i x (its rows above i already found): there XLA calls jaxlib's LAPACK solve, which spreads its
    batch over the thread pool XLA runs it in and waits, so two solves at once on a two-core machine's pool
    wait forever (seen: qwen3_5_tiny's step hung with both pool threads inside lapack_strsm_ffi). The rows'
    loop reads the whole block at each row, which on a TPU made a 2048-token layer's step 2.3x slower than
    the solve (benchmarks/linear_attention.py's roofline for v5e)."""

    def rows(strict, rhs):
        def row(i, x):
            found = jax.lax.dynamic_index_in_dim(rhs, i, axis=-2, keepdims=True)
            found = found - jax.lax.dynamic_index_in_dim(strict, i, axis=-2, keepdims=True) @ x
            return jax.lax.dynamic_update_index_in_dim(x, found, i, axis=-2)

        return jax.lax.fori_loop(1, strict.shape[-1], row, rhs)

    def solve(strict, rhs):
        system = strict + jnp.eye(strict.shape[-1], dtype=strict.dtype)
        return jax.lax.linalg.triangular_solve(system, rhs, left_side=True, lower=True, unit_diagonal=True)

    return jax.lax.platform_dependent(strict, rhs, cpu=rows, default=solve)


def _solve_forward(strict, rhs):
    x = unit_lower_solve(strict, rhs)
    return x, (strict, x)


def _solve_backward(saved, grad):
    """rhs's gradient y solves (I + strict)^T y = grad, the same solve on the rows and columns reversed;
    strict's is -y x^T on its strict lower part."""
    strict, x = saved
    flip = lambda a: jnp.flip(a, axis=-2)  # noqa: E731
    y = flip(unit_lower_solve(flip(jnp.flip(jnp.swapaxes(strict, -1, -2), axis=-1)), flip(grad)))
    return jnp.tril(-(y @ jnp.swapaxes(x, -1, -2)), -1), y


unit_lower_solve.defvjp(_solve_forward, _solve_backward)


def forward_flops(lin: LinearAttention, chunk: int = CHUNK) -> float:
    """Forward FLOPs per token of `chunked`'s matmuls (the projections are counted with the parameters), for
    each value head: within its chunk the k.k and q.k products (2 x 2 C dk), the triangular solve for
    both (C (dk + dv)) and the intra-chunk read (2 C dv); against the state its two reads and its update
    (3 x 2 dk dv). Per token it does not grow with the sequence's length, where attention's does."""
    dk, dv, c = lin.key_dim, lin.value_dim, chunk
    per_head = 4 * c * dk + c * (dk + dv) + 2 * c * dv + 6 * dk * dv
    return float(lin.value_heads * per_head)


def causal_conv(x, kernel, segment_ids=None, state=None):
    """Depthwise causal convolution over the sequence, then SiLU: out_t = silu(sum_i kernel[i] x_{t-K+1+i}),
    each channel apart, over inputs of x_t's own document. x (batch, t, channels), kernel (K, channels);
    `state` (batch, K-1, channels): the inputs before x (decoding), zeros if None."""
    width = kernel.shape[0]
    b, t, c = x.shape
    before = jnp.zeros((b, width - 1, c), x.dtype) if state is None else state.astype(x.dtype)
    padded = jnp.concatenate([before, x], axis=1)
    ids = None
    if segment_ids is not None:
        ids = jnp.concatenate([jnp.full((b, width - 1), -1, segment_ids.dtype), segment_ids], axis=1)
    out = jnp.zeros((b, t, c), jnp.float32)
    for i in range(width):  # kernel[i] takes the input width - 1 - i tokens back
        taken = padded[:, i : i + t].astype(jnp.float32)
        if ids is not None and i < width - 1:
            taken = jnp.where((ids[:, i : i + t] == segment_ids)[..., None], taken, 0.0)
        out = out + taken * kernel[i].astype(jnp.float32)
    return jax.nn.silu(out).astype(x.dtype)


def conv_state_after(x, state, valid):
    """The convolution's state after this call: the last K-1 inputs, of [state, x]'s first K-1 + valid[r]
    (row r's tokens past `valid[r]` are padding, never taken in)."""
    padded = jnp.concatenate([state.astype(x.dtype), x], axis=1)
    width = state.shape[1]
    return jax.vmap(lambda row, n: jax.lax.dynamic_slice_in_dim(row, n, width, axis=0))(padded, valid)


class GatedDeltaNet(nnx.Module):
    """A linear-attention layer (model.layer_types' linear_attention): q, k, v, z, b and a from the residual
    stream, the convolution, the rule, the gated norm and the output projection. q and k have
    model.linear.key_heads heads, v and z value_heads (a multiple): each key head serves value_heads /
    key_heads consecutive value heads. Heads are split over the tensor axis, as attention's are."""

    def __init__(self, spec: ModelSpec, shard: LogicalSharding, rngs: nnx.Rngs):
        a, lin = spec.arch, spec.arch.linear
        d, kh, vh, dk, dv = a.d_model, lin.key_heads, lin.value_heads, lin.key_dim, lin.value_dim
        std = spec.hidden_init_std
        self.wq = param(rngs, (d, kh, dk), ("embed", "kv_heads", "head_dim"), std)
        self.wk = param(rngs, (d, kh, dk), ("embed", "kv_heads", "head_dim"), std)
        self.wv = param(rngs, (d, vh, dv), ("embed", "heads", "head_dim"), std)
        self.wz = param(rngs, (d, vh, dv), ("embed", "heads", "head_dim"), std)
        self.wb = param(rngs, (d, vh), ("embed", "heads"), std)
        self.wa = param(rngs, (d, vh), ("embed", "heads"), std)
        # The convolution's kernel per channel, as transformers' nn.Conv1d starts it (+-1/sqrt(K) uniformly).
        bound = lin.conv_kernel**-0.5
        for name, heads, dim, axis in (("q", kh, dk, "kv_heads"), ("k", kh, dk, "kv_heads"), ("v", vh, dv, "heads")):
            kernel = jax.random.uniform(rngs.params(), (lin.conv_kernel, heads, dim), jnp.float32, -bound, bound)
            setattr(self, f"conv_{name}", nnx.Param(kernel, sharding_names=(None, axis, "head_dim"),
                                                    eager_sharding=False))  # fmt: skip
        # Each value head's decay rate exp(A_log) in [1, 16] and its step's bias, as transformers starts them.
        a_log = jnp.log(jax.random.uniform(rngs.params(), (vh,), jnp.float32, 1.0, 16.0))
        self.a_log = nnx.Param(a_log, sharding_names=("heads",), eager_sharding=False)
        self.dt_bias = nnx.Param(jnp.ones((vh,), jnp.float32), sharding_names=("heads",), eager_sharding=False)
        self.norm = RMSNorm(dv, a.norm_eps, "head_dim")
        self.wo = param(rngs, (vh, dv, d), ("heads", "head_dim", "embed"), std / (2 * a.n_layers) ** 0.5)
        # qkv's adapter is in_proj_qkv's: one A, and a B whose outputs are q's channels, k's, then v's (whole
        # over tensor: they do not fall on head boundaries of one kind).
        channels = 2 * kh * dk + vh * dv
        for name, inputs, outputs in (("qkv", ((d,), ("embed",)), ((channels,), (None,))),
                                      ("z", ((d,), ("embed",)), ((vh, dv), ("heads", "head_dim"))),
                                      ("out", ((vh, dv), ("heads", "head_dim")), ((d,), ("embed",)))):  # fmt: skip
            if a.lora.on(name):
                setattr(self, f"lora_{name}", Adapter(rngs, a.lora, *inputs, *outputs, spec.execution.adapter_dropout))
        for name in ("wq", "wk", "wv", "wz", "wb", "wa", "wo") if a.lora.quantised else ():
            quantised.store(self, name, a.lora.quantised)
        self.execution, self.shard = spec.execution, shard

    def __call__(self, x, tables, segment_ids, cache=None, key=None):
        """As layers.Attention (`tables` unused: no positions here). With `cache` = (q, k and v's convolution
        states (batch, K-1, heads, dim), the rule's state (batch, value heads, dk, dv), positions (batch, t)),
        goes on from them; padding (position -1) takes nothing in. Returns (output, updated cache)."""
        run, dt = self.execution, self.execution.compute_dtype
        b, t, _ = x.shape
        parts = {n: einsum("btd,dnh->btnh", x, weight(self, f"w{n}", dt), run, "attention") for n in "qkvz"}
        added = update(self, "qkv", x, key)
        if added is not None:
            ends = np.cumsum([parts[n].shape[2] * parts[n].shape[3] for n in "qkv"])
            for n, piece in zip("qkv", jnp.split(added, ends[:-1], axis=-1), strict=True):
                parts[n] = parts[n] + piece.reshape(parts[n].shape)
        parts["z"] = adapted(self, "z", parts["z"], x, key)
        beta = jax.nn.sigmoid(einsum("btd,dn->btn", x, weight(self, "wb", dt), run, "attention").astype(jnp.float32))
        a = einsum("btd,dn->btn", x, weight(self, "wa", dt), run, "attention").astype(jnp.float32)
        g = -jnp.exp(self.a_log[...]) * jax.nn.softplus(a + self.dt_bias[...])
        states, positions = (None, None, None, None), None
        if cache is not None:
            *states, positions = cache
            valid = positions >= 0
            beta, g = jnp.where(valid[..., None], beta, 0.0), jnp.where(valid[..., None], g, 0.0)
        convolved, new_cache = {}, []
        for n, state in zip("qkv", states[:3], strict=True):
            flat = parts[n].reshape(b, t, -1)
            kernel = getattr(self, f"conv_{n}")[...]
            kernel = kernel.reshape(kernel.shape[0], -1)
            before = None if state is None else state.reshape(b, state.shape[1], -1)
            convolved[n] = causal_conv(flat, kernel, segment_ids, before).reshape(parts[n].shape)
            if cache is not None:
                kept = conv_state_after(flat, before, valid.sum(axis=1))
                new_cache.append(kept.reshape(state.shape).astype(state.dtype))
        repeat = convolved["v"].shape[2] // convolved["q"].shape[2]
        q, k = (jnp.repeat(l2_normalised(convolved[n].astype(jnp.float32)), repeat, axis=2) for n in "qk")
        v = convolved["v"]
        q, k, v = (self.shard.constrain(y, ("batch", "seq", "heads", "head_dim")) for y in (q, k, v))
        rule = recurrent if cache is not None and t == 1 else chunked
        out, state = rule(q, k, v, g, beta, states[3], segment_ids)
        if cache is not None:
            new_cache.append(state.astype(states[3].dtype))
        gated = self.norm(out) * jax.nn.silu(parts["z"].astype(jnp.float32))
        projected = einsum("btnh,nhd->btd", gated.astype(dt), weight(self, "wo", dt), run, "attention")
        projected = adapted(self, "out", projected, gated.astype(dt), key)
        return projected, (tuple(new_cache) if cache is not None else None)
