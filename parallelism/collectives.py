"""What a compiled step communicates, read from its HLO, and what the textbook says it should.

Collectives inside loops (the layer scan, the microbatch scan) run once per
iteration, so each is counted with the trip counts of the loops around it.
Bytes are per device and per step: `bytes` is the size of the collective's
result, `sent` what a ring algorithm sends for it over a group of N devices:
all-gather (N-1)/N x result, reduce-scatter (N-1) x result (the result is one
shard), all-reduce 2(N-1)/N x result, all-to-all (N-1)/N x result.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
DTYPE_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2,
               "u16": 2, "s8": 1, "u8": 1, "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1}  # fmt: skip

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_OP = re.compile(r"=\s*(.+?)\s+(" + "|".join(KINDS) + r")(?:-start)?\(")
_ARRAY = re.compile(r"([a-z0-9]+)\[([\d,]*)\]")
_CALLEE = re.compile(r"\b(body|calls|branch_computations)=\{?%([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _bytes(shape_text: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(shape_text):
        if dtype in DTYPE_BYTES:
            total += DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _result_bytes(op: re.Match, line: str) -> int:
    """The result's bytes. An async all-gather or permute (`*-start`, as accelerators emit them)
    returns (operand, result, ...): only the second is what arrives."""
    kind, shape = op.group(2), op.group(1)
    if f"{kind}-start(" in line and kind in ("all-gather", "collective-permute") and shape.startswith("("):
        dtype, dims = _ARRAY.findall(shape)[1]
        return _bytes(f"{dtype}[{dims}]")
    return _bytes(shape)


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
    """{kind: {"count", "bytes", "sent"}} per device per step, loops unrolled by their trip counts."""
    ops: dict[str, list[tuple[str, int, int]]] = defaultdict(list)
    calls: dict[str, list[tuple[str, int]]] = defaultdict(list)
    entry, current = None, None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = header.group(1)
            if line.startswith("ENTRY"):
                entry = current
            continue
        if current is None:
            continue
        op = _OP.search(line)
        if op and "-done(" not in line:
            ops[current].append((op.group(2), _result_bytes(op, line), _group_size(line)))
        trips = _TRIP.search(line)
        for role, callee in _CALLEE.findall(line):
            calls[current].append((callee, int(trips.group(1)) if role == "body" and trips else 1))

    totals = {k: {"count": 0, "bytes": 0.0, "sent": 0.0} for k in KINDS}

    def visit(name: str, times: int, depth: int = 0) -> None:
        if depth > 50:
            return
        for kind, size, n in ops[name]:
            if n > 1:
                totals[kind]["count"] += times
                totals[kind]["bytes"] += times * size
                totals[kind]["sent"] += times * _sent(kind, size, n)
        for callee, trip in calls[name]:
            visit(callee, times * trip, depth + 1)

    if entry is not None:
        visit(entry, 1)
    return {k: v for k, v in totals.items() if v["count"]}


def textbook(n_params: int, mesh_shape: dict[str, int], *, n_layers: int, d_model: int, seq_len: int,
             micro_rows: int, microbatches: int, act_bytes: int) -> dict[str, float]:  # fmt: skip
    """Bytes each device sends per step in the standard schemes, fp32 weights and gradients.

    FSDP (ZeRO-3): all-gather the weights for the forward and again for the
    backward, reduce-scatter the gradients: 3 (F-1)/F x weight bytes, once per
    microbatch. Data parallelism: all-reduce the (FSDP-sharded) gradients,
    2 (D-1)/D x their bytes. Tensor parallelism (Megatron): two activation
    all-reduces per layer forward and two backward, 4 L x 2 (T-1)/T x b s d.
    """
    d, f, t = mesh_shape["data"], mesh_shape["fsdp"], mesh_shape["tensor"]
    weights = 4 * n_params / t  # what one tensor shard's fsdp group holds, in fp32
    out = {"all-gather": 0.0, "reduce-scatter": 0.0, "all-reduce": 0.0}
    if f > 1:
        out["all-gather"] += microbatches * 2 * (f - 1) / f * weights
        out["reduce-scatter"] += microbatches * (f - 1) / f * weights
    if d > 1:
        out["all-reduce"] += microbatches * 2 * (d - 1) / d * weights / f
    if t > 1:
        rows = micro_rows / (d * f)
        out["all-reduce"] += microbatches * 4 * n_layers * 2 * (t - 1) / t * rows * seq_len * d_model * act_bytes
    return {k: v for k, v in out.items() if v}
