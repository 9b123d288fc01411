"""What a compiled step communicates, read from its HLO, and what the textbook says it should.

Collectives inside loops (the layer scan, the microbatch scan) run once per
iteration, so each is counted with the trip counts of the loops around it.
TPU's compiler writes a reduce-scatter as a fusion computation named
`all-reduce-scatter*` that holds an all-reduce followed by a slice: it runs as
one reduce-scatter, so it is counted as one, with the fusion's output (the
shard) as its result. Bytes are per device and per step: `bytes` is the size of the collective's
result, `sent` what a ring algorithm sends for it over a group of N devices:
all-gather (N-1)/N x result, reduce-scatter (N-1) x result (the result is one
shard), all-reduce 2(N-1)/N x result, all-to-all (N-1)/N x result.
"""

from __future__ import annotations

import math
import re

from parallelism import hlo

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_FUSED_REDUCE_SCATTER = "all-reduce-scatter"
_CHANNEL = re.compile(r"\bchannel_id=(\d+)")


def _result_bytes(inst: hlo.Instruction, kind: str) -> int:
    """The result's bytes. An async all-gather, reduce-scatter or permute (`*-start`, as accelerators
    emit them) returns (operand, result, ...): only the second element is what arrives. XLA:GPU combines
    several into one, ((operands...), (results...)): the second element is then every result."""
    if inst.opcode == f"{kind}-start" and kind != "all-reduce" and inst.shape.startswith("("):
        return hlo.array_bytes(hlo.tuple_elements(inst.shape)[1])
    return hlo.array_bytes(inst.shape)


def _group_size(line: str) -> int:
    if "source_target_pairs={{" in line:
        return 2  # a collective-permute: each device sends its buffer to one peer
    explicit = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if explicit:
        return len(explicit.group(1).split(","))
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
    if iota:
        return int(iota.group(2))
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\].*?\{('[^}]*')\}", line)
    if mesh:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", mesh.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", mesh.group(2)))
    return 1


def _sent(kind: str, result: int, n: int) -> float:
    if kind == "all-gather" or kind == "all-to-all":
        return (n - 1) / n * result
    if kind == "reduce-scatter":
        return (n - 1) * result
    if kind == "all-reduce":
        return 2 * (n - 1) / n * result
    return result  # collective-permute


def parse(hlo_text: str) -> dict[str, dict[str, float]]:
    """{kind: {"count", "bytes", "sent"}} per device per step, loops unrolled by their trip counts.

    One collective can appear several times: TPU's compiler splits an async one
    into a start fusion, pieces overlapped with compute and a done fusion, each
    holding a copy of it with the same channel_id. Within one execution of a
    computation and everything it calls outside loops, a channel counts in the
    first computation that holds it only.
    """
    module = hlo.read(hlo_text)
    ops: dict[str, list[tuple[str, str, int, int]]] = {}  # computation -> (channel, kind, bytes, group size)
    for name, instructions in module.instructions.items():
        reduce_scatter = name.startswith(_FUSED_REDUCE_SCATTER)
        shard = hlo.array_bytes(module.headers[name].rsplit("->", 1)[1]) if reduce_scatter else 0
        for number, inst in enumerate(instructions):
            kind = inst.opcode.removesuffix("-start")
            if kind not in KINDS:
                continue
            channel = _CHANNEL.search(inst.rest)
            key = channel.group(1) if channel else f"{name}:{number}"
            if reduce_scatter and kind == "all-reduce":
                ops.setdefault(name, []).append((key, "reduce-scatter", shard, _group_size(inst.line)))
            else:
                ops.setdefault(name, []).append((key, kind, _result_bytes(inst, kind), _group_size(inst.line)))

    def gather(name: str, found: dict, counted: list, loops: list, depth: int = 0) -> None:
        """Collectives of one execution of `name` and its non-loop callees, by channel; loops aside."""
        if depth > hlo.MAX_DEPTH:
            return
        for key, kind, size, n in ops.get(name, []):
            if found.setdefault(key, name) == name:  # XLA:CPU reuses one channel within a computation
                counted.append((kind, size, n))
        for callee, trip in module.calls[name]:
            if trip is None:
                gather(callee, found, counted, loops, depth + 1)
            else:
                loops.append((callee, trip))

    totals = {k: {"count": 0, "bytes": 0.0, "sent": 0.0} for k in KINDS}

    def visit(name: str, times: int, depth: int = 0) -> None:
        counted, loops = [], []
        gather(name, {}, counted, loops)
        for kind, size, n in counted:
            if n > 1:
                totals[kind]["count"] += times
                totals[kind]["bytes"] += times * size
                totals[kind]["sent"] += times * _sent(kind, size, n)
        for body, trips in loops:
            if depth < hlo.MAX_DEPTH:
                visit(body, times * trips, depth + 1)

    if module.entry is not None:
        visit(module.entry, 1)
    return {k: v for k, v in totals.items() if v["count"]}


def textbook(*args, **kwargs) -> dict[str, float]:
    """Bytes each device sends per step in the standard schemes (textbook_parts, its two parts added up by
    collective)."""
    out: dict[str, float] = {}
    for part in textbook_parts(*args, **kwargs).values():
        for kind, sent in part.items():
            out[kind] = out.get(kind, 0.0) + sent
    return out


def textbook_parts(n_params: int, mesh_shape: dict[str, int], *, n_layers: int, d_model: int, seq_len: int,
                   micro_rows: int, microbatches: int, act_bytes: int, kv_width: int = 0,
                   context_attention: str = "ring", expert_params: int = 0, moe_layers: int = 0,
                   experts_per_token: int = 0, exchanged: float = 1.0,
                   recomputed: bool = False) -> dict[str, dict[str, float]]:  # fmt: skip
    """Bytes each device sends per step in the standard schemes, as {"weights": {kind: bytes},
    "activations": {kind: bytes}}: the weights' and gradients' collectives (FSDP, data), which a compiler can
    overlap with the layers' compute, apart from the activations' (tensor, context, expert), which the next
    matmul waits for.

    Weights travel in the compute dtype: XLA casts them before it gathers, and
    the gradient of a cast weight is in the compute dtype until it has been
    reduced (the cast back to fp32 moves after the collective). FSDP (ZeRO-3, over fsdp x context):
    all-gather the weights for the forward and again for the backward,
    reduce-scatter the gradients: 3 (F-1)/F x weight bytes, once per
    microbatch. Data parallelism: all-reduce the (FSDP-sharded) gradients,
    2 (D-1)/D x their bytes. Tensor parallelism (Megatron): two activation
    all-reduces per layer forward and two backward, 4 L x 2 (T-1)/T x b s/C d.
    Context parallelism over C devices, per layer, with KV the bytes of the
    whole sequence's keys and values (`kv_width` = kv heads x head size each)
    for one tensor shard: all_gather gathers them forward and reduce-scatters
    their gradients, (C-1)/C x KV each; the ring passes a 1/C block C-1 times
    forward and C-1 times backward, and the fp32 key/value gradients C times.

    Expert parallelism over E devices (trainer/model/moe.py): the other weights are sharded over it too
    (FSDP over fsdp x context x expert), the `expert_params` (every expert's weights) over fsdp x context
    within their 1/E. Each of `moe_layers` sends its tokens' `experts_per_token` copies to the experts'
    devices and back, forward and backward: 4 all-to-alls of (E-1)/E x the copies' bytes (6 when remat
    `recomputed` the forward), times `exchanged`, the buffer's size over the copies' (a capacity's factor;
    the padded dropless exchange's E).
    """
    d, t, c, e = mesh_shape["data"], mesh_shape["tensor"], mesh_shape.get("context", 1), mesh_shape.get("expert", 1)
    f = mesh_shape["fsdp"] * c  # weights are sharded over context too (parallelism/rules.py)
    out = {"all-gather": 0.0, "reduce-scatter": 0.0, "all-reduce": 0.0}
    act: dict[str, float] = {"all-reduce": 0.0, "all-gather": 0.0, "reduce-scatter": 0.0}
    for params, ways in ((n_params - expert_params, f * e), (expert_params, f)):
        weights = act_bytes * params / t  # what one tensor shard's fsdp group holds
        if ways > 1:
            out["all-gather"] += microbatches * 2 * (ways - 1) / ways * weights / (f * e / ways)
            out["reduce-scatter"] += microbatches * (ways - 1) / ways * weights / (f * e / ways)
        if d > 1:
            out["all-reduce"] += microbatches * 2 * (d - 1) / d * weights / (f * e)
    rows = micro_rows / (d * f / c * e)  # each device's share of a microbatch's rows
    if t > 1:
        act["all-reduce"] += microbatches * 4 * n_layers * 2 * (t - 1) / t * rows * seq_len / c * d_model * act_bytes
    if e > 1 and moe_layers:
        copies = rows * seq_len / c * experts_per_token * d_model * act_bytes
        act["all-to-all"] = microbatches * moe_layers * (6 if recomputed else 4) * (e - 1) / e * copies * exchanged
    if c > 1:
        kv = rows * seq_len * 2 * kv_width / t * act_bytes
        if context_attention == "all_gather":
            act["all-gather"] += microbatches * n_layers * (c - 1) / c * kv
            act["reduce-scatter"] += microbatches * n_layers * (c - 1) / c * kv
        else:
            act["collective-permute"] = microbatches * n_layers * kv / c * (2 * (c - 1) + c * 4 / act_bytes)
    return {"weights": {k: v for k, v in out.items() if v}, "activations": {k: v for k, v in act.items() if v}}
