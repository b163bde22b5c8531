"""Graphs as plain data for another process (a remote device's worker), rebuilt there with the
graph builder's own checks.

ggml-rpc sends `rpc_tensor` structs holding raw pointers and trusts them. Here a graph crosses as
builtins only (str, int, float, bool, None, lists, tuples, dicts), one `TensorMsg` per tensor, and
`decode_graph` rebuilds every node by calling the same `Context` method the driver called, so a
node the builder would refuse is refused on the receiving side too, with the same GGXShapeError.
The rebuilt node's type, ne and nb must then equal the message's, and every storage location is
resolved through a callback that checks it lies inside a buffer the receiver owns. Nothing in a
message names code: ops and types are looked up by name in ggx's own tables.

A `TensorMsg` is a tuple:

    (op, type, ne, nb, ndim, flags, name, params, src, storage)

- `op`: an `Op` name; `type`: a `GType` name; `ne`, `nb`: four ints each; `ndim`: 1..4;
- `flags`: INPUT/OUTPUT bits (`TensorFlag`); `name`: at most `MAX_NAME` characters;
- `params`: the op's parameter dataclass as a dict of its fields (enums by value), or None;
- `src`: indices of earlier messages;
- `storage`: `(buffer_id, offset)` of the tensor's own memory, or None for a view, whose memory
  follows from its source as the builder rebuilds it.

Tensors a graph reads but does not compute travel first: a root tensor (a leaf, another split's
result) as a contiguous leaf (op NONE) with its storage, a view made elsewhere (a KV cache view) as
a VIEW of its root at its byte offset, so the builder checks it lies inside the root.
"""
from __future__ import annotations

import dataclasses
import enum
import math
import reprlib
from collections.abc import Callable, Sequence
from typing import Any

from . import ops as P
from .errors import GGXShapeError
from .graph import Context, Graph
from .ops import VIEW_OPS, Op
from .tensor import MAX_DIMS, Tensor, TensorFlag
from .types import GType

__all__ = ["MAX_NAME", "MAX_TENSORS", "GraphMsg", "TensorMsg", "decode_graph", "encode_graph"]

TensorMsg = tuple
GraphMsg = tuple  # (tuple of TensorMsg, tuple of node indices)

#: Limits a receiver enforces before building anything.
MAX_TENSORS = 1 << 16
MAX_NAME = 128
MAX_ELEMENTS = 1 << 40

_PARAMS: dict[Op, type] = {
    Op.VIEW: P.ViewParams, Op.PERMUTE: P.ViewParams, Op.SCALE: P.ScaleParams, Op.GELU: P.GeluParams,
    Op.GLU: P.GluParams, Op.RMS_NORM: P.NormParams, Op.NORM: P.NormParams, Op.ROPE: P.RopeParams,
    Op.SOFT_MAX: P.SoftMaxParams, Op.FLASH_ATTN_EXT: P.FlashAttnParams, Op.ARGSORT: P.ArgsortParams,
    Op.TOP_K: P.TopKParams,
}

_WIRE_FLAGS = TensorFlag.INPUT | TensorFlag.OUTPUT
#: Ops whose result the builder makes as a view of a source.
_MAKES_VIEW = VIEW_OPS | {Op.CPY, Op.SET_ROWS}


def _shape(t: TensorMsg) -> list[int]:
    return list(t[2][: t[4]])


# One rebuild per op: the Context call that made the node (s: sources, p: params, m: the message).
_REBUILD: dict[Op, Callable[[Context, list[Tensor], Any, TensorMsg], Tensor]] = {
    Op.GET_ROWS: lambda c, s, p, m: c.get_rows(s[0], s[1]),
    Op.SET_ROWS: lambda c, s, p, m: c.set_rows(s[0], s[1], s[2]),
    Op.CPY: lambda c, s, p, m: c.cpy(s[0], s[1]),
    Op.DUP: lambda c, s, p, m: c.dup(s[0]),
    Op.CONT: lambda c, s, p, m: c.cont(s[0], _shape(m)),
    Op.VIEW: lambda c, s, p, m: c.view(s[0], list(m[2]), list(m[3]), p.offset),
    Op.RESHAPE: lambda c, s, p, m: c.reshape(s[0], _shape(m)),
    Op.PERMUTE: lambda c, s, p, m: c.permute(s[0], *p.axes),
    Op.TRANSPOSE: lambda c, s, p, m: c.transpose(s[0]),
    Op.ADD: lambda c, s, p, m: c.add(s[0], s[1]),
    Op.MUL: lambda c, s, p, m: c.mul(s[0], s[1]),
    Op.SCALE: lambda c, s, p, m: c.scale(s[0], p.s, p.b),
    Op.SILU: lambda c, s, p, m: c.silu(s[0]),
    Op.GELU: lambda c, s, p, m: c.gelu(s[0], p.kind),
    Op.GLU: lambda c, s, p, m: c.glu(s[0], s[1] if len(s) > 1 else None, p.kind, p.swapped),
    Op.RMS_NORM: lambda c, s, p, m: c.rms_norm(s[0], p.eps),
    Op.NORM: lambda c, s, p, m: c.norm(s[0], p.eps),
    Op.SUM_ROWS: lambda c, s, p, m: c.sum_rows(s[0]),
    Op.MUL_MAT: lambda c, s, p, m: c.mul_mat(s[0], s[1]),
    Op.MUL_MAT_ID: lambda c, s, p, m: c.mul_mat_id(s[0], s[1], s[2]),
    Op.ROPE: lambda c, s, p, m: c.rope(s[0], s[1], p.n_dims, p.mode, p.freq_base, p.freq_scale, p.n_ctx_orig,
                                       p.ext_factor, p.attn_factor, p.beta_fast, p.beta_slow,
                                       s[2] if len(s) > 2 else None),
    Op.SOFT_MAX: lambda c, s, p, m: c.soft_max(s[0], s[1] if len(s) > 1 else None, p.scale, p.max_bias),
    Op.FLASH_ATTN_EXT: lambda c, s, p, m: c.flash_attn_ext(s[0], s[1], s[2], s[3] if len(s) > 3 else None,
                                                           p.scale, p.max_bias, p.logit_softcap, p.prec),
    Op.ARGSORT: lambda c, s, p, m: c.argsort(s[0], p.order),
    Op.TOP_K: lambda c, s, p, m: c.top_k(s[0], p.k),
}


# --- encoding (the driver) ------------------------------------------------------------------
def _encode_params(params: Any) -> dict | None:
    if params is None:
        return None
    out = {}
    for f in dataclasses.fields(params):
        v = getattr(params, f.name)
        out[f.name] = v.value if isinstance(v, enum.Enum) else list(v) if isinstance(v, tuple) else v
    return out


def encode_graph(graph: Graph, buffer_id: Callable[[Any], int]) -> GraphMsg:
    """The graph as plain data: (tensor messages, indices of the graph's nodes among them).
    `buffer_id(buffer)` names a tensor's buffer (None: no storage yet) for the receiver, and
    raises for one it cannot reach."""
    index: dict[int, int] = {}
    msgs: list[TensorMsg] = []
    in_graph = {id(n) for n in graph.nodes}

    def ref(t: Tensor) -> int:
        i = index.get(id(t))
        if i is not None:
            return i
        if id(t) in in_graph:
            raise GGXShapeError(f"encode_graph: {t.describe()} is read before it is computed")
        if t.view_src is not None:  # a view made outside this graph: a VIEW of its root
            root = ref(t.view_src)
            msgs.append((Op.VIEW.value, t.type.value, list(t.ne), list(t.nb), t.ndim, int(t.flags & _WIRE_FLAGS),
                         t.name[:MAX_NAME], _encode_params(P.ViewParams(offset=t.view_offs)), [root], None))
        else:
            msgs.append((Op.NONE.value, t.type.value, list(t.ne), list(t.nb), t.ndim, int(t.flags & _WIRE_FLAGS),
                         t.name[:MAX_NAME], None, [], (buffer_id(t.buffer), t.offset)))
        index[id(t)] = len(msgs) - 1
        return index[id(t)]

    for t in graph.leafs:
        ref(t)
    nodes: list[int] = []
    for n in graph.nodes:
        src = [ref(s) for s in n.src]
        # a node the builder makes as a view has its source's memory; any other has its own
        # (which may be a view of another tensor's: the scheduler's clones, in-place results)
        storage = None if n.op in _MAKES_VIEW else (buffer_id(n.data_buffer), n.data_offset)
        msgs.append((n.op.value, n.type.value, list(n.ne), list(n.nb), n.ndim, int(n.flags & _WIRE_FLAGS),
                     n.name[:MAX_NAME], _encode_params(n.params), src, storage))
        index[id(n)] = len(msgs) - 1
        nodes.append(index[id(n)])
    return tuple(msgs), tuple(nodes)


# --- decoding (the receiver) ----------------------------------------------------------------
def _bad(i: int, msg: str) -> GGXShapeError:
    return GGXShapeError(f"graph message, tensor {i}: {msg}")


def _show(v: Any) -> str:
    """A short repr of untrusted data that cannot fail: repr() of an int of more than 4300
    digits raises ValueError, and of a large object costs its size."""
    try:
        return reprlib.repr(v)
    except Exception:  # noqa: BLE001 - an int too long for str(), inside a list or not
        return f"<{type(v).__name__}>"


def _int(i: int, what: str, v: Any, lo: int = 0, hi: int = 1 << 62) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise _bad(i, f"{what} must be an int in {lo}..{hi}, got {_show(v)}"[:200])
    return v


def _ints(i: int, what: str, v: Any, n: int) -> tuple[int, ...]:
    if not isinstance(v, (list, tuple)) or len(v) != n:
        raise _bad(i, f"{what} must be {n} ints")
    return tuple(_int(i, what, x) for x in v)


def _decode_params(i: int, op: Op, raw: Any) -> Any:
    cls = _PARAMS.get(op)
    if cls is None:
        if raw is not None:
            raise _bad(i, f"{op.name} takes no parameters")
        return None
    if not isinstance(raw, dict):
        raise _bad(i, f"{op.name} needs its parameters")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if set(raw) - set(fields):
        raise _bad(i, f"unknown {op.name} parameter(s) {', '.join(sorted(map(_show, set(raw) - set(fields))))}"[:200])
    kw = {}
    defaults = cls.__dataclass_fields__
    for name, v in raw.items():
        default = defaults[name].default
        kind = type(default) if default is not dataclasses.MISSING else None
        try:
            if isinstance(default, enum.Enum):
                kw[name] = type(default)(v)
            elif name == "axes":
                kw[name] = _ints(i, "axes", v, MAX_DIMS)
            elif kind is float or (kind is None and isinstance(v, float)):
                if type(v) not in (int, float):
                    raise TypeError
                kw[name] = float(v)
            elif kind is bool:
                if type(v) is not bool:
                    raise TypeError
                kw[name] = v
            else:
                kw[name] = _int(i, name, v, -(1 << 62))
        except (TypeError, ValueError, OverflowError):  # OverflowError: float() of a huge int
            raise _bad(i, f"{op.name} parameter {name}={_show(v)} has the wrong type"[:200]) from None
    try:
        return cls(**kw)
    except TypeError as e:
        raise _bad(i, f"{op.name} parameters: {e}") from None


def _check_msg(i: int, m: Any) -> tuple[Op, GType, tuple[int, ...], tuple[int, ...], int]:
    if not isinstance(m, (tuple, list)) or len(m) != 10:
        raise _bad(i, "not a 10-field tensor description")
    try:
        op, gtype = Op(m[0]), GType(m[1])
    except (ValueError, TypeError):
        raise _bad(i, f"unknown op or type {_show(m[0])}/{_show(m[1])}"[:200]) from None
    ne = _ints(i, "ne", m[2], MAX_DIMS)
    nb = _ints(i, "nb", m[3], MAX_DIMS)
    ndim = _int(i, "ndim", m[4], 1, MAX_DIMS)
    if gtype.is_quantized and nb[0] != gtype.type_size:  # else nbytes undercounts what kernels read
        raise _bad(i, f"a {gtype.name} tensor's blocks are contiguous: nb[0]={nb[0]} is not {gtype.type_size}")
    _int(i, "flags", m[5], 0, int(_WIRE_FLAGS))
    if not isinstance(m[6], str) or len(m[6]) > MAX_NAME:
        raise _bad(i, f"name must be a string of at most {MAX_NAME} characters")
    if any(x != 1 for x in ne[ndim:]):
        raise _bad(i, f"ne={list(ne)} has more than ndim={ndim} dims")
    if math.prod(ne) > MAX_ELEMENTS:
        raise _bad(i, f"ne={list(ne)} has more than {MAX_ELEMENTS} elements")
    if not isinstance(m[8], (list, tuple)) or len(m[8]) > 4:
        raise _bad(i, "src must be a list of at most 4 indices")
    return op, gtype, ne, nb, ndim


def decode_graph(msg: Any, place: Callable[[Tensor, int, int], None]) -> Graph:
    """Rebuild a graph from `encode_graph`'s message. `place(tensor, buffer_id, offset)` puts a
    tensor with its own storage into the receiver's buffer, checking that it fits there; it is
    called for every such tensor before any node reads it. Raises GGXShapeError naming the first
    tensor that is malformed, refused by the builder, or different from what the builder made."""
    if not isinstance(msg, (tuple, list)) or len(msg) != 2:
        raise GGXShapeError("graph message: expected (tensors, nodes)")
    msgs, node_idx = msg
    if not isinstance(msgs, (tuple, list)) or not isinstance(node_idx, (tuple, list)):
        raise GGXShapeError("graph message: expected (tensors, nodes)")
    if len(msgs) > MAX_TENSORS:
        raise GGXShapeError(f"graph message: {len(msgs)} tensors, more than {MAX_TENSORS}")
    ctx = Context()
    built: list[Tensor] = []
    for i, m in enumerate(msgs):
        op, gtype, ne, nb, ndim = _check_msg(i, m)
        src = [built[_int(i, "src index", j, 0, i - 1)] for j in m[8]] if m[8] else []
        if op is Op.NONE:
            t = _leaf(i, ctx, gtype, ne, nb, ndim, m)
        else:
            params = _decode_params(i, op, m[7])
            try:
                t = _REBUILD[op](ctx, src, params, m)
            except (IndexError, AttributeError, TypeError):
                raise _bad(i, f"{op.name} with {len(src)} source(s) is not a valid call") from None
            except ArithmeticError as e:  # the builder divides by source sizes: a 0 in ne
                raise _bad(i, f"{op.name} over {', '.join(s.describe() for s in src)}: {e}") from None
            if (t.type, t.ne, t.nb) != (gtype, ne, nb) or t.params != params or len(t.src) != len(src):
                raise _bad(i, f"{op.name} described as {gtype.name}{list(ne)} nb={list(nb)}, "
                              f"the builder made {t.type.name}{list(t.ne)} nb={list(t.nb)}")
            if (m[9] is None) != t.is_view:
                raise _bad(i, f"{op.name}: storage given for a view, or missing for a node")
        t.name = m[6]  # before place: its errors name the tensor
        t.ndim = ndim  # what numpy shows (the builder may count more dims for a view)
        t.flags = TensorFlag(m[5])
        if m[9] is not None:
            _place(i, t, m[9], place)
        built.append(t)
    nodes = []
    for j in node_idx:
        t = built[_int(-1, "node index", j, 0, len(built) - 1)]
        if t.op is Op.NONE:
            raise GGXShapeError(f"graph message: node index {j} is a leaf")
        nodes.append(t)
    return Graph(nodes, [t for t in built if t.op is Op.NONE])


def _leaf(i: int, ctx: Context, gtype: GType, ne: tuple[int, ...], nb: tuple[int, ...], ndim: int,
          m: Sequence) -> Tensor:
    if m[7] is not None or m[8]:
        raise _bad(i, "a leaf has no parameters or sources")
    if m[9] is None:
        raise _bad(i, "a leaf needs storage")
    if ne[0] % gtype.block_size:
        raise _bad(i, f"row of {ne[0]} is not a whole number of {gtype.name} blocks")
    t = ctx.tensor(gtype, list(ne[:ndim]))
    if t.nb != nb:
        raise _bad(i, f"a leaf is contiguous: nb={list(nb)} is not {list(t.nb)}")
    return t


def _place(i: int, t: Tensor, storage: Any, place: Callable[[Tensor, int, int], None]) -> None:
    if not isinstance(storage, (tuple, list)) or len(storage) != 2:
        raise _bad(i, "storage must be (buffer_id, offset)")
    place(t, _int(i, "buffer id", storage[0]), _int(i, "offset", storage[1]))
