"""Reads optimized HLO text: every GEMM and collective, counted as often as it executes.

XLA's own cost analysis counts the body of a ``while`` loop once, but a layer scan runs its body
``n_layers`` times; here each computation carries a multiplier (the product of the known trip
counts of the loops it sits in), so per-step totals are right for scanned models.

GEMMs are ``dot`` instructions (CPU, and GPU before library calls), cuBLAS / cuBLASLt
custom-calls (GPU), and convolutions (``convolution``, cuDNN custom-calls) as the implicit GEMMs
they run as. Sizes are reported BLAS-style for ``C[m, n] = A[m, k] @ B[k, n]`` per batch
element: ``m`` = free size of the left operand, ``n`` = free size of the right, ``k`` = contracted.
Shapes are per device: the HLO of an SPMD program is the per-device program.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import defaultdict
from typing import Any

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e5m2fnuz": 1,
    "f8e4m3fnuz": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 1, "u4": 1,
}  # fmt: skip
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_GEMM_TARGETS = re.compile(r"__cublas\$(lt\$matmul(\$f8)?|gemm)|__cudnn\$matmul")
# Forward convolutions only: a backward call's dim_labels describe its forward convolution, so
# its operands do not map onto them (not counted, for now).
_CONV_TARGETS = re.compile(r"__cudnn\$conv(BiasActivation)?Forward")
_DIM_LABELS = re.compile(r"dim_labels=(\w+)_(\w+)->(\w+)")

_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \((.*)\) -> .* \{$")
_INSTR = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$")
_SHAPE = re.compile(r"([a-z]\w*)\[([\d,]*)\]")
_CALLED = re.compile(r"(?:calls|body|to_apply|condition)=%([\w.\-]+)")
_CALLED_LIST = re.compile(r"(?:branch_computations|called_computations)=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_BODY = re.compile(r"body=%([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_DIMS = re.compile(
    r"(lhs_batch_dims|rhs_batch_dims|lhs_contracting_dims|rhs_contracting_dims)"
    r"=\{([\d,]*)\}"
)
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Shape:
    dtype: str
    dims: tuple[int, ...]

    @property
    def bytes(self) -> int:
        return math.prod(self.dims) * _DTYPE_BYTES.get(self.dtype, 4)


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One GEMM instruction; ``count`` = executions per step (loop trip counts)."""

    name: str
    op_name: str
    m: int
    n: int
    k: int
    batch: int
    lhs_dtype: str
    rhs_dtype: str
    out_dtype: str
    count: int

    @property
    def flops(self) -> int:
        """FLOPs of all ``count`` executions (2 per multiply-add)."""
        return 2 * self.batch * self.m * self.n * self.k * self.count


# Bytes each device sends per byte of the buffer, in a ring over n devices: the factors
# nccl-tests turns algorithm bandwidth into bus bandwidth with.
def wire_factor(kind: str, n: int) -> float:
    """Bytes one device puts on its links per byte of the collective's buffer (ring algorithms,
    as nccl-tests counts them: all-reduce 2 (n-1)/n; all-gather, reduce-scatter, all-to-all
    (n-1)/n; a permute sends its whole buffer)."""
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2 * (n - 1) / n
    if kind == "collective-permute":
        return 1.0
    return (n - 1) / n


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective; ``bytes`` = the full buffer exchanged, per execution; ``dtype``: its
    element type (``s8``, ``u16``: a compressed payload)."""

    name: str
    kind: str
    op_name: str
    bytes: int
    group_size: int
    count: int
    dtype: str = ""

    @property
    def wire_bytes(self) -> float:
        """What each device sends per execution (``wire_factor`` x ``bytes``)."""
        return wire_factor(self.kind, self.group_size) * self.bytes


def parse_shapes(text: str) -> list[Shape]:
    """All array shapes in an HLO shape string (a tuple gives several)."""
    return [
        Shape(d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in _SHAPE.findall(text)
    ]


@dataclasses.dataclass
class _Instruction:
    name: str
    shape: str
    opcode: str
    rest: str  # operands and attributes


def _split_computations(
    hlo: str,
) -> tuple[dict[str, list[_Instruction]], dict[str, dict[str, str]], str]:
    computations: dict[str, list[_Instruction]] = {}
    shapes: dict[str, dict[str, str]] = {}
    entry = ""
    current = None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(2)
            if header.group(1):
                entry = current
            computations[current] = []
            # Parameters are declared in the header: "param_0: f32[2048,512], ..."
            shapes[current] = {
                p.split(":")[0].strip().lstrip("%"): p.split(":", 1)[1]
                for p in re.split(r",\s*(?=[\w.\-]+:)", header.group(3))
                if ":" in p
            }
            continue
        if current is None:
            continue
        instr = _INSTR.match(line)
        if instr:
            _, name, shape, opcode, rest = instr.groups()
            computations[current].append(_Instruction(name, shape, opcode, rest))
            shapes[current][name] = shape
    return computations, shapes, entry


def _multipliers(computations: dict[str, list[_Instruction]], entry: str) -> dict[str, int]:
    """How often each computation runs per execution of the entry computation."""
    callers: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for comp, instrs in computations.items():
        for ins in instrs:
            trip = _TRIP.search(ins.rest)
            body = _BODY.search(ins.rest)
            for callee in _CALLED.findall(ins.rest):
                factor = int(trip.group(1)) if trip and body and callee == body.group(1) else 1
                callers[callee].append((comp, factor))
            for group in _CALLED_LIST.findall(ins.rest):
                for callee in re.findall(r"%([\w.\-]+)", group):
                    callers[callee].append((comp, 1))
    memo: dict[str, int] = {entry: 1}

    def count(comp: str, seen: frozenset = frozenset()) -> int:
        if comp in memo:
            return memo[comp]
        if comp in seen:
            return 0
        total = sum(count(c, seen | {comp}) * f for c, f in callers.get(comp, []))
        memo[comp] = total
        return total

    return {comp: count(comp) for comp in computations}


def _operands(rest: str) -> list[str]:
    depth, names, token = 0, [], ""
    for ch in rest:
        if ch == "(":
            depth += 1
        elif ch == ")":
            if depth == 0:
                break
            depth -= 1
        token += ch
    for part in token.split(","):
        found = re.findall(r"%([\w.\-]+)", part)
        if found:
            names.append(found[-1])
    return names


def _convolution(ins: _Instruction, shapes: dict[str, str], count: int) -> Gemm | None:
    """A convolution as the implicit GEMM it runs as: M = output positions (batch x spatial),
    N = output features, K = window x input features per group (what each output sums over)."""
    labels = _DIM_LABELS.search(ins.rest)
    operands = _operands(ins.rest)
    if not labels or len(operands) < 2 or not {operands[0], operands[1]} <= shapes.keys():
        return None
    lhs, rhs = parse_shapes(shapes[operands[0]])[0], parse_shapes(shapes[operands[1]])[0]
    out = parse_shapes(ins.shape)[0]
    _, rhs_labels, out_labels = labels.groups()
    if len(rhs_labels) != len(rhs.dims) or len(out_labels) != len(out.dims):
        return None
    n = out.dims[out_labels.index("f")]
    op_name = _OP_NAME.search(ins.rest)
    return Gemm(
        name=ins.name,
        op_name=op_name.group(1) if op_name else "",
        m=math.prod(out.dims) // max(n, 1),
        n=n,
        k=math.prod(d for label, d in zip(rhs_labels, rhs.dims, strict=True) if label != "o"),
        batch=1,
        lhs_dtype=lhs.dtype,
        rhs_dtype=rhs.dtype,
        out_dtype=out.dtype,
        count=count,
    )


def _gemm(ins: _Instruction, shapes: dict[str, str], count: int) -> Gemm | None:
    if ins.opcode == "convolution" or (
        ins.opcode == "custom-call" and _CONV_TARGETS.search(ins.rest)
    ):
        return _convolution(ins, shapes, count)
    if ins.opcode == "dot":
        dims = {k: [int(x) for x in v.split(",") if x] for k, v in _DIMS.findall(ins.rest)}
    elif ins.opcode == "custom-call" and _GEMM_TARGETS.search(ins.rest):
        config = re.search(r'"dot_dimension_numbers":(\{[^}]*\})', ins.rest)
        if not config:
            return None
        raw = json.loads(config.group(1))
        dims = {k.replace("_dimensions", "_dims"): [int(x) for x in v] for k, v in raw.items()}
    else:
        return None
    operands = _operands(ins.rest)
    if len(operands) < 2 or operands[0] not in shapes or operands[1] not in shapes:
        return None
    lhs, rhs = parse_shapes(shapes[operands[0]])[0], parse_shapes(shapes[operands[1]])[0]
    out = parse_shapes(ins.shape)[0]
    lb, lc = dims.get("lhs_batch_dims", []), dims.get("lhs_contracting_dims", [])
    rb, rc = dims.get("rhs_batch_dims", []), dims.get("rhs_contracting_dims", [])
    size = lambda shape, idx: math.prod(shape.dims[i] for i in idx)
    free = lambda shape, used: math.prod(d for i, d in enumerate(shape.dims) if i not in used)
    op_name = _OP_NAME.search(ins.rest)
    return Gemm(
        name=ins.name,
        op_name=op_name.group(1) if op_name else "",
        m=free(lhs, set(lb) | set(lc)),
        n=free(rhs, set(rb) | set(rc)),
        k=size(lhs, lc),
        batch=size(lhs, lb),
        lhs_dtype=lhs.dtype,
        rhs_dtype=rhs.dtype,
        out_dtype=out.dtype,
        count=count,
    )


def _group_size(rest: str, num_devices: int) -> int:
    iota = _GROUPS_IOTA.search(rest)
    if iota:
        return int(iota.group(2))
    listed = _GROUPS_LIST.search(rest)
    if listed:
        first = listed.group(1).split("}")[0].strip("{")
        return len([x for x in first.split(",") if x]) or num_devices
    if _PAIRS.search(rest):
        return 2
    return num_devices


def _collective(
    ins: _Instruction, shapes: dict[str, str], count: int, num_devices: int
) -> Collective | None:
    kind = ins.opcode.removesuffix("-start")
    if kind not in _COLLECTIVES:
        return None
    operand_bytes = sum(
        parse_shapes(shapes[o])[0].bytes
        for o in _operands(ins.rest)
        if o in shapes and parse_shapes(shapes[o])
    )
    result = parse_shapes(ins.shape)
    result_bytes = sum(s.bytes for s in result)
    dtypes = sorted({s.dtype for s in result})
    if ins.opcode.endswith("-start"):  # async: the result tuple repeats the operands
        result_bytes -= operand_bytes
    # The buffer exchanged: what all-gather produces, what the others consume.
    size = result_bytes if kind == "all-gather" else operand_bytes or result_bytes
    op_name = _OP_NAME.search(ins.rest)
    return Collective(
        ins.name,
        kind,
        op_name.group(1) if op_name else "",
        size,
        _group_size(ins.rest, num_devices),
        count,
        ",".join(dtypes),
    )


def analyze(hlo: str, *, num_devices: int = 1) -> tuple[list[Gemm], list[Collective]]:
    """All GEMMs and collectives of an optimized HLO module, with execution counts per step."""
    computations, shapes, entry = _split_computations(hlo)
    counts = _multipliers(computations, entry)
    gemms, collectives = [], []
    for comp, instrs in computations.items():
        if counts.get(comp, 0) == 0:
            continue
        for ins in instrs:
            gemm = _gemm(ins, shapes[comp], counts[comp])
            if gemm is not None:
                gemms.append(gemm)
                continue
            coll = _collective(ins, shapes[comp], counts[comp], num_devices)
            if coll is not None:
                collectives.append(coll)
    return gemms, collectives


def to_dict(item: Gemm | Collective) -> dict[str, Any]:
    out = dataclasses.asdict(item)
    if isinstance(item, Gemm):
        out["flops"] = item.flops
    else:
        out["wire_bytes"] = item.wire_bytes
    return out
