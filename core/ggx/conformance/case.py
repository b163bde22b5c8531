"""One conformance case: an op graph to build, its inputs, and how its result is judged.

A case is declarative, as in ggml's tests/test-backend-ops.cpp: a name made of the op and its
variables, a `build` function that creates the graph in a fresh `Context` through a `Builder`
(which also makes the input data), and a `Tolerance` (the largest normalized mean squared error
accepted, with the reason for that number). Building the same case twice gives the same data:
the random generator is seeded from the case name.

Input data is kept as the raw bytes ggml would store (`ggx.tensor_data.to_raw`), so the backend
under test and the oracle read bit-identical inputs, quantized weights included.
"""
from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import GGXError
from ..graph import Context
from ..ops import Op
from ..tensor import Tensor
from ..tensor_data import to_raw
from ..types import GType


@dataclass(frozen=True)
class Tolerance:
    """How a result is compared with the oracle.

    kind "nmse": normalized mean squared error sum((out-ref)^2) / sum(ref^2) <= max_nmse;
    "exact": integer results equal; "set": each row holds the same set of integers (TOP_K
    returns its k indices "in no particular order").
    """

    max_nmse: float
    reason: str
    kind: str = "nmse"


class Builder:
    """Creates leaves with their data for one case; `ctx` builds the ops.

    Every input helper returns the tensor the op should take (for the non-contiguous helpers, a
    view of a larger leaf). Values are drawn at build time (so the draws follow the build
    order), but converted to bytes only when `inputs` is first read: listing cases and asking
    supports_op never pays for quantization.
    """

    def __init__(self, seed_name: str):
        self.ctx = Context()
        self.rng = np.random.default_rng(zlib.crc32(seed_name.encode()))
        self._values: dict[Tensor, np.ndarray] = {}
        self._raw: dict[Tensor, np.ndarray] = {}
        self.out: Tensor | None = None  # the case's result, set by OpCase.make

    @property
    def inputs(self) -> dict[Tensor, np.ndarray]:
        """Each leaf with data and its raw bytes (ggml layout)."""
        for t, values in self._values.items():
            if t not in self._raw:
                self._raw[t] = to_raw(t, values)
        return self._raw

    # --- leaves with data -------------------------------------------------------------------
    def leaf(self, gtype: GType | str, ne: Sequence[int], name: str, values: np.ndarray | None = None) -> Tensor:
        """A leaf; `values` in numpy order (ne reversed) become its bytes. None: no data (an output)."""
        t = self.ctx.tensor(GType.parse(gtype), tuple(ne), name=name)
        if values is not None:
            self._values[t] = np.asarray(values).reshape(tuple(reversed(t.ne)))
        return t

    def raw_leaf(self, gtype: GType | str, ne: Sequence[int], name: str, raw: np.ndarray) -> Tensor:
        """A leaf whose bytes are given as they are stored (golden data)."""
        t = self.ctx.tensor(GType.parse(gtype), tuple(ne), name=name)
        raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
        if raw.size != t.nbytes:
            raise GGXError(f"{t.describe()}: {raw.size} bytes given for {t.nbytes}")
        self._raw[t] = raw
        return t

    def uniform(self, gtype: GType | str, ne: Sequence[int], name: str, lo: float = -1.0, hi: float = 1.0) -> Tensor:
        """Values uniform in [lo, hi), as test-backend-ops' init_tensor_uniform."""
        shape = tuple(reversed(tuple(ne) + (1,) * (4 - len(ne))))
        return self.leaf(gtype, ne, name, self.rng.uniform(lo, hi, shape).astype(np.float32))

    def ints(self, gtype: GType | str, ne: Sequence[int], name: str, values: Sequence[int] | np.ndarray) -> Tensor:
        return self.leaf(gtype, ne, name, np.asarray(values, dtype=np.int64))

    def indices(self, gtype: GType | str, ne: Sequence[int], name: str, high: int) -> Tensor:
        """Random row indices in [0, high) (repeats allowed)."""
        n = math.prod(ne)
        return self.ints(gtype, ne, name, self.rng.integers(0, high, n))

    def distinct_rows(self, ne: Sequence[int], name: str) -> Tensor:
        """F32 rows of distinct values in random order (sorting results are then unique)."""
        ne4 = tuple(ne) + (1,) * (4 - len(ne))
        nrows = ne4[1] * ne4[2] * ne4[3]
        base = np.linspace(-1.0, 1.0, ne4[0], dtype=np.float32)
        rows = np.stack([self.rng.permutation(base) for _ in range(nrows)])
        return self.leaf(GType.F32, ne, name, rows)

    def mask(self, gtype: GType | str, n_kv: int, rows: int, name: str = "mask", causal: bool = False,
             n_head: int = 1) -> Tensor:
        """An attention mask [n_kv, rows, n_head]: uniform in [-1, 1), or causal (-inf above the
        diagonal, shifted so the last row sees every key; every row keeps a finite entry)."""
        shape = (n_head, rows, n_kv)
        m = self.rng.uniform(-1.0, 1.0, shape).astype(np.float32)
        if causal:
            r = np.arange(rows)[:, None] + (n_kv - rows)
            m = np.where(np.arange(n_kv)[None, :] > r, -np.inf, 0.0).astype(np.float32)
            m = np.broadcast_to(m, shape)
        return self.leaf(gtype, (n_kv, rows, n_head), name, m)

    # --- non-contiguous inputs ---------------------------------------------------------------
    def permuted(self, gtype: GType | str, ne: Sequence[int], axes: Sequence[int], name: str) -> Tensor:
        """A permuted view with shape `ne`: the leaf holds dim i at position axes[i] (ggml_permute)."""
        ne4 = tuple(ne) + (1,) * (4 - len(ne))
        storage_ne = tuple(ne4[axes[i]] for i in range(4))
        leaf = self.uniform(gtype, storage_ne, name)
        return self.ctx.permute(leaf, *axes)

    def transposed(self, gtype: GType | str, ne: Sequence[int], name: str) -> Tensor:
        """A transposed view with shape `ne` (dims 0 and 1 swapped in memory)."""
        return self.permuted(gtype, ne, (1, 0, 2, 3), name)

    def row_strided(self, gtype: GType | str, ne: Sequence[int], name: str, pad: int | None = None) -> Tensor:
        """A view with contiguous rows but row stride longer than the row, at a non-zero offset."""
        gtype = GType.parse(gtype)
        ne4 = tuple(ne) + (1,) * (4 - len(ne))
        pad = gtype.block_size if pad is None else pad
        leaf = self.uniform(gtype, (ne4[0] + 2 * pad,) + ne4[1:], name)
        offset = gtype.row_size(pad)
        return self.ctx.view(leaf, ne4, leaf.nb[1:], offset=offset)


BuildFn = Callable[[Builder], Tensor]


@dataclass(frozen=True)
class OpCase:
    """One op variant. `name` reads like test-backend-ops: "MUL_MAT(type_a=q4_0,m=16,n=1,k=256)".

    `expect_error`: the graph must be refused at build time with this error (the case passes
    when building raises it). `expected`: fixed expected values (golden data from ggml) instead
    of the reference backend's result.
    """

    op: Op
    vars: tuple[tuple[str, object], ...]
    build: BuildFn = field(compare=False)
    tol: Tolerance
    types: tuple[GType, ...] = ()
    expect_error: type[GGXError] | None = None
    expected: Callable[[], np.ndarray] | None = field(default=None, compare=False)
    source: str = "ggx"  # "ggx": checked against the reference backend; "ggml": golden data
    label: str = ""  # the op as printed, when it is more than the Op (e.g. "GELU_ERF")

    @property
    def op_name(self) -> str:
        return self.label or self.op.name

    @property
    def name(self) -> str:
        inner = ",".join(f"{k}={_fmt(v)}" for k, v in self.vars)
        return f"{self.op_name}({inner})"

    def make(self) -> Builder:
        """Build the graph in a fresh context; returns the builder (inputs, ctx) with `out` set."""
        b = Builder(self.name)
        b.out = self.build(b)
        return b


def type_name(t: GType) -> str:
    """ggml's spelling of a type name: "f32", "q4_0", "q4_K"."""
    return t.name.lower().replace("_k", "_K")


def _fmt(v: object) -> str:
    if isinstance(v, GType):
        return type_name(v)
    if isinstance(v, Op):
        return v.name.lower()
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, tuple | list):
        return "[" + ",".join(_fmt(x) for x in v) + "]"
    if hasattr(v, "name") and hasattr(v, "value"):  # other enums: RopeMode, SortOrder, ...
        return str(v.name).lower()
    return str(v)


# ----------------------------------------------------------------------------------------------
# Thresholds, one line of reason each. Float results are compared as NMSE against the reference
# backend, which computes in float64 from the same input bytes (it is exact up to f64 rounding).

F32_ROUNDING = Tolerance(1e-7, "f32 arithmetic: rounding only (test-backend-ops' default)")
COPY = Tolerance(1e-7, "a copy or exact dequantization: bit-exact expected; ggml's default floor")
EXACT = Tolerance(0.0, "integer indices: must be equal", "exact")
SAME_SET = Tolerance(0.0, "top-k indices come in no particular order (ggml): same set per row", "set")

_REDUCE = Tolerance(1e-6, "row sums/exp/sqrt in f32 over up to 4096 values")
_ROPE = Tolerance(1e-6, "sin/cos of f32 angles pos*theta_i (pos up to a few hundred)")
_GELU_F16 = Tolerance(1e-5, "ggml's CPU GELU rounds input and output to F16 (lookup table)")
_MM_F32 = Tolerance(1e-6, "f32 weights: f32 products, only the accumulation order differs")
_MM_HALF = Tolerance(5e-4, "activations converted to the F16/BF16 vec_dot_type, as ggml does (ggml's 5e-4)")
_MM_QUANT = Tolerance(5e-4, "activations quantized to the weight's vec_dot_type (Q8_0/Q8_1/Q8_K), as ggml "
                            "does, while the reference is exact (ggml's 5e-4)")
_FA = Tolerance(5e-4, "ggml rounds Q to F16 and accumulates V in F16 below 64 tokens (ggml's 5e-4)")
_TO_HALF = Tolerance(1e-6, "both sides round to the nearest F16/BF16: rounding of ties only")
_TO_QUANT = Tolerance(1e-5, "the same round-to-nearest quantizer; a tie rounded the other way costs one step")
_TO_KQUANT = Tolerance(5e-3, "the K-quant scale search may settle on another (scale, min) of similar error")

_MATMUL_OPS = (Op.MUL_MAT, Op.MUL_MAT_ID)


def tolerance(op: Op, gtype: GType | None = None, label: str = "") -> Tolerance:
    """The threshold for `op` whose characteristic type is `gtype` (the weight type of a matrix
    product, the destination type of a copy, the K/V type of attention)."""
    if op in _MATMUL_OPS:
        if gtype is GType.F32:
            return _MM_F32
        return _MM_HALF if gtype in (GType.F16, GType.BF16) else _MM_QUANT
    if op in (Op.CPY, Op.SET_ROWS):
        if gtype is None or gtype in (GType.F32, GType.I32, GType.I64):
            return COPY
        if gtype in (GType.F16, GType.BF16):
            return _TO_HALF
        return _TO_KQUANT if gtype.block_size == 256 else _TO_QUANT
    if op is Op.FLASH_ATTN_EXT:
        return _FA
    if op is Op.ROPE:
        return _ROPE
    if op in (Op.SOFT_MAX, Op.RMS_NORM, Op.NORM, Op.SUM_ROWS):
        return _REDUCE
    if op is Op.GELU or (op is Op.GLU and label.endswith("GEGLU")):
        return _REDUCE if label.endswith("ERF") else _GELU_F16
    if op is Op.ARGSORT:
        return EXACT
    if op is Op.TOP_K:
        return SAME_SET
    if op in (Op.GET_ROWS, Op.CPY, Op.DUP, Op.CONT, Op.VIEW, Op.RESHAPE, Op.PERMUTE, Op.TRANSPOSE):
        return COPY
    return F32_ROUNDING
