"""A mixture-of-experts MLP: a router picks `experts_per_token` of `num_experts` SwiGLU MLPs for each token.

Router: softmax over the experts in fp32, or DeepSeek-V3's sigmoid of each expert's logit
(model.moe.router); the top k (of the scores plus a per-expert bias that only DeepSeek-V3's loss-free
balancing moves, trainer/training/step.py; with model.moe.groups, among the experts of a token's best
groups) are kept and their scores renormalised to sum to one (times model.moe.routed_scale for sigmoid).
Each layer reports its load (the share of assignments each expert got), the Switch Transformer's balancing
loss E x sum_e share_e x mean_prob_e (1 when balanced; sigmoid scores normalised over the experts for
it), the router's mean log(Z)^2, and the share of assignments a capacity dropped.

The experts run under shard_map, each device on its own tokens (batch over data, fsdp and expert, the
sequence over context), holding its 1/expert of the experts with their d_ff split over tensor (the
down-projection's partial sums are added over tensor at the end). Weights sharded over fsdp and context
along d_model are gathered whole at their use, as XLA does for dense weights (the gather's transpose
reduce-scatters their gradients). Two ways, `model.moe.impl`:

- dropless: a device's assignments sorted by expert, sent to the devices holding their experts by an
  all-to-all, sorted again by expert there and run as grouped matmuls (jax.lax.ragged_dot, or megablox's
  Pallas kernel on a TPU: model.moe.grouped_matmul), then sent back.
  No assignment is dropped, so every mesh computes the same function. The exchange is padded: each
  device reserves room for all its assignments at every destination (expert x the assignments' size),
  because XLA:CPU, where the tests run, has no ragged all-to-all.
- capacity: each expert takes at most C = ceil(capacity_factor x assignments / experts) of a device's
  assignments (first choices first, then in token order); the rest are dropped (the token keeps its
  residual). Buffers have fixed shapes (experts, C) and the experts run as one batched matmul.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental.pallas.ops.tpu.megablox.ops import gmm

from parallelism.rules import LogicalSharding
from trainer.model.low_precision import einsum
from trainer.model.primitives import MLP, param

AXIS = "expert"  # the mesh axis the experts are split over
TOKENS = ("batch", "seq", None)


def route(x: jax.Array, router: jax.Array, bias: jax.Array, k: int, valid: jax.Array | None = None,
          experts_cfg=None):  # fmt: skip
    """(chosen experts (b, t, k), their renormalised weights (b, t, k), the layer's statistics). Tokens not
    `valid` (b, t) (padding: segment 0) are routed nowhere: their choices are the expert id `num_experts`,
    which every path below skips, and they count in no statistic. `experts_cfg` (spec.Experts): the
    router's kind (softmax's probabilities, or DeepSeek-V3's sigmoid scores, their weights times
    routed_scale, picked within the best groups); None: softmax."""
    logits = jnp.einsum("btd,de->bte", x.astype(jnp.float32), router.astype(jnp.float32))
    experts = router.shape[-1]
    sigmoid = experts_cfg is not None and experts_cfg.router == "sigmoid"
    scores = jax.nn.sigmoid(logits) if sigmoid else jax.nn.softmax(logits, axis=-1)
    choice = scores + jax.lax.stop_gradient(bias)  # the bias picks, it does not weigh
    if sigmoid and experts_cfg.groups > 1:  # a group's merit: its two best scores; experts outside the best out
        g = experts_cfg.groups
        grouped = choice.reshape(*choice.shape[:-1], g, experts // g)
        merit = jnp.sum(jax.lax.top_k(grouped, min(2, experts // g))[0], axis=-1)
        best = jax.lax.top_k(merit, experts_cfg.groups_per_token)[1]
        kept = jnp.sum(jax.nn.one_hot(best, g, dtype=bool), axis=-2)
        choice = jnp.where(jnp.repeat(kept, experts // g, axis=-1), choice, -jnp.inf)
    _, chosen = jax.lax.top_k(choice, k)
    weights = jnp.take_along_axis(scores, chosen, axis=-1)
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    probs = scores
    if sigmoid:
        weights = weights * experts_cfg.routed_scale
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)  # the balancing statistics' distribution
    if valid is None:
        valid = jnp.ones(x.shape[:2], bool)
    chosen = jnp.where(valid[..., None], chosen, experts)
    real = valid.astype(jnp.float32)
    count = jnp.maximum(jnp.sum(real), 1.0)
    share = jnp.sum(jax.nn.one_hot(chosen, experts, dtype=jnp.float32), axis=(0, 1, 2)) / (k * count)
    mean_prob = jnp.sum(probs * real[..., None], axis=(0, 1)) / count
    stats = {
        "load": share,
        "balance_loss": experts * jnp.sum(jax.lax.stop_gradient(share) * mean_prob),
        "router_z": jnp.sum(jnp.square(jax.nn.logsumexp(logits, axis=-1)) * real) / count,
    }
    return chosen, weights, stats


def empty_statistics(arch) -> dict:
    """Zeros shaped as the MoE layers' statistics (Decoder.loss_sums), with multi-token prediction's sums under
    "mtp" (trainer/model/mtp.py), to sum microbatches' into; {} if dense without it."""
    m, out = arch.moe, {}
    if arch.mtp.depth:
        out["mtp"] = {"ce": jnp.zeros((arch.mtp.depth,), jnp.float32), "count": jnp.zeros((arch.mtp.depth,))}
    if not m.num_experts:
        return out
    layers = m.moe_layers(arch.n_layers)
    zeros = {name: jnp.zeros((layers,), jnp.float32) for name in ("balance_loss", "router_z", "dropped")}
    return {**out, **zeros, "load": jnp.zeros((layers, m.num_experts), jnp.float32)}


def _whole(w: jax.Array, dim: int, axes) -> jax.Array:
    """A weight gathered along `dim` over the mesh axes that split it (none: as it is)."""
    if not axes:
        return w
    return jax.lax.all_gather(w, axes, axis=dim, tiled=True)


def grouped_matmul(kind: str, platform: str):
    """`model.moe.grouped_matmul` on devices of `platform`: f(x (m, d), w (groups, d, n), sizes) gives each
    group's rows (the first sizes[0] rows, then the next sizes[1], ...) times its matrix, zeros past them.
    auto: megablox's Pallas kernel on a TPU, jax.lax.ragged_dot elsewhere; megablox off a TPU runs in
    Pallas' interpreter (slow: for checking it)."""
    if (kind == "auto" and platform != "tpu") or kind == "ragged_dot":
        return jax.lax.ragged_dot
    interpret = platform != "tpu"

    def megablox(x, w, sizes):
        m = x.shape[0]
        tm = min(128, -(-m // 8) * 8)  # row tiles of 128 (8 at the least): the rows are padded to whole tiles
        # The kernel leaves rows past the groups unwritten, in its output and in x's gradient: both masked.
        valid = (jnp.arange(m) < jnp.sum(sizes))[:, None]
        padded = jnp.pad(jnp.where(valid, x, 0), ((0, -m % tm), (0, 0)))
        tiling = (tm, min(128, x.shape[1]), min(128, w.shape[2]))
        out = gmm(padded, w, sizes, x.dtype, tiling, interpret=interpret)[:m]
        return jnp.where(valid, out, 0)

    return megablox


def _swiglu_grouped(x, gate, up, down, sizes, matmul):
    hidden = jax.nn.silu(matmul(x, gate, sizes)) * matmul(x, up, sizes)
    return matmul(hidden, down, sizes)


def _dropless(x, chosen, weights, gate, up, down, ep: int, axis, matmul=jax.lax.ragged_dot):
    """Each token's output from its experts, no assignment dropped; see the module's docstring."""
    tokens, d = x.shape
    k, local = chosen.shape[-1], gate.shape[0]
    n = tokens * k
    expert = chosen.reshape(n)
    order = jnp.argsort(expert, stable=True)
    token = order // k  # assignment a is token a // k's (a % k)-th choice
    sorted_expert = expert[order]
    dest = sorted_expert // local
    counts = jnp.bincount(dest, length=ep)
    start = jnp.cumsum(counts) - counts
    slot = jnp.arange(n)
    rows = jnp.minimum(start[:, None] + slot[None, :], n - 1)  # (ep, n): destination j's slot r
    filled = slot[None, :] < counts[:, None]
    send = jnp.where(filled[..., None], x[token[rows]], 0)
    ids = jnp.where(filled, sorted_expert[rows] % local, local)  # `local`: an empty slot
    if ep > 1:
        send, ids = (jax.lax.all_to_all(a, axis, 0, 0, tiled=True) for a in (send, ids))
    send, ids = send.reshape(ep * n, d), ids.reshape(ep * n)
    by_expert = jnp.argsort(ids, stable=True)  # empty slots last, beyond every group
    sizes = jnp.bincount(ids, length=local + 1)[:local].astype(jnp.int32)
    out = _swiglu_grouped(send[by_expert], gate, up, down, sizes, matmul)
    out = jnp.zeros_like(out).at[by_expert].set(out).reshape(ep, n, d)
    if ep > 1:
        out = jax.lax.all_to_all(out, axis, 0, 0, tiled=True)
    back = out[dest, slot - start[dest]]  # sorted assignment a came back in its destination's slot
    weight = jnp.where(dest < ep, weights.reshape(n)[order], 0).astype(back.dtype)  # padding (dest ep) went nowhere
    return jnp.zeros((tokens, d), back.dtype).at[token].add(back * weight[:, None]), jnp.zeros((), jnp.float32)


def _capacity(x, chosen, weights, gate, up, down, ep: int, axis, factor: float, run=None):
    """Each token's output from the experts that had room for it, and the assignments dropped."""
    tokens, d = x.shape
    k, local = chosen.shape[-1], gate.shape[0]
    experts, n = local * ep, tokens * k
    room = max(1, math.ceil(factor * n / experts))
    expert = chosen.T.reshape(n)  # first choices of every token, then second choices, ...
    token = jnp.tile(jnp.arange(tokens), k)
    taken = jax.nn.one_hot(expert, experts, dtype=jnp.int32)
    place = jnp.sum((jnp.cumsum(taken, axis=0) - 1) * taken, axis=-1)  # the assignment's place in its expert
    routed = expert < experts  # padding's choices (id `experts`) take no room
    kept = (place < room) & routed
    slot = jnp.where(kept, expert * room + place, experts * room)  # out of range: dropped by the scatter
    buffer = jnp.zeros((experts * room, d), x.dtype).at[slot].set(x[token], mode="drop")
    buffer = buffer.reshape(ep, local, room, d)
    if ep > 1:
        buffer = jax.lax.all_to_all(buffer, axis, 0, 0, tiled=True)  # now (source, local expert, room, d)
    buffer = buffer.transpose(1, 0, 2, 3).reshape(local, ep * room, d)
    hidden = jax.nn.silu(einsum("ecd,edf->ecf", buffer, gate, run, "experts")) * einsum("ecd,edf->ecf", buffer, up,
                                                                                        run, "experts")  # fmt: skip
    out = einsum("ecf,efd->ecd", hidden, down, run, "experts").reshape(local, ep, room, d).transpose(1, 0, 2, 3)
    if ep > 1:
        out = jax.lax.all_to_all(out, axis, 0, 0, tiled=True)
    out = out.reshape(experts * room, d)
    back = jnp.where(kept[:, None], out[jnp.minimum(slot, experts * room - 1)], 0)
    weight = weights.T.reshape(n).astype(back.dtype)
    dropped = jnp.sum(routed & ~kept).astype(jnp.float32)
    return jnp.zeros((tokens, d), back.dtype).at[token].add(back * weight[:, None]), dropped


def _fitting(spec, shape, mesh):
    """`spec` less the mesh axes that do not divide an array of `shape` (a batch of a few rows, as an
    evaluation or a prompt may have): those rows are then repeated on the devices of the axes left out."""
    dims = []
    for entry, size in zip(spec, shape, strict=False):
        kept = []
        for axis in () if entry is None else (entry,) if isinstance(entry, str) else entry:
            if size % (math.prod(mesh.shape[a] for a in kept) * mesh.shape[axis]):
                break
            kept.append(axis)
        dims.append(tuple(kept) or None)
    return jax.P(*dims)


def experts(x, chosen, weights, gate, up, down, shard: LogicalSharding, run):
    """The routed experts' output for tokens x (b, t, d) and the share of assignments dropped; weights
    (experts, d, d_ff) and (experts, d_ff, d) as the rules place them; `run` the model's Execution."""
    platform = (jax.devices() if shard.mesh is None else shard.mesh.devices.flat)[0].platform
    matmul = grouped_matmul(run.grouped_matmul, platform)

    def local(x, chosen, weights, gate, up, down, axes):
        b, t, d = x.shape
        gate, up = (_whole(w, 1, axes["embed_in"]) for w in (gate, up))
        down = _whole(down, 2, axes["embed_out"])
        ep = 1 if not axes["expert"] else jax.lax.axis_size(AXIS)
        args = (x.reshape(b * t, d), chosen.reshape(b * t, -1), weights.reshape(b * t, -1), gate, up, down, ep, AXIS)
        if run.moe_impl == "capacity":
            out, dropped = _capacity(*args, run.capacity_factor, run)
        else:
            out, dropped = _dropless(*args, matmul)
        if axes["mlp"]:  # each device's d_ff slice gave a partial sum
            out = jax.lax.psum(out, axes["mlp"])
        assignments = jnp.sum(chosen < ep * gate.shape[0]).astype(jnp.float32)  # padding's are none
        if axes["tokens"]:  # over the whole batch
            dropped, assignments = jax.lax.psum((dropped, assignments), axes["tokens"])
        if axes["repeated"]:  # every device of these axes computed the same rows (decoding's): say so
            out = jax.lax.pmean(out, axes["repeated"])
        return out.reshape(b, t, d), dropped / jnp.maximum(assignments, 1.0)

    if shard.mesh is None:
        none = dict.fromkeys(("embed_in", "embed_out", "expert", "mlp", "tokens", "repeated"), ())
        return local(x, chosen, weights, gate, up, down, none)
    # d_model whole on every device, whatever the rules do with an activation's embed axis (decoding's
    # replicated rows leave it to the weights' axes)
    tokens = routes = _fitting(shard.spec(TOKENS), x.shape, shard.mesh)
    x = jax.lax.with_sharding_constraint(x, jax.NamedSharding(shard.mesh, tokens))
    w_in, w_out = shard.spec(("expert", "embed", "mlp")), shard.spec(("expert", "mlp", "embed"))

    def named(entry) -> tuple[str, ...]:
        return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)

    axes = {"embed_in": named(w_in[1]), "embed_out": named(w_out[2]), "expert": named(w_in[0]),
            "mlp": named(w_in[2]), "tokens": tuple(a for e in routes for a in named(e))}  # fmt: skip
    axes["repeated"] = tuple(a for a in (*axes["embed_in"], *axes["expert"]) if a not in axes["tokens"])
    if axes["expert"] not in ((), (AXIS,)):
        raise ValueError(f"the experts must be split over the '{AXIS}' mesh axis alone, not {axes['expert']}")
    # megablox's pallas_call says nothing of how its output varies over the mesh, so shard_map cannot check
    # it; the tests compare that path's gradients on a mesh with one device's.
    mapped = jax.shard_map(lambda *a: local(*a, axes), mesh=shard.mesh,
                           in_specs=(tokens, routes, routes, w_in, w_in, w_out),
                           out_specs=(tokens, jax.P()),
                           check_vma=run.moe_impl == "capacity" or matmul is jax.lax.ragged_dot)  # fmt: skip
    return mapped(x, chosen, weights, gate, up, down)


class MoE(nnx.Module):
    """The routed experts and any shared ones, in place of a block's MLP; returns (output, statistics)."""

    def __init__(self, spec, shard: LogicalSharding, rngs: nnx.Rngs):

        a, m = spec.arch, spec.arch.moe
        d, f, e = a.d_model, a.expert_d_ff, m.num_experts
        std = spec.hidden_init_std
        out_std = std / (2 * a.n_layers) ** 0.5
        self.router = param(rngs, (d, e), ("embed", None), std)
        # Moved by the train step only (its gradient is zero: it only takes part in the top-k's choice).
        self.router_bias = nnx.Param(jnp.zeros((e,), jnp.float32), sharding_names=(None,), eager_sharding=False)
        self.w_gate = param(rngs, (e, d, f), ("expert", "embed", "mlp"), std)
        self.w_up = param(rngs, (e, d, f), ("expert", "embed", "mlp"), std)
        self.w_down = param(rngs, (e, f, d), ("expert", "mlp", "embed"), out_std)
        self.shared = MLP(spec, shard, rngs, width=m.shared_experts * f) if m.shared_experts else None
        if m.shared_experts and m.shared_gate:
            self.w_shared_gate = param(rngs, (d,), ("embed",), std)
        self.k, self.config, self.execution, self.shard = m.experts_per_token, m, spec.execution, shard

    def __call__(self, x, valid=None, key=None):
        """`valid` (b, t): the tokens that are not padding (None: all are). `key`: the shared experts' adapters'
        dropout key (training)."""
        run, dt = self.execution, self.execution.compute_dtype
        chosen, weights, stats = route(x, self.router[...], self.router_bias[...], self.k, valid, self.config)
        weights_in_dt = (w[...].astype(dt) for w in (self.w_gate, self.w_up, self.w_down))
        out, stats["dropped"] = experts(x, chosen, weights, *weights_in_dt, self.shard, run)
        if self.shared is not None:
            shared = self.shared(x, key)
            if hasattr(self, "w_shared_gate"):
                gate = jnp.einsum("btd,d->bt", x, self.w_shared_gate[...].astype(dt)).astype(jnp.float32)
                shared = shared * jax.nn.sigmoid(gate)[..., None].astype(shared.dtype)
            out = out + shared
        return out.astype(x.dtype), stats
