"""Graph building: `Context` has one method per op, each validating at build time; `build_graph`."""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from . import ops as P
from .errors import GGXShapeError
from .ops import Op
from .tensor import MAX_DIMS, Tensor, TensorFlag, contiguous_strides, pad_ne
from .types import GType


def _fail(op: str, msg: str) -> GGXShapeError:
    return GGXShapeError(f"{op}: {msg}")


def _need_type(op: str, role: str, t: Tensor, allowed: Iterable[GType]) -> None:
    allowed = tuple(allowed)
    if t.type not in allowed:
        names = "/".join(a.name for a in allowed)
        raise _fail(op, f"{role} {t.describe()} must be {names}")


def _need_tensor(op: str, role: str, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise _fail(op, f"{role} must be a Tensor, got {type(t).__name__}")
    return t


def _need_eps(op: str, eps: object) -> float:
    """A norm epsilon: finite and >= 0 (ggml asserts eps >= 0)."""
    try:
        value = float(eps)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise _fail(op, f"eps must be a number, got {eps!r}") from None
    if not math.isfinite(value) or value < 0:
        raise _fail(op, f"eps must be finite and >= 0, got {value}")
    return value


FLOAT_TYPES = (GType.F32, GType.F16, GType.BF16)
INDEX_TYPES = (GType.I32, GType.I64)


class Context:
    """Builds tensors and op nodes. Nothing is computed here: ops only describe work.

    Every op checks its inputs' shapes and types now, so a bad graph fails with a
    `GGXShapeError` naming the op, the tensors and the numbers, before any kernel runs.
    """

    def __init__(self) -> None:
        self.tensors: list[Tensor] = []

    def _add(self, t: Tensor) -> Tensor:
        self.tensors.append(t)
        return t

    # --- leaves ---------------------------------------------------------------------------
    def tensor(self, gtype: GType | str, ne: Sequence[int] | int, name: str = "") -> Tensor:
        """A new leaf tensor, ne in ggml order (ne[0] = row length)."""
        gtype = GType.parse(gtype)
        ne4 = pad_ne(ne, name or "tensor")
        ndim = 1 if isinstance(ne, int) else len(ne)
        return self._add(Tensor(gtype, ne4, name=name, ndim=ndim))

    def _new(self, gtype: GType, ne: Sequence[int], op: Op, params, src, ndim: int, name: str = "") -> Tensor:
        t = Tensor(gtype, tuple(ne), op=op, params=params, src=tuple(src), ndim=ndim, name=name)
        return self._add(t)

    def _view_of(self, a: Tensor, ne, nb, offs: int, op: Op, params, src, ndim: int | None = None) -> Tensor:
        t = Tensor(a.type, tuple(ne), tuple(nb), op=op, params=params, src=tuple(src),
                   view_src=a, view_offs=offs, ndim=ndim if ndim is not None else a.ndim)
        return self._add(t)

    # --- rows -----------------------------------------------------------------------------
    def get_rows(self, a: Tensor, ids: Tensor) -> Tensor:
        """out[:, i, j, k] = a[:, ids[i, j, k], j, k] as F32 (I32 stays I32)."""
        _need_tensor("get_rows", "a", a), _need_tensor("get_rows", "ids", ids)
        _need_type("get_rows", "ids", ids, (GType.I32,))
        if a.ne[2] != ids.ne[1] or ids.ne[3] != 1 or a.ne[3] != ids.ne[2]:
            raise _fail("get_rows", f"ids {ids.describe()} must be [n, a.ne2, a.ne3, 1] for a {a.describe()}")
        out_type = GType.I32 if a.type is GType.I32 else GType.F32
        return self._new(out_type, (a.ne[0], ids.ne[0], ids.ne[1], ids.ne[2]), Op.GET_ROWS, None,
                         (a, ids), min(MAX_DIMS, max(a.ndim, ids.ndim + 1)) if ids.ne[1] > 1 else 2)

    def set_rows(self, dst: Tensor, src: Tensor, ids: Tensor) -> Tensor:
        """dst[:, ids[i, j, k], j, k] = convert(src[:, i, j, k]); returns a view of dst."""
        _need_tensor("set_rows", "dst", dst), _need_tensor("set_rows", "src", src)
        _need_tensor("set_rows", "ids", ids)
        _need_type("set_rows", "src", src, (GType.F32,))
        _need_type("set_rows", "ids", ids, INDEX_TYPES)
        if dst.ne[0] != src.ne[0]:
            raise _fail("set_rows", f"row length of dst {dst.describe()} and src {src.describe()} differ")
        if ids.ne[0] != src.ne[1]:
            raise _fail("set_rows", f"ids {ids.describe()} must have one entry per src row ({src.ne[1]})")
        if src.ne[2] % ids.ne[1] or src.ne[3] % ids.ne[2] or ids.ne[3] != 1:
            raise _fail("set_rows", f"ids {ids.describe()} do not broadcast over src {src.describe()}")
        if dst.ne[2] != src.ne[2] or dst.ne[3] != src.ne[3]:
            raise _fail("set_rows", f"dst {dst.describe()} and src {src.describe()} differ in dims 2/3")
        if not src.has_contiguous_rows() or not dst.has_contiguous_rows():
            raise _fail("set_rows", "src and dst rows must be contiguous")
        return self._view_of(dst, dst.ne, dst.nb, 0, Op.SET_ROWS, None, (dst, src, ids))

    # --- copies ---------------------------------------------------------------------------
    def cpy(self, a: Tensor, b: Tensor) -> Tensor:
        """Copy a into b with type conversion (quantizing if b is quantized); returns a view of b."""
        _need_tensor("cpy", "a", a), _need_tensor("cpy", "b", b)
        if a.nelements != b.nelements:
            raise _fail("cpy", f"{a.describe()} and {b.describe()} differ in element count")
        if a.type.is_quantized and a.type is not b.type:
            raise _fail("cpy", f"cannot convert from quantized {a.describe()}")
        if a.type in INDEX_TYPES and a.type is not b.type:
            raise _fail("cpy", f"cannot convert {a.describe()} to {b.type.name}")
        if b.type.is_quantized and not b.is_contiguous():
            raise _fail("cpy", f"quantized destination {b.describe()} must be contiguous")
        return self._view_of(b, b.ne, b.nb, 0, Op.CPY, None, (a, b))

    def dup(self, a: Tensor) -> Tensor:
        _need_tensor("dup", "a", a)
        return self._new(a.type, a.ne, Op.DUP, None, (a,), a.ndim)

    def cont(self, a: Tensor, ne: Sequence[int] | None = None) -> Tensor:
        """A contiguous copy of a, optionally with a new shape of the same element count."""
        _need_tensor("cont", "a", a)
        ne4 = pad_ne(ne, "cont") if ne is not None else a.ne
        if math.prod(ne4) != a.nelements:
            raise _fail("cont", f"{a.describe()} has {a.nelements} elements, ne={list(ne4)} has {math.prod(ne4)}")
        if a.type.is_quantized and ne4[0] % a.type.block_size:
            raise _fail("cont", f"new row length {ne4[0]} is not a whole number of {a.type.name} blocks")
        return self._new(a.type, ne4, Op.CONT, None, (a,), len(ne) if ne is not None else a.ndim)

    # --- views ----------------------------------------------------------------------------
    def view(self, a: Tensor, ne: Sequence[int], nb: Sequence[int] | None = None, offset: int = 0) -> Tensor:
        """A view of a's memory: ne, byte strides nb[1:] (nb[0] is the type's), byte offset."""
        _need_tensor("view", "a", a)
        ne4 = pad_ne(ne, "view")
        if nb is None:
            nb4 = contiguous_strides(a.type, ne4)
        else:
            nb = tuple(int(x) for x in nb)
            if len(nb) == len(ne) - 1:  # ggml_view_Nd takes nb1..nb(N-1)
                nb = (a.type.type_size,) + nb
            nb4 = list(nb) + [0] * (MAX_DIMS - len(nb))
            for i in range(len(nb), MAX_DIMS):
                nb4[i] = nb4[i - 1] * ne4[i - 1] // (a.type.block_size if i == 1 else 1)
            nb4 = tuple(nb4)
        if offset < 0:
            raise _fail("view", f"negative offset {offset}")
        if a.type.is_quantized and ne4[0] % a.type.block_size:
            raise _fail("view", f"row of {ne4[0]} is not a whole number of {a.type.name} blocks")
        t = Tensor(a.type, ne4, nb4)
        root_bytes = a.root.nbytes
        end = a.view_offs + offset + t.nbytes if a.is_view else offset + t.nbytes
        if end > root_bytes:
            raise _fail("view", f"ne={list(ne4)} nb={list(nb4)} at offset {offset} reaches byte {end}, "
                                f"past the {root_bytes} bytes of {a.root.describe()}")
        return self._view_of(a, ne4, nb4, offset, Op.VIEW, P.ViewParams(offset=offset), (a,), len(ne))

    def reshape(self, a: Tensor, ne: Sequence[int]) -> Tensor:
        _need_tensor("reshape", "a", a)
        ne4 = pad_ne(ne, "reshape")
        if not a.is_contiguous():
            raise _fail("reshape", f"{a.describe()} is not contiguous (use cont first)")
        if math.prod(ne4) != a.nelements:
            raise _fail("reshape", f"{a.describe()} has {a.nelements} elements, ne={list(ne4)} has {math.prod(ne4)}")
        if a.type.is_quantized and ne4[0] % a.type.block_size:
            raise _fail("reshape", f"row of {ne4[0]} is not a whole number of {a.type.name} blocks")
        return self._view_of(a, ne4, contiguous_strides(a.type, ne4), 0, Op.RESHAPE, None, (a,),
                             1 if isinstance(ne, int) else len(ne))

    def permute(self, a: Tensor, axis0: int, axis1: int, axis2: int, axis3: int) -> Tensor:
        """Source dim i becomes dim axis_i (ggml_permute)."""
        _need_tensor("permute", "a", a)
        axes = (axis0, axis1, axis2, axis3)
        if sorted(axes) != [0, 1, 2, 3]:
            raise _fail("permute", f"axes {axes} are not a permutation of 0..3")
        ne, nb = [0] * 4, [0] * 4
        for i, ax in enumerate(axes):
            ne[ax], nb[ax] = a.ne[i], a.nb[i]
        if a.type.is_quantized and axes[0] != 0:
            raise _fail("permute", f"quantized {a.describe()} cannot move its block dimension")
        ndim = max(a.ndim, max(axes[: a.ndim]) + 1)
        return self._view_of(a, ne, nb, 0, Op.PERMUTE, P.ViewParams(axes=axes), (a,), ndim)

    def transpose(self, a: Tensor) -> Tensor:
        _need_tensor("transpose", "a", a)
        if a.type.is_quantized:
            raise _fail("transpose", f"quantized {a.describe()} cannot be transposed")
        ne = (a.ne[1], a.ne[0], a.ne[2], a.ne[3])
        nb = (a.nb[1], a.nb[0], a.nb[2], a.nb[3])
        return self._view_of(a, ne, nb, 0, Op.TRANSPOSE, None, (a,), max(a.ndim, 2))

    # --- elementwise ----------------------------------------------------------------------
    def _binary(self, op: Op, a: Tensor, b: Tensor) -> Tensor:
        name = op.name.lower()
        _need_tensor(name, "a", a), _need_tensor(name, "b", b)
        _need_type(name, "a", a, (GType.F32,))
        _need_type(name, "b", b, (GType.F32,))
        for i in range(MAX_DIMS):
            if b.ne[i] == 0 or a.ne[i] % b.ne[i]:
                raise _fail(name, f"b {b.describe()} does not broadcast over a {a.describe()} (dim {i})")
        return self._new(a.type, a.ne, op, None, (a, b), a.ndim)

    def add(self, a: Tensor, b: Tensor) -> Tensor:
        """a + b, b repeated over a (b.ne[i] divides a.ne[i])."""
        return self._binary(Op.ADD, a, b)

    def mul(self, a: Tensor, b: Tensor) -> Tensor:
        """a * b, b repeated over a (b.ne[i] divides a.ne[i])."""
        return self._binary(Op.MUL, a, b)

    def _unary_f32(self, op: Op, a: Tensor, params=None) -> Tensor:
        name = op.name.lower()
        _need_tensor(name, "a", a)
        _need_type(name, "a", a, (GType.F32,))
        return self._new(a.type, a.ne, op, params, (a,), a.ndim)

    def scale(self, a: Tensor, s: float, b: float = 0.0) -> Tensor:
        return self._unary_f32(Op.SCALE, a, P.ScaleParams(float(s), float(b)))

    def silu(self, a: Tensor) -> Tensor:
        return self._unary_f32(Op.SILU, a)

    def gelu(self, a: Tensor, kind: P.GeluKind | str = P.GeluKind.TANH) -> Tensor:
        return self._unary_f32(Op.GELU, a, P.GeluParams(P.GeluKind(kind)))

    def glu(self, a: Tensor, b: Tensor | None = None, kind: P.GluKind | str = P.GluKind.SWIGLU,
            swapped: bool = False) -> Tensor:
        """Gated unit: act(gate) * up. Fused (b None): a's rows hold [gate | up]; else gate=a, up=b."""
        _need_tensor("glu", "a", a)
        _need_type("glu", "a", a, (GType.F32,))
        params = P.GluParams(P.GluKind(kind), bool(swapped))
        if b is None:
            if a.ne[0] % 2:
                raise _fail("glu", f"fused input {a.describe()} needs an even row length")
            return self._new(a.type, (a.ne[0] // 2,) + a.ne[1:], Op.GLU, params, (a,), a.ndim)
        _need_tensor("glu", "b", b)
        _need_type("glu", "b", b, (GType.F32,))
        if a.ne != b.ne:
            raise _fail("glu", f"a {a.describe()} and b {b.describe()} must have the same shape")
        return self._new(a.type, a.ne, Op.GLU, params, (a, b), a.ndim)

    def swiglu(self, a: Tensor, b: Tensor | None = None) -> Tensor:
        return self.glu(a, b, P.GluKind.SWIGLU)

    def rms_norm(self, a: Tensor, eps: float) -> Tensor:
        """x / sqrt(mean(x^2) + eps) over each row."""
        return self._unary_f32(Op.RMS_NORM, a, P.NormParams(_need_eps("rms_norm", eps)))

    def norm(self, a: Tensor, eps: float) -> Tensor:
        """(x - mean) / sqrt(var + eps) over each row."""
        return self._unary_f32(Op.NORM, a, P.NormParams(_need_eps("norm", eps)))

    def sum_rows(self, a: Tensor) -> Tensor:
        _need_tensor("sum_rows", "a", a)
        _need_type("sum_rows", "a", a, (GType.F32,))
        return self._new(GType.F32, (1,) + a.ne[1:], Op.SUM_ROWS, None, (a,), a.ndim)

    # --- matrix products ------------------------------------------------------------------
    def mul_mat(self, a: Tensor, b: Tensor) -> Tensor:
        """out[m, n] = sum_k a[k, m] * b[k, n]; a [K, M, A2, A3] broadcast over b [K, N, B2, B3]."""
        _need_tensor("mul_mat", "a", a), _need_tensor("mul_mat", "b", b)
        _need_type("mul_mat", "b", b, (GType.F32,))
        if a.type in INDEX_TYPES or a.type in (GType.Q8_1, GType.Q8_K):
            raise _fail("mul_mat", f"weight {a.describe()} has a type mul_mat does not take")
        if a.ne[0] != b.ne[0]:
            raise _fail("mul_mat", f"a {a.describe()} and b {b.describe()} differ in K (ne0): {a.ne[0]} vs {b.ne[0]}")
        if b.ne[2] % a.ne[2] or b.ne[3] % a.ne[3]:
            raise _fail("mul_mat", f"a {a.describe()} does not broadcast over b {b.describe()} in dims 2/3")
        if a.is_transposed():
            raise _fail("mul_mat", f"a {a.describe()} is transposed (its rows must be rows)")
        if not a.has_contiguous_rows() or not b.has_contiguous_rows():
            raise _fail("mul_mat", "the rows (ne0) of a and b must be contiguous")
        return self._new(GType.F32, (a.ne[1], b.ne[1], b.ne[2], b.ne[3]), Op.MUL_MAT, None, (a, b),
                         max(a.ndim, b.ndim, 2))

    def mul_mat_id(self, experts: Tensor, b: Tensor, ids: Tensor) -> Tensor:
        """MoE: out[:, e, t] = experts[:, :, ids[e, t]]^T @ b[:, e % b.ne1, t]."""
        _need_tensor("mul_mat_id", "as", experts), _need_tensor("mul_mat_id", "b", b)
        _need_tensor("mul_mat_id", "ids", ids)
        _need_type("mul_mat_id", "b", b, (GType.F32,))
        _need_type("mul_mat_id", "ids", ids, (GType.I32,))
        if experts.ne[3] != 1 or b.ne[3] != 1 or ids.ne[2] != 1 or ids.ne[3] != 1:
            raise _fail("mul_mat_id", "as must be [K, M, n_expert], b [K, *, n_tokens], ids [n_used, n_tokens]")
        if experts.ne[0] != b.ne[0]:
            raise _fail("mul_mat_id", f"as {experts.describe()} and b {b.describe()} differ in K")
        if ids.ne[1] != b.ne[2]:
            raise _fail("mul_mat_id", f"ids {ids.describe()} and b {b.describe()} differ in n_tokens")
        if b.ne[1] not in (1, ids.ne[0]):
            raise _fail("mul_mat_id", f"b.ne1={b.ne[1]} must be 1 or n_used={ids.ne[0]}")
        if ids.ne[0] > experts.ne[2]:
            raise _fail("mul_mat_id", f"n_used={ids.ne[0]} exceeds n_expert={experts.ne[2]}")
        return self._new(GType.F32, (experts.ne[1], ids.ne[0], b.ne[2], 1), Op.MUL_MAT_ID, None,
                         (experts, b, ids), 3)

    # --- positions and attention ----------------------------------------------------------
    def rope(self, a: Tensor, pos: Tensor, n_dims: int, mode: P.RopeMode | int = P.RopeMode.NORMAL,
             freq_base: float = 10000.0, freq_scale: float = 1.0, n_ctx_orig: int = 0,
             ext_factor: float = 0.0, attn_factor: float = 1.0, beta_fast: float = 32.0,
             beta_slow: float = 1.0, freq_factors: Tensor | None = None) -> Tensor:
        """Rotary embedding over a [head_dim, n_head, n_tokens, 1] with pos I32 [n_tokens].

        `freq_factors` (ggml_rope_ext's c, the op's third source): F32, contiguous, at least
        n_dims/2 values; the angle of pair i is divided by freq_factors[i] before YaRN mixes it
        (Llama 3.1+'s rope_freqs.weight). None: every factor is 1."""
        _need_tensor("rope", "a", a), _need_tensor("rope", "pos", pos)
        _need_type("rope", "a", a, (GType.F32,))
        _need_type("rope", "pos", pos, (GType.I32,))
        if pos.ne[0] != a.ne[2] or pos.nelements != pos.ne[0]:
            raise _fail("rope", f"pos {pos.describe()} must be a vector of a.ne2={a.ne[2]} positions")
        if n_dims <= 0 or n_dims % 2 or n_dims > a.ne[0]:
            raise _fail("rope", f"n_dims={n_dims} must be even, positive and at most ne0={a.ne[0]}")
        if not a.has_contiguous_rows():
            raise _fail("rope", f"{a.describe()} rows must be contiguous")
        srcs: tuple[Tensor, ...] = (a, pos)
        if freq_factors is not None:
            _need_tensor("rope", "freq_factors", freq_factors)
            _need_type("rope", "freq_factors", freq_factors, (GType.F32,))
            if not freq_factors.is_contiguous():
                raise _fail("rope", f"freq_factors {freq_factors.describe()} must be contiguous")
            if freq_factors.ne[0] < n_dims // 2:
                raise _fail("rope", f"freq_factors {freq_factors.describe()} must hold at least "
                                    f"n_dims/2={n_dims // 2} factors in ne0")
            srcs += (freq_factors,)
        params = P.RopeParams(int(n_dims), P.RopeMode(int(mode)), int(n_ctx_orig), float(freq_base),
                              float(freq_scale), float(ext_factor), float(attn_factor),
                              float(beta_fast), float(beta_slow))
        return self._new(GType.F32, a.ne, Op.ROPE, params, srcs, a.ndim)

    def soft_max(self, a: Tensor, mask: Tensor | None = None, scale: float = 1.0, max_bias: float = 0.0) -> Tensor:
        """softmax over ne0 of a*scale + slope*mask; mask [ne0, >=ne1] broadcast over dims 2/3."""
        _need_tensor("soft_max", "a", a)
        _need_type("soft_max", "a", a, (GType.F32,))
        src = (a,)
        if mask is not None:
            _need_tensor("soft_max", "mask", mask)
            _need_type("soft_max", "mask", mask, (GType.F16, GType.F32))
            if mask.ne[0] != a.ne[0] or mask.ne[1] < a.ne[1]:
                raise _fail("soft_max", f"mask {mask.describe()} must be [{a.ne[0]}, >={a.ne[1]}] for a {a.describe()}")
            if a.ne[2] % mask.ne[2] or a.ne[3] % mask.ne[3]:
                raise _fail("soft_max", f"mask {mask.describe()} does not broadcast over a {a.describe()}")
            if not mask.is_contiguous():
                raise _fail("soft_max", "mask must be contiguous")
            src = (a, mask)
        elif max_bias > 0:
            raise _fail("soft_max", "max_bias (ALiBi) needs a mask")
        if not a.is_contiguous():
            raise _fail("soft_max", f"{a.describe()} must be contiguous")
        return self._new(GType.F32, a.ne, Op.SOFT_MAX, P.SoftMaxParams(float(scale), float(max_bias)), src, a.ndim)

    def flash_attn_ext(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, scale: float = 1.0,
                       max_bias: float = 0.0, logit_softcap: float = 0.0,
                       prec: P.Prec | str = P.Prec.DEFAULT) -> Tensor:
        """Fused attention. q [D, T, H, B], k [D, KV, Hkv, B], v [Dv, KV, Hkv, B] -> out [Dv, H, T, B]."""
        for role, t in (("q", q), ("k", k), ("v", v)):
            _need_tensor("flash_attn_ext", role, t)
        _need_type("flash_attn_ext", "q", q, (GType.F32,))
        _need_type("flash_attn_ext", "k", k, (GType.F16, GType.F32))
        _need_type("flash_attn_ext", "v", v, (GType.F16, GType.F32))
        if k.ne[0] != q.ne[0]:
            raise _fail("flash_attn_ext", f"q {q.describe()} and k {k.describe()} differ in head size")
        if k.ne[1] != v.ne[1] or k.ne[2] != v.ne[2]:
            raise _fail("flash_attn_ext", f"k {k.describe()} and v {v.describe()} differ in n_kv or heads")
        if k.ne[2] == 0 or q.ne[2] % k.ne[2]:
            raise _fail("flash_attn_ext", f"n_head={q.ne[2]} is not a multiple of n_head_kv={k.ne[2]}")
        if q.ne[3] % k.ne[3] or k.ne[3] != v.ne[3]:
            raise _fail("flash_attn_ext", "dim 3 of q, k, v do not broadcast")
        for role, t in (("q", q), ("k", k), ("v", v)):
            if not t.has_contiguous_rows():
                raise _fail("flash_attn_ext", f"{role} {t.describe()} rows must be contiguous")
        src = (q, k, v)
        if mask is not None:
            _need_tensor("flash_attn_ext", "mask", mask)
            _need_type("flash_attn_ext", "mask", mask, (GType.F16,))
            if mask.ne[0] != k.ne[1] or mask.ne[1] < q.ne[1]:
                raise _fail("flash_attn_ext", f"mask {mask.describe()} must be [n_kv={k.ne[1]}, >={q.ne[1]}]")
            if q.ne[2] % mask.ne[2] or q.ne[3] % mask.ne[3]:
                raise _fail("flash_attn_ext", f"mask {mask.describe()} does not broadcast over heads")
            if not mask.is_contiguous():
                raise _fail("flash_attn_ext", "mask must be contiguous")
            src = (q, k, v, mask)
        elif max_bias > 0:
            raise _fail("flash_attn_ext", "max_bias (ALiBi) needs a mask")
        params = P.FlashAttnParams(float(scale), float(max_bias), float(logit_softcap), P.Prec(prec))
        return self._new(GType.F32, (v.ne[0], q.ne[2], q.ne[1], q.ne[3]), Op.FLASH_ATTN_EXT, params, src,
                         max(3, q.ndim))

    # --- sorting ---------------------------------------------------------------------------
    def argsort(self, a: Tensor, order: P.SortOrder | str = P.SortOrder.ASC) -> Tensor:
        _need_tensor("argsort", "a", a)
        _need_type("argsort", "a", a, (GType.F32,))
        return self._new(GType.I32, a.ne, Op.ARGSORT, P.ArgsortParams(P.SortOrder(order)), (a,), a.ndim)

    def top_k(self, a: Tensor, k: int) -> Tensor:
        """I32 indices of the k largest values of each row, in no particular order (ggml)."""
        _need_tensor("top_k", "a", a)
        _need_type("top_k", "a", a, (GType.F32,))
        if not 1 <= k <= a.ne[0]:
            raise _fail("top_k", f"k={k} must be in 1..{a.ne[0]} for {a.describe()}")
        return self._new(GType.I32, (k,) + a.ne[1:], Op.TOP_K, P.TopKParams(int(k)), (a,), a.ndim)

    def argsort_top_k(self, a: Tensor, k: int) -> Tensor:
        """The first k of a descending argsort: a non-contiguous view (ggml_argsort_top_k)."""
        s = self.argsort(a, P.SortOrder.DESC)
        if not 1 <= k <= a.ne[0]:
            raise _fail("argsort_top_k", f"k={k} must be in 1..{a.ne[0]}")
        return self.view(s, (k,) + s.ne[1:], s.nb[1:], 0)


class Graph:
    """Nodes in topological order (each after its sources) and leafs (op NONE)."""

    def __init__(self, nodes: list[Tensor], leafs: list[Tensor]):
        self.nodes = nodes
        self.leafs = leafs
        self._key: int | None = None

    @property
    def key(self) -> int:
        """Structural key: equal for graphs with the same topology, shapes, types and params."""
        if self._key is None:
            index = {id(t): i for i, t in enumerate(self.leafs + self.nodes)}
            parts = [(t.type, t.ne, t.nb, int(t.flags)) for t in self.leafs]
            for t in self.nodes:
                parts.append((t.op, t.type, t.ne, t.nb, t.params, int(t.flags), t.view_offs,
                              tuple(index[id(s)] for s in t.src),
                              index.get(id(t.view_src), -1) if t.view_src is not None else -1))
            self._key = hash(tuple(parts))
        return self._key

    def __len__(self) -> int:
        return len(self.nodes)

    def __repr__(self) -> str:
        return f"Graph({len(self.nodes)} nodes, {len(self.leafs)} leafs)"


def build_graph(outputs: Sequence[Tensor] | Tensor) -> Graph:
    """Collect every tensor the outputs depend on; outputs are flagged OUTPUT."""
    if isinstance(outputs, Tensor):
        outputs = [outputs]
    nodes: list[Tensor] = []
    leafs: list[Tensor] = []
    seen: set[int] = set()
    for out in outputs:
        if not isinstance(out, Tensor):
            raise GGXShapeError(f"build_graph: outputs must be Tensors, got {type(out).__name__}")
        out.flags |= TensorFlag.OUTPUT
        stack: list[tuple[Tensor, int]] = [(out, 0)]
        while stack:  # iterative post-order DFS: graphs of thousands of nodes stay off the C stack
            t, i = stack.pop()
            if i == 0 and id(t) in seen:
                continue
            deps = t.src + ((t.view_src,) if t.view_src is not None and t.view_src not in t.src else ())
            if i < len(deps):
                stack.append((t, i + 1))
                if id(deps[i]) not in seen:
                    stack.append((deps[i], 0))
                continue
            if id(t) in seen:
                continue
            seen.add(id(t))
            (leafs if t.op is Op.NONE else nodes).append(t)
    return Graph(nodes, leafs)
