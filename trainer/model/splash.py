"""The splash attention kernel (JAX's Pallas flash attention for TPUs): how the decoder calls it, the
blocks it runs with, and what one call costs, counted from the kernel's own schedule.

The kernel's work is inside a Mosaic custom call whose body the HLO does not describe. Its forward
walks a grid (query head, query block i, key block j) and its fused backward (key block j, query head,
query block i). The causal mask's block map (splash_attention_mask_info, the arrays the kernel is
given) says which steps compute (a block above the diagonal is skipped) and which block each step's
index maps point at. Pallas' pipeline copies an input block from HBM only when its block index changes
from the step before, and writes an output block back when its index changes. `call_cost` replays that
schedule: FLOPs of the steps that compute, bytes of the copies that happen. Two of the kernel's ways
cost more than the textbook: the softmax residual (logsumexp) is stored 128 lanes wide in float32, and
the fused backward writes a partial dq for every (key block, query block) step, zeros included, that
XLA then sums.
"""

from __future__ import annotations

import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as mask_info

from parallelism.chips import CHIPS, chip_of
from trainer.model.context import AXIS, gathered, ways, zigzag

LANES, SUBLANES = 128, 8  # a TPU vreg's shape: the kernel pads per-row residuals and ids to it
BLOCKS = (128, 256, 512, 1024)  # the kernel needs multiples of 128; 1024 x 1024 float32 scores are 4 MiB of VMEM
MAX_BLOCK_WIDTH = 1024 * 128  # block x head_dim: the most the fused backward's VMEM takes (see block_size)
DEFAULT_BLOCK = 512  # MaxText's default, for a device with no known peak and bandwidth (a CPU in interpret mode)
WINDOW_SCOPE = "sliding_window_"  # + the window: the name scope of a local layer's calls


def block_size(seq_len: int, head_dim: int, group: int, device_kind: str) -> int:
    """Query and key block for this shape: of the BLOCKS that divide the sequence, the largest whose forward
    and backward calls' roofline on the chip (`call_cost`'s FLOPs over its peak or bytes over its bandwidth,
    whichever is longer) is within 5% of the lowest. Larger blocks re-read keys and values (and write dq
    partials) fewer times and take fewer grid steps, whose fixed cost the roofline leaves out; smaller ones
    waste fewer FLOPs on the diagonal's half-masked blocks. Chosen by this model, not timed (there is no TPU
    here). A chip the table does not know gets 512 or the largest below it that divides; a sequence no
    block divides is one block."""
    # VMEM holds a block's q, k, v, dq partial and f32 accumulators, head_dim wide: past 128 x 1024 per block
    # the fused backward runs out of it (Gemma 3's heads of 256 at 1024-token blocks on v5e, configs/gemma3_1b.py).
    fits = [b for b in BLOCKS if seq_len % b == 0 and b * head_dim <= MAX_BLOCK_WIDTH]
    if not fits and seq_len % BLOCKS[0] == 0:
        fits = [BLOCKS[0]]
    if not fits:
        return seq_len
    chip = CHIPS.get(chip_of(device_kind) or "")
    if chip is None:
        return max(b for b in fits if b <= DEFAULT_BLOCK) if min(fits) <= DEFAULT_BLOCK else min(fits)

    def roofline(b: int) -> float:
        costs = [call_cost(phase, group, 1, seq_len, head_dim, 1, 2, b, b, segmented=True) for phase in ("fwd", "dkv")]
        return max(sum(f for f, _ in costs) / chip.peak_flops, sum(m for _, m in costs) / chip.hbm_bytes_per_second)

    best = min(roofline(b) for b in fits)
    return max(b for b in fits if roofline(b) <= 1.1 * best)


def _mask(seq_len: int, window: int, context: int):
    """The causal mask, or with a `window` the local one (a query sees itself and the window - 1 keys before
    it): the kernel's block map then skips the blocks outside the window as it does those above the diagonal.
    Over a context axis its query positions are the zig-zag layout's."""
    if window:
        mask = splash_mask.LocalMask((seq_len, seq_len), window_size=(window - 1, 0), offset=0)
    else:
        mask = splash_mask.CausalMask((seq_len, seq_len))
    if context > 1:
        mask.q_sequence = zigzag(seq_len, context).astype(np.int32)
    return mask


@functools.lru_cache(maxsize=32)
def _kernel(seq_len: int, group: int, block: int, interpret: bool, context: int = 1, block_kv: int | None = None,
            window: int = 0):  # fmt: skip
    """A causal kernel (over a sliding `window`, if any) for one key/value head and the `group` query heads
    that share it (MQA form).

    Over a context axis the queries arrive in the zig-zag layout, split into `context` shards (each
    device's), and the keys in the sequence's order: the mask's query positions (`q_sequence`, which the
    kernel and its block map read) are then the layout's original positions."""
    mask = splash_mask.MultiHeadMask([_mask(seq_len, window, context)] * group)
    kv = block_kv or block
    # The fused backward writes a dq partial per key block: over the gathered keys of a long sequence that is
    # (seq / block) x dq's size (128k tokens, context 8: 128 x 16k queries), so there dq has its own kernel.
    fused = context == 1
    split = {} if fused else dict(block_q_dq=block, block_kv_dq=kv)
    sizes = splash.BlockSizes(block_q=block, block_kv=kv, block_kv_compute=kv, block_q_dkv=block, block_kv_dkv=kv,
                              block_kv_dkv_compute=kv, use_fused_bwd_kernel=fused, **split)  # fmt: skip
    # Made inside a trace and cached for the next: its block map must be concrete arrays, not that trace's.
    with jax.ensure_compile_time_eval():
        return splash.make_splash_mqa(mask, block_sizes=sizes, head_shards=1, q_seq_shards=context,
                                      interpret=interpret)  # fmt: skip


def splash_attention(q, k, v, segment_ids=None, shard=None, block: int | None = None, window: int = 0,
                     sinks=None):  # fmt: skip
    """The Pallas kernel on each device's shard: a Mosaic kernel cannot be partitioned by XLA, so it
    runs under shard_map, batch split over the batch axes and heads over `tensor`, each device
    holding whole sequences (sequence-parallel layouts are gathered first).

    With the sequence split over the context axis (model.context_attention=all_gather), each device
    keeps its queries and gathers the keys, values and their segment ids from the whole axis, putting
    them back in the sequence's order; the kernel's mask reads its queries' original positions, and its
    block map skips the blocks the causal mask hides. The backward reduce-scatters the keys' and
    values' gradients (the gather's transpose). `sinks` (heads,): attention sinks' logits, which the
    kernel takes per query head."""
    _, t, n, h = q.shape
    kv_heads = k.shape[2]
    mesh = None if shard is None else shard.mesh
    device = (jax.devices() if mesh is None else mesh.devices.flat)[0]
    group, context = n // kv_heads, 1 if shard is None else ways(shard)
    block = block or block_size(t // context, h, group, device.device_kind)
    # Key blocks below the kernel's 128 (a short device share of a short sequence): the keys in one block.
    block_kv = block if block % 128 == 0 else t
    kernel = _kernel(t, group, block, device.platform != "tpu", context, block_kv, window)

    def local(kernel, q, k, v, segment_ids, sinks):
        kv_ids = segment_ids
        if context > 1:
            k, v, kv_ids = (gathered(x, t, context) for x in (k, v, segment_ids))
        rows, local_kv = q.shape[0], k.shape[2]
        # (rows, t, heads, h) -> (rows, kv heads, group, t, h): query heads grouped by their kv head
        qg = (q * h**-0.5).reshape(rows, q.shape[1], local_kv, -1, h).transpose(0, 2, 3, 1, 4)
        kg, vg = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

        def one(q, k, v, q_ids, kv_ids, sinks):
            ids = None if q_ids is None else splash.SegmentIds(q_ids, kv_ids)
            return kernel(q, k, v, segment_ids=ids, **({} if sinks is None else {"sinks": sinks}))

        ids_axis = None if segment_ids is None else 0
        sinks_axis = None if sinks is None else 0
        if sinks is not None:  # each row's copy (rows, t, heads): its first position's, grouped by kv head
            sinks = sinks[:, 0].astype(jnp.float32).reshape(rows, local_kv, -1)
        per_row = jax.vmap(one, in_axes=(0, 0, 0, None, None, sinks_axis))  # over kv heads
        out = jax.vmap(per_row, in_axes=(0, 0, 0, ids_axis, ids_axis, sinks_axis))(qg, kg, vg, segment_ids, kv_ids,
                                                                                    sinks)  # fmt: skip
        return out.transpose(0, 3, 1, 2, 4).reshape(rows, q.shape[1], -1, h).astype(q.dtype)

    if sinks is not None:
        # One copy a row and position, split as the queries are: each device's gradient lands in its own
        # copies and the broadcast's transpose sums them (a replicated input's gradient under shard_map
        # without its checks would be one device's alone).
        sinks = jnp.broadcast_to(sinks, (q.shape[0], t, n))
    if window:  # the window in the calls' names (op_name), where a compiled HLO's reader (hlo_call_cost) finds it
        with jax.named_scope(f"{WINDOW_SCOPE}{window}"):
            return _sharded(local, kernel, q, k, v, segment_ids, sinks, shard, context)
    return _sharded(local, kernel, q, k, v, segment_ids, sinks, shard, context)


def _sharded(local, kernel, q, k, v, segment_ids, sinks, shard, context: int):
    """`local` on each device's shard (under shard_map), or whole without a mesh."""
    mesh = None if shard is None else shard.mesh
    if mesh is None:
        return local(kernel, q, k, v, segment_ids, sinks)
    seq = "seq" if context > 1 else None
    heads = shard.spec(("batch", seq, "heads", None))
    kv = shard.spec(("batch", seq, "kv_heads", None))
    # Each device's share of the kernel's block map: its queries' rows (the whole map without context).
    kernel_spec = kernel.manual_sharding_spec(jax.NamedSharding(mesh, jax.P(None, AXIS if context > 1 else None)))
    optional = {"ids": (segment_ids, shard.spec(("batch", seq))), "sinks": (sinks, shard.spec(("batch", seq, "heads")))}
    given = {name: pair for name, pair in optional.items() if pair[0] is not None}

    def body(kernel, q, k, v, *rest):
        named = dict(zip(given, rest, strict=True))
        return local(kernel, q, k, v, named.get("ids"), named.get("sinks"))

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(kernel_spec, heads, kv, kv, *(s for _, s in given.values())),
                           out_specs=heads, check_vma=False)  # fmt: skip
    return mapped(kernel, q, k, v, *(a for a, _ in given.values()))


def _fetches(indices: np.ndarray) -> int:
    """Copies a pipeline makes of an operand whose block index, step by step, is `indices` (rows of
    index tuples, or plain indices): the first step's, then one each time the index changes."""
    indices = indices.reshape(len(indices), -1)
    return 1 + int(np.any(indices[1:] != indices[:-1], axis=1).sum()) if len(indices) else 0


@functools.lru_cache(maxsize=64)
def _schedule(seq_len: int, bq: int, bkv: int, heads: int, kv_heads: int, context: int = 1,
              window: int = 0) -> dict[str, int]:  # fmt: skip
    """Steps that compute, and copies of each kind of block, in one causal call over `heads` query heads
    sharing `kv_heads` key/value heads (1: the multi-query form). With `context` > 1, one device's call over
    the gathered keys: its queries are a 1/context share of the sequence in the zig-zag layout (as
    `_kernel` makes it), and the share counted is the busiest device's (zig-zag evens them to a block or so)."""
    mask = splash_mask.MultiHeadMask([_mask(seq_len, window, context)] * heads)
    group, out = heads // kv_heads, {}
    # Forward and dq: grid (head h, query block i, step j); step j's key/value block is data_next[i, j].
    # Over a context axis the maps' rows are the devices' shares, one after another (mask_info pads them alike).
    fwd, _ = mask_info.process_mask(mask, (bq, bkv), q_seq_shards=context)
    rows = fwd.block_mask.shape[1] // context
    device = max(range(context), key=lambda s: int((fwd.block_mask[0, s * rows : (s + 1) * rows] > 0).sum()))
    share = slice(device * rows, (device + 1) * rows)
    runs, kv = fwd.block_mask[0, share] > 0, fwd.data_next[0, share].astype(int)  # every head has the same map
    h, i, j = (g.ravel() for g in np.meshgrid(np.arange(heads), *map(np.arange, runs.shape), indexing="ij"))
    out["fwd"] = {"runs": heads * int(runs.sum()), "q": _fetches(np.stack([h, i], 1)), "rows": _fetches(i),
                  "kv": _fetches(np.stack([h // group, kv[i, j]], 1)), "kv_ids": _fetches(kv[i, j])}  # fmt: skip
    # dkv: grid (key block j, head h, step i); step i's query block is data_next[i, j].
    dkv, _ = mask_info.process_mask_dkv(mask, (bq, bkv), q_seq_shards=context)
    rows = dkv.block_mask.shape[1] // context
    share = slice(device * rows, (device + 1) * rows)
    runs, qi = dkv.block_mask[0, share] > 0, dkv.data_next[0, share].astype(int)
    j, h, i = (g.ravel() for g in np.meshgrid(np.arange(runs.shape[1]), np.arange(heads), np.arange(runs.shape[0]),
                                              indexing="ij"))  # fmt: skip
    out["dkv"] = {"runs": heads * int(runs.sum()), "q": _fetches(np.stack([h, qi[i, j]], 1)),
                  "rows": _fetches(qi[i, j]), "kv": _fetches(np.stack([h // group, j], 1)), "kv_ids": _fetches(j),
                  "steps": len(j)}  # fmt: skip
    out["positions"] = int(fwd.q_sequence is not None)  # query positions handed in for the mask function
    return out


def call_cost(
    phase: str,
    heads: int,
    kv_heads: int,
    seq_len: int,
    head_dim: int,
    instances: int,
    itemsize: int,
    bq: int,
    bkv: int,
    *,
    segmented: bool,
    residuals: bool = True,
    fused: bool = True,
    context: int = 1,
    window: int = 0,
) -> tuple[int, int]:
    """(FLOPs, HBM bytes) of one kernel call over `instances` (the batch rows and heads it is vmapped
    over) of `heads` query heads on `kv_heads` key/value heads (1 in the multi-query form we call), q, k,
    v and their gradients `itemsize` bytes an element, segment ids given if `segmented`; with `context` > 1
    one device's call over the gathered keys (`_schedule`), `seq_len` the whole sequence; with a `window` the
    local mask's blocks (those the kernel runs). `phase` is "fwd"
    (saving the softmax residual if `residuals`), "dkv" (with dq too if `fused`) or "dq". Matmuls, each
    2 x rows x columns x depth in every step that computes: QK^T and PV forward; QK^T, dP and dQ in dq;
    QK^T, dV, dP and dK in dkv, and dQ when fused."""
    s, d, b = _schedule(seq_len, bq, bkv, heads, kv_heads, context, window), head_dim, itemsize
    ids = int(segmented) + s["positions"]  # int32 per-query-row operands, padded to a vreg's lanes/sublanes
    block = 2 * bq * bkv * d  # one matmul's FLOPs on one block
    if phase in ("fwd", "dq"):
        f = s["fwd"]
        moved = (f["kv"] * bkv * d * b * 2  # k, v
                 + f["rows"] * bq * LANES * 4 * ids
                 + f["kv_ids"] * SUBLANES * bkv * 4 * int(segmented))  # fmt: skip  # key segment ids
        if phase == "fwd":
            flops = f["runs"] * 2 * block
            moved += (f["q"] * bq * d * b * 2  # q read, out written
                      + f["q"] * bq * LANES * 4 * int(residuals)  # logsumexp, float32 x 128 lanes
                      + (2 * bq * LANES + bq * d) * 4)  # fmt: skip  # the m, l and o scratch, written once
        else:
            flops = f["runs"] * 3 * block
            moved += f["q"] * (bq * d * b * 3 + bq * 4 * 2) + bq * d * 4  # q, dO, dq; logsumexp, di; scratch
    elif phase == "dkv":
        f = s["dkv"]
        flops = f["runs"] * (5 if fused else 4) * block
        moved = (f["q"] * bq * d * b * 2  # q, dO
                 + f["q"] * SUBLANES * bq * 4 * 2  # logsumexp and di, float32 x 8 sublanes
                 + f["rows"] * SUBLANES * bq * 4 * ids
                 + f["kv"] * bkv * d * b * 4  # k, v read; dk, dv written
                 + f["kv_ids"] * bkv * LANES * 4 * int(segmented)  # key segment ids
                 + f["steps"] * bq * d * b * int(fused)  # dq partials, one block per step
                 + 2 * bkv * d * 4)  # fmt: skip  # the dk and dv scratch, written once
    else:
        raise ValueError(f"no cost model for the splash kernel's '{phase}' phase")
    return instances * flops, instances * moved


_NAME = re.compile(r"splash_(mqa|mha)_(fwd|dkv|dq)(_segmented)?_(residuals|no_residuals)")
_WINDOW = re.compile(WINDOW_SCOPE + r"(\d+)/")
_METADATA = re.compile(r'"xprof_metadata":"(\{.*?\})"')
_ARRAYS = re.compile(r"(bf16|f16|f32)\[([\d,]+)\]")


def hlo_call_cost(line: str) -> tuple[int, int] | None:
    """(FLOPs, HBM bytes) of a splash call as a compiled HLO writes it (its instruction's text, continuation
    lines included), ours or another program's: the form and phase from the kernel's name, the block sizes
    from the metadata the kernel attaches, the shapes from its operands (q [instances..., heads, seq,
    head_dim], then k: [instances..., seq, head_dim] multi-query, [instances..., kv heads, seq, head_dim]
    multi-head). A call whose keys are `context` times its queries is one device's share of a context axis
    over the gathered keys, its queries taken to be in our zig-zag layout. None for a custom call that is not
    a splash call."""
    name, meta = _NAME.search(line), _METADATA.search(line)
    operands = line.find("operand_layout_constraints=")
    if not (name and meta and operands >= 0):
        return None
    sizes = json.loads(meta.group(1).replace('\\"', '"'))
    form, phase, segmented, residuals = name.group(1), name.group(2), bool(name.group(3)), name.group(4) == "residuals"
    (dtype, q), (_, k) = _ARRAYS.findall(line[operands:])[:2]  # the first two float operands: q, k
    *outer, heads, queries, head_dim = (int(n) for n in q.split(","))
    seq_len = int(k.split(",")[-2])
    if seq_len % queries:
        return None
    kv_heads = 1 if form == "mqa" else int(k.split(",")[-3])
    suffix = {"fwd": "", "dkv": "_dkv", "dq": "_dq"}[phase]
    # The fused backward's results hold dq partials, [instances..., key blocks, heads, seq, head_dim].
    results = _ARRAYS.findall(line[: line.find("custom-call(")])
    fused = any(len(dims.split(",")) == len(outer) + 4 for _, dims in results)
    window = _WINDOW.search(line)  # our local layers' calls (another program's are counted causal)
    itemsize = {"bf16": 2, "f16": 2, "f32": 4}[dtype]
    return call_cost(phase, heads, kv_heads, seq_len, head_dim, int(np.prod(outer)), itemsize,
                     sizes[f"block_q{suffix}"], sizes[f"block_kv{suffix}"], segmented=segmented, residuals=residuals,
                     fused=fused, context=seq_len // queries,
                     window=int(window.group(1)) if window else 0)  # fmt: skip
