"""Reading a compiled step's HLO text: its computations, their instructions, and how often each runs.

XLA's own cost analysis counts a while loop's body once, whatever its trip
count, so for a step that scans over layers and microbatches it under-counts
by their product (measured: 71x for llm_1b on TPU). Reading the HLO gives the
trip counts: CPU and GPU write them down (`known_trip_count`); TPU leaves a
condition `counter < N` with the counter from 0, as JAX's scans lower.

`executions` walks from the entry: a computation called by a fusion, call or
branch runs as often as its caller, a loop body as often times its trip count.
On that walk, `matmul_flops` counts every dot and convolution (TPU writes
batched matmuls as padded, dilated convolutions: only taps that land on input
count) and `bytes_accessed` what each unfused instruction reads and writes in
HBM, a fusion reading only the slices it takes of an operand. Checked against
XLA's own counts on a loop-free step (tests/test_targets.py).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

import numpy as np

DTYPE_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2,
               "u16": 2, "s8": 1, "u8": 1, "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1}  # fmt: skip

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
# `%name = SHAPE opcode(operands), attributes`; a tuple shape may hold spaces, hence the lazy match.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
_ARRAY = re.compile(r"([a-z0-9]+)\[([\d,]*)\]")
_CALLEE = re.compile(r"\b(body|calls|branch_computations)=\{?%([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CONDITION = re.compile(r"\bcondition=%([\w.\-]+)")
_S32_CONSTANT = re.compile(r"s32\[\]\S*\s+constant\((\d+)\)")
MAX_DEPTH = 50


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    shape: str  # the result's shape text, e.g. "bf16[4,256]{1,0}" or a tuple of them
    opcode: str
    rest: str  # operands and attributes, as written
    line: str


@dataclasses.dataclass
class Module:
    entry: str | None = None
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    instructions: dict[str, list[Instruction]] = dataclasses.field(default_factory=lambda: defaultdict(list))
    calls: dict[str, list[tuple[str, int | None]]] = dataclasses.field(default_factory=lambda: defaultdict(list))


def array_bytes(shape_text: str) -> int:
    """Bytes of every array named in a shape text (a tuple's elements summed)."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape_text):
        if dtype in DTYPE_BYTES:
            total += DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def tuple_elements(shape_text: str) -> list[str]:
    """The top-level elements of a tuple shape text ("(a, (b, c))" -> ["a", "(b, c)"]); an array is its own one."""
    text = re.sub(r"/\*.*?\*/", "", shape_text).strip()
    if not text.startswith("("):
        return [text]
    elements, depth, start = [], 0, 1
    for i, char in enumerate(text):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        if (char == "," and depth == 1) or depth == 0:
            elements.append(text[start:i].strip())
            start = i + 1
        if depth == 0:
            break
    return [e for e in elements if e]


def dims_of(shape_text: str) -> list[int]:
    """The dimensions of the first array in a shape text."""
    match = _ARRAY.search(shape_text)
    return [int(d) for d in match.group(2).split(",") if d] if match else []


def read(hlo_text: str) -> Module:
    module = Module()
    constants: dict[str, list[int]] = defaultdict(list)
    counts_below: set[str] = set()  # conditions whose result is `counter < constant`
    pending: list[tuple[str, str, int | str | None]] = []
    current = None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = header.group(1)
            module.headers[current] = line
            if line.startswith("ENTRY"):
                module.entry = current
            continue
        if current is None:
            continue
        match = _INSTRUCTION.match(line)
        if match:
            module.instructions[current].append(Instruction(*match.groups()[:3], match.group(4), line))
        elif module.instructions[current] and line.strip() != "}":  # an attribute written over several lines
            last = module.instructions[current][-1]
            module.instructions[current][-1] = dataclasses.replace(last, rest=f"{last.rest}\n{line}",
                                                                   line=f"{last.line}\n{line}")  # fmt: skip
        constants[current] += [int(n) for n in _S32_CONSTANT.findall(line)]
        if line.lstrip().startswith("ROOT") and " compare(" in line and "direction=LT" in line:
            counts_below.add(current)
        trips, condition = _TRIP.search(line), _CONDITION.search(line)
        for role, callee in _CALLEE.findall(line):
            trip = None
            if role == "body":
                trip = int(trips.group(1)) if trips else condition.group(1) if condition else 1
            pending.append((current, callee, trip))
    for caller, callee, trip in pending:
        if isinstance(trip, str):  # the loop's condition computation: read its bound
            bound = constants[trip]
            trip = bound[0] if trip in counts_below and len(bound) == 1 else 1
        module.calls[caller].append((callee, trip))
    return module


def executions(module: Module) -> dict[str, int]:
    """How many times each computation runs per execution of the entry."""
    times: dict[str, int] = defaultdict(int)

    def visit(name: str, n: int, depth: int) -> None:
        if depth > MAX_DEPTH:
            return
        times[name] += n
        for callee, trip in module.calls[name]:
            visit(callee, n * (1 if trip is None else trip), depth + 1)

    if module.entry is not None:
        visit(module.entry, 1, 0)
    return dict(times)


def _operand_names(rest: str) -> list[str]:
    depth, args = 0, ""
    for ch in rest:  # the operand list ends at the parenthesis that closes the opcode's
        if ch == "(":
            depth += 1
        elif ch == ")":
            if depth == 0:
                break
            depth -= 1
        args += ch
    return re.findall(r"%([\w.\-]+)", args)


def _valid_taps(window: dict[str, list[int]], d: int, in_size: int, out_size: int) -> int:
    """(output position, window tap) pairs of spatial dim `d` that land on an input element rather
    than on padding or a dilation hole: TPU writes batched matmuls as padded, dilated convolutions."""
    size, stride = window["size"][d], window["stride"][d]
    lo, lhs_dilate, rhs_dilate = window["pad_lo"][d], window["lhs_dilate"][d], window["rhs_dilate"][d]
    position = np.arange(out_size)[:, None] * stride + np.arange(size)[None, :] * rhs_dilate - lo
    inside = (position >= 0) & (position <= (in_size - 1) * lhs_dilate) & (position % lhs_dilate == 0)
    return int(inside.sum())


def _window(rest: str, spatial: int) -> dict[str, list[int]]:
    text = re.search(r"window=\{([^}]*)\}", rest)
    fields = dict(re.findall(r"(\w+)=([\d_x]+)", text.group(1))) if text else {}

    def field(key: str, default: int) -> list[int]:
        return [int(x) for x in fields[key].split("x")] if key in fields else [default] * spatial

    pads = [[int(x) for x in p.split("_")] for p in fields["pad"].split("x")] if "pad" in fields else [[0, 0]] * spatial
    return {"size": field("size", 1), "stride": field("stride", 1), "lhs_dilate": field("lhs_dilate", 1),
            "rhs_dilate": field("rhs_dilate", 1), "pad_lo": [p[0] for p in pads]}  # fmt: skip


def _instruction_flops(inst: Instruction, shapes: dict[str, str]) -> float:
    out_dims = dims_of(inst.shape)
    operands = _operand_names(inst.rest)
    lhs = dims_of(shapes.get(operands[0], "")) if operands else []
    if inst.opcode == "dot":
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", inst.rest)
        k = math.prod(lhs[int(d)] for d in contracting.group(1).split(",") if d) if contracting and lhs else 1
        return 2.0 * math.prod(out_dims) * k
    # A convolution: each output element sums input features (per feature group) x valid window taps.
    labels = re.search(r"dim_labels=(\w+)_\w+->(\w+)", inst.rest)
    if not labels or not lhs:
        return 0.0
    lhs_labels, out_labels = labels.group(1), labels.group(2)
    spatial = sum(c.isdigit() for c in lhs_labels)
    window = _window(inst.rest, spatial)
    groups = re.search(r"feature_group_count=(\d+)", inst.rest)
    per_output = lhs[lhs_labels.index("f")] / (int(groups.group(1)) if groups else 1)
    outputs_without_spatial = math.prod(n for n, c in zip(out_dims, out_labels, strict=True) if not c.isdigit())
    taps = 1
    for d in range(spatial):
        in_size, out_size = lhs[lhs_labels.index(str(d))], out_dims[out_labels.index(str(d))]
        taps *= _valid_taps(window, d, in_size, out_size)
    return 2.0 * outputs_without_spatial * per_output * taps


def matmul_flops(module: Module) -> float:
    """FLOPs of every dot and convolution, each counted as often as its computation runs."""
    return sum(f for f, _ in matmuls_by_operand(module).values())


def dots(module: Module):
    """Each dot and convolution as (instruction, how often its computation runs, its operands' shapes)."""
    for name, times in executions(module).items():
        shapes = {i.name: i.shape for i in module.instructions[name]}
        for inst in module.instructions[name]:
            if inst.opcode in ("dot", "convolution"):
                yield inst, times, [shapes.get(o, "") for o in _operand_names(inst.rest)], shapes


def matmuls_by_operand(module: Module) -> dict[str, tuple[float, int]]:
    """(FLOPs, instructions) of the dots and convolutions by their first operand's element type ("bf16",
    "s8", "f8e4m3fn", ...): what quantised training's matmuls (trainer/model/low_precision.py) became."""
    out: dict[str, tuple[float, int]] = {}
    for inst, times, operands, shapes in dots(module):
        kind = re.match(r"\(?(\w+)\[", operands[0] if operands else "")
        key = kind.group(1) if kind else "?"
        flops, count = out.get(key, (0.0, 0))
        out[key] = (flops + times * _instruction_flops(inst, shapes), count + 1)
    return out


_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "conditional", "call",
         "after-all", "partition-id", "replica-id", "iota"}  # fmt: skip


_SLICERS = ("dynamic-slice", "slice", "gather")


class _Fused:
    """One fused computation: its parameters, and who reads each value."""

    def __init__(self, module: Module, name: str):
        self.module, self.body = module, module.instructions[name]
        self.by_name = {i.name: i for i in self.body}
        self.params = {int(re.search(r"parameter\((\d+)\)", i.line).group(1)): i.name
                       for i in self.body if i.opcode == "parameter"}  # fmt: skip
        self.users: dict[str, list[Instruction]] = defaultdict(list)
        for i in self.body:
            for operand in _operand_names(i.rest):
                self.users[operand].append(i)

    def read(self, index: int, full: int, depth: int = 0) -> int:
        """Bytes of parameter `index` (of `full` bytes) the fusion reads: only the slices taken of it,
        nothing if it is the buffer a dynamic-update-slice writes into, looking through bitcasts and
        nested fusions."""
        total = 0
        for user, name in self._readers(self.params.get(index, "")):
            operands = _operand_names(user.rest)
            callee = re.search(r"\bcalls=%([\w.\-]+)", user.rest)
            if user.opcode in _SLICERS:
                total += array_bytes(user.shape)
            elif user.opcode == "dynamic-update-slice" and operands[0] == name:
                continue
            elif user.opcode == "fusion" and callee and depth < MAX_DEPTH:
                inner = _Fused(self.module, callee.group(1))
                total += sum(inner.read(k, full, depth + 1) for k, o in enumerate(operands) if o == name)
            else:
                return full
        return min(total, full) if self._readers(self.params.get(index, "")) else full

    def written(self) -> int:
        """Bytes the fusion writes: an output updated in place counts only its update."""
        root = next((i for i in self.body if i.line.lstrip().startswith("ROOT")), None)
        if root is None:
            return 0
        total = 0
        for name in _operand_names(root.rest) if root.opcode == "tuple" else [root.name]:
            i = self.by_name.get(name)
            while i is not None and i.opcode == "bitcast":
                i = self.by_name.get(_operand_names(i.rest)[0])
            if i is not None and i.opcode == "dynamic-update-slice":
                total += array_bytes(self.by_name[_operand_names(i.rest)[1]].shape)
            elif i is not None:
                total += array_bytes(i.shape)
        return total

    def _readers(self, name: str) -> list[tuple[Instruction, str]]:
        out = []
        for user in self.users.get(name, []):
            out += self._readers(user.name) if user.opcode == "bitcast" else [(user, name)]
        return out


def _fused_traffic(module: Module, fused: str, inst: Instruction, shapes: dict[str, str]) -> int:
    """Bytes a fusion reads and writes; a layer scan's stacked weights and gradients are read and
    written a layer's slice at a time."""
    f = _Fused(module, fused)
    operands = _operand_names(inst.rest)
    return sum(f.read(k, array_bytes(shapes.get(o, ""))) for k, o in enumerate(operands)) + f.written()


def bytes_accessed(module: Module) -> float:
    """HBM bytes read and written by every unfused instruction, each counted as often as it runs."""
    fused = {callee for calls in module.calls.values() for callee, trip in calls if trip is None}
    total = 0.0
    for name, times in executions(module).items():
        if name in fused and name != module.entry:
            continue  # its instructions live in registers and on-chip memory, inside one kernel
        shapes = {i.name: i.shape for i in module.instructions[name]}
        for inst in module.instructions[name]:
            if inst.opcode in _FREE or inst.opcode.endswith("-start") or _is_kernel(inst):
                continue  # an async op is counted at its -done; a kernel by its schedule (custom_kernels)
            if inst.opcode.endswith("-done"):
                total += times * 2 * array_bytes(inst.shape)
                continue
            callee = re.search(r"\bcalls=%([\w.\-]+)", inst.rest)
            if inst.opcode == "fusion" and callee:
                total += times * _fused_traffic(module, callee.group(1), inst, shapes)
            else:
                total += times * (array_bytes(inst.shape) + sum(array_bytes(shapes.get(o, ""))
                                                                for o in _operand_names(inst.rest)))  # fmt: skip
    return total


def _is_kernel(inst: Instruction) -> bool:
    return inst.opcode == "custom-call" and 'custom_call_target="tpu_custom_call"' in inst.rest


def custom_kernels(module: Module) -> list[tuple[Instruction, int]]:
    """Each hand-written (Pallas/Mosaic) kernel call and how often it runs. Their FLOPs are not in the HLO,
    and their traffic depends on the kernel's schedule (trainer/model/splash.py), so `matmul_flops` and
    `bytes_accessed` leave them out."""
    return [(inst, times) for name, times in executions(module).items()
            for inst in module.instructions[name] if _is_kernel(inst)]  # fmt: skip
