"""Autoregressive sampling with a KV cache.

The prompt is run once (prefill), filling every layer's key/value cache; each
new token then costs one position's worth of compute over the cache instead of
re-running the prefix. The whole loop is one jitted function (a fori_loop), so
a token costs no host round trip. Parameters keep their training shardings;
the cache is split over the tensor axis by key/value head, like attention.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp

from parallelism.rules import LogicalSharding
from trainer.model.decoder import ModelDef
from trainer.model.spec import ModelSpec, for_inference

PREFILL_CHUNK = 128  # prompt tokens a prefill call takes at once (make_generate)
# The batch axis as make_generate places it (whole, or split for a rollout's completions); time stays whole.
CACHE_NAMES = ("layers", "batch", None, "kv_heads", "head_dim")
RING_NAMES = ("layers", "batch", None)  # a local layer's ring: the position each slot holds
LATENT_NAMES = ("layers", "batch", None, None)  # latent attention's cache: every head reads the whole latent
# A linear layer's (trainer/model/delta.py): its convolution's last inputs, by head, and the rule's state.
CONV_NAMES = {"kv_heads": ("layers", "batch", None, "kv_heads", "head_dim"),
              "heads": ("layers", "batch", None, "heads", "head_dim")}  # fmt: skip
STATE_NAMES = ("layers", "batch", "heads", None, "head_dim")


def sample(logits: jax.Array, key: jax.Array, temperature: float, top_k: int, top_p: float) -> jax.Array:
    """One token per row of `logits` (batch, vocab). temperature 0 is greedy (argmax)."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1)
    logits = logits.astype(jnp.float32) / temperature
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # Keep the smallest set of most likely tokens whose mass reaches top_p (always the first).
        outside = jnp.cumsum(probs, axis=-1) - probs > top_p
        sorted_logits = jnp.where(outside, -jnp.inf, sorted_logits)
        logits = jnp.full_like(logits, -jnp.inf).at[jnp.arange(logits.shape[0])[:, None], order].set(sorted_logits)
    return jax.random.categorical(key, logits, axis=-1)


def empty_cache(spec: ModelSpec, batch: int, length: int, shard: LogicalSharding) -> dict:
    """{stack: (k, v)} for `length` positions, a local stack's (k, v, ring positions) for its window's
    (the ring's slots all empty, -1): a local layer holds only the keys its window can see. A linear stack's
    is (q, k, v's convolution inputs, the rule's state): its size does not grow with `length`."""
    a = spec.arch
    cache = {}
    for stack, count in collections.Counter(s for s, _ in a.stacks()).items():
        if stack == "linear_layers":
            lin = a.linear
            conv = [shard.constrain(jnp.zeros((count, batch, lin.conv_kernel - 1, heads, dim),
                                              spec.execution.compute_dtype), CONV_NAMES[axis])
                    for heads, dim, axis in ((lin.key_heads, lin.key_dim, "kv_heads"),) * 2
                    + ((lin.value_heads, lin.value_dim, "heads"),)]  # fmt: skip
            state = jnp.zeros((count, batch, lin.value_heads, lin.key_dim, lin.value_dim), jnp.float32)
            cache[stack] = (*conv, shard.constrain(state, STATE_NAMES))
            continue
        if a.mla.kv_rank:  # latent attention caches its latent and the shared RoPE key part (trainer/model/latent.py)
            dt = spec.execution.compute_dtype
            cache[stack] = tuple(shard.constrain(jnp.zeros((count, batch, length, width), dt), LATENT_NAMES)
                                 for width in (a.mla.kv_rank, a.mla.rope_dim))  # fmt: skip
            continue
        slots = min(length, a.sliding_window) if stack == "local_layers" else length
        shape = (count, batch, slots, a.n_kv_heads, a.head_dim)
        zeros = shard.constrain(jnp.zeros(shape, spec.execution.compute_dtype), CACHE_NAMES)
        cache[stack] = (zeros, zeros)
        if stack == "local_layers":
            cache[stack] += (shard.constrain(jnp.full((count, batch, slots), -1, jnp.int32), RING_NAMES),)
    return cache


def make_generate(spec: ModelSpec, shard: LogicalSharding, *, max_new_tokens: int, temperature: float = 0.0,
                  top_k: int = 0, top_p: float = 1.0, with_logprobs: bool = False,
                  split_batch: bool = False):  # fmt: skip
    """A jitted (params, prompt (batch, P) int32, seed[, lengths (batch,)[, keys (batch,)]]) -> (batch,
    max_new_tokens) continuation; `with_logprobs`: and each new token's log-probability, alike.

    With `lengths`, row i's prompt is its first lengths[i] tokens (the rest is padding): each row goes on from
    its own end, writing over its padding in the cache before any query can see it. With `keys` (one random
    key a row; `seed` is then unused), row i draws its tokens from keys[i] alone, so a prompt sampled alone
    or among others gives the same tokens (reinforcement learning's rollouts); else the batch shares one
    stream of keys from `seed`. A log-probability is the token's under the logits divided by the
    temperature, before top-k and top-p cut them (what a trainer recomputes); greedy decoding (temperature
    0) reports the logits' own. A handful of prompts cannot be split over the data-parallel devices, so the
    batch axis is replicated, unless `split_batch` (a rollout's completions, as many as a training batch
    has rows: split as the batch is, each device sampling its own rows); parameters keep their placement.
    """
    # Prompts and caches are short and grow a token at a time: whole sequences on every device, so a
    # model trained with a context axis decodes as any other.
    rules = {**dict(shard.rules), "seq": (), "residual_seq": ()}
    shard = LogicalSharding.create(shard.mesh, rules if split_batch else {**rules, "batch": ()})
    spec = for_inference(spec)
    model = ModelDef.create(spec, shard)
    scale = temperature or 1.0

    def pick(logits, i, keys, row_keys):
        if row_keys is None:
            token = sample(logits, keys[i], temperature, top_k, top_p)
        else:
            one = lambda row, key: sample(row[None], jax.random.fold_in(key, i), temperature, top_k, top_p)[0]  # noqa: E731
            token = jax.vmap(one)(logits, row_keys)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32) / scale, axis=-1)
        return token, jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]

    def prefill(params, prompt, positions, lengths, cache):
        """(each row's logits at its prompt's last token, the cache): the prompt in chunks of PREFILL_CHUNK,
        so a chunk's attention scores (rows x heads x chunk x cache length) bound the memory, not the
        prompt's (a rollout's 32 rows of 1,024 prompt tokens over 2,048 slots: 8 GiB of fp32 scores a
        device whole, at llm_1b's heads; 1 GiB in chunks)."""
        batch, width = prompt.shape
        chunk = min(width, PREFILL_CHUNK)
        if chunk == width:
            logits, cache = model.apply(params, prompt, positions, cache, lengths - 1, method="decode")
            return logits[:, 0], cache

        def body(i, carry):
            found, cache = carry
            start = i * chunk
            tokens, where = (jax.lax.dynamic_slice_in_dim(a, start, chunk, axis=1) for a in (prompt, positions))
            last = jnp.clip(lengths - 1 - start, 0, chunk - 1)
            logits, cache = model.apply(params, tokens, where, cache, last, method="decode")
            here = (lengths - 1 >= start) & (lengths - 1 < start + chunk)
            return jnp.where(here[:, None], logits[:, 0], found), cache

        found = jnp.zeros((batch, spec.arch.vocab_size), jnp.float32)
        return jax.lax.fori_loop(0, width // chunk, body, (found, cache))

    @jax.jit
    def generate(params, prompt, seed, lengths=None, keys=None):
        batch, prompt_len = prompt.shape
        lengths = jnp.full((batch,), prompt_len) if lengths is None else lengths
        if prompt_len > PREFILL_CHUNK and prompt_len % PREFILL_CHUNK:  # whole chunks: the rest is padding
            prompt = jnp.pad(prompt, ((0, 0), (0, -prompt_len % PREFILL_CHUNK)))
        width = prompt.shape[1]
        cache = empty_cache(spec, batch, width + max_new_tokens, shard)
        shared = jax.random.split(jax.random.key(seed), max_new_tokens)
        # A row's padding has no position (-1): a local layer's ring must not take it in over real keys.
        positions = jnp.where(jnp.arange(width) < lengths[:, None], jnp.arange(width), -1)
        last_logits, cache = prefill(params, prompt, positions, lengths, cache)
        first, first_logp = pick(last_logits, 0, shared, keys)
        out = jnp.zeros((batch, max_new_tokens), jnp.int32).at[:, 0].set(first)
        logps = jnp.zeros((batch, max_new_tokens), jnp.float32).at[:, 0].set(first_logp)

        def step(i, carry):
            out, logps, cache = carry
            token = jax.lax.dynamic_slice_in_dim(out, i - 1, 1, axis=1)
            pos = (lengths + i - 1)[:, None]
            logits, cache = model.apply(params, token, pos, cache, method="decode")
            new, logp = pick(logits[:, -1], i, shared, keys)
            return out.at[:, i].set(new), logps.at[:, i].set(logp), cache

        out, logps, _ = jax.lax.fori_loop(1, max_new_tokens, step, (out, logps, cache))
        return (out, logps) if with_logprobs else out

    return generate
