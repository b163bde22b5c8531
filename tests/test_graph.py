"""Tensor layout predicates, every op's build-time validation (good and bad), build_graph, keys."""
import pytest

import ggx
from ggx import GGXShapeError, GType, Op
from ggx.graph import build_graph


@pytest.fixture
def ctx():
    return ggx.Context()


def test_tensor_strides_and_sizes(ctx):
    t = ctx.tensor(GType.Q4_0, (64, 3, 2), name="w")
    assert t.nb == (18, 36, 108, 216)
    assert t.nbytes == 216 and t.nrows == 6 and t.row_bytes == 36
    assert t.is_contiguous() and t.shape == (2, 3, 64)
    f = ctx.tensor(GType.F32, (5, 7))
    tr = ctx.transpose(f)
    assert tr.ne[:2] == (7, 5) and not tr.is_contiguous() and tr.is_transposed()
    assert tr.nbytes == f.nbytes and tr.view_src is f


def test_quantized_row_not_multiple_of_block_is_refused(ctx):
    with pytest.raises(GGXShapeError, match=r"w.*100.*32"):
        ctx.tensor(GType.Q4_0, (100, 4), name="w")
    with pytest.raises(GGXShapeError, match="256"):
        ctx.tensor("q4_K", (128, 4), name="k")


def test_views_chain_to_root(ctx):
    a = ctx.tensor(GType.F32, (8, 4, 2))
    v = ctx.view(a, (4, 2), (32,), offset=16)
    p = ctx.permute(v, 1, 0, 2, 3)
    assert p.view_src is a and p.view_offs == 16
    assert p.op is Op.PERMUTE and v.op is Op.VIEW
    with pytest.raises(GGXShapeError, match="past"):
        ctx.view(a, (8, 4, 2), offset=4)


def test_reshape_needs_contiguous_and_same_count(ctx):
    a = ctx.tensor(GType.F32, (8, 4))
    assert ctx.reshape(a, (32,)).ne == (32, 1, 1, 1)
    with pytest.raises(GGXShapeError, match="elements"):
        ctx.reshape(a, (31,))
    with pytest.raises(GGXShapeError, match="not contiguous"):
        ctx.reshape(ctx.transpose(a), (32,))


def test_permute_validation(ctx):
    a = ctx.tensor(GType.F32, (8, 4, 2))
    p = ctx.permute(a, 0, 2, 1, 3)
    assert p.ne == (8, 2, 4, 1) and p.nb == (4, 128, 32, 256)
    with pytest.raises(GGXShapeError, match="permutation"):
        ctx.permute(a, 0, 0, 1, 2)


GOOD = [
    ("get_rows", lambda c: c.get_rows(c.tensor("q8_0", (64, 10)), c.tensor("i32", (7,))), (64, 7, 1, 1)),
    ("set_rows", lambda c: c.set_rows(c.tensor("f16", (64, 10)), c.tensor("f32", (64, 4)), c.tensor("i64", (4,))),
     (64, 10, 1, 1)),
    ("cpy", lambda c: c.cpy(c.tensor("f32", (64, 3)), c.tensor("q8_0", (64, 3))), (64, 3, 1, 1)),
    ("cont", lambda c: c.cont(c.transpose(c.tensor("f32", (5, 3)))), (3, 5, 1, 1)),
    ("add", lambda c: c.add(c.tensor("f32", (6, 4, 3)), c.tensor("f32", (6, 1, 3))), (6, 4, 3, 1)),
    ("mul", lambda c: c.mul(c.tensor("f32", (6, 4)), c.tensor("f32", (6,))), (6, 4, 1, 1)),
    ("scale", lambda c: c.scale(c.tensor("f32", (6, 4)), 0.5), (6, 4, 1, 1)),
    ("silu", lambda c: c.silu(c.tensor("f32", (6, 4))), (6, 4, 1, 1)),
    ("gelu", lambda c: c.gelu(c.tensor("f32", (6, 4)), "gelu_erf"), (6, 4, 1, 1)),
    ("glu fused", lambda c: c.swiglu(c.tensor("f32", (12, 4))), (6, 4, 1, 1)),
    ("glu split", lambda c: c.swiglu(c.tensor("f32", (6, 4)), c.tensor("f32", (6, 4))), (6, 4, 1, 1)),
    ("rms_norm", lambda c: c.rms_norm(c.tensor("f32", (6, 4)), 1e-6), (6, 4, 1, 1)),
    ("norm", lambda c: c.norm(c.tensor("f32", (6, 4)), 1e-5), (6, 4, 1, 1)),
    ("mul_mat", lambda c: c.mul_mat(c.tensor("q4_1", (64, 5, 2)), c.tensor("f32", (64, 3, 6))), (5, 3, 6, 1)),
    ("mul_mat_id", lambda c: c.mul_mat_id(c.tensor("q4_0", (64, 6, 4)), c.tensor("f32", (64, 2, 5)),
                                          c.tensor("i32", (2, 5))), (6, 2, 5, 1)),
    ("rope", lambda c: c.rope(c.tensor("f32", (64, 3, 5)), c.tensor("i32", (5,)), 64), (64, 3, 5, 1)),
    ("soft_max", lambda c: c.soft_max(c.tensor("f32", (37, 5, 4)), c.tensor("f16", (37, 8)), 0.1, 8.0),
     (37, 5, 4, 1)),
    ("flash_attn_ext", lambda c: c.flash_attn_ext(c.tensor("f32", (64, 7, 6)), c.tensor("f16", (64, 33, 2)),
                                                  c.tensor("f16", (64, 33, 2)), c.tensor("f16", (33, 7)), 0.125),
     (64, 6, 7, 1)),
    ("argsort", lambda c: c.argsort(c.tensor("f32", (37, 4)), "desc"), (37, 4, 1, 1)),
    ("top_k", lambda c: c.top_k(c.tensor("f32", (37, 4)), 5), (5, 4, 1, 1)),
    ("sum_rows", lambda c: c.sum_rows(c.tensor("f32", (37, 4))), (1, 4, 1, 1)),
]


@pytest.mark.parametrize("name,build,ne", GOOD, ids=[g[0] for g in GOOD])
def test_ops_accept_good_shapes(ctx, name, build, ne):
    assert build(ctx).ne == ne


BAD = [
    ("get_rows ids type", lambda c: c.get_rows(c.tensor("f32", (64, 10)), c.tensor("f32", (7,))), "ids"),
    ("set_rows row length", lambda c: c.set_rows(c.tensor("f16", (64, 10)), c.tensor("f32", (32, 4)),
                                                  c.tensor("i64", (4,))), "row length"),
    ("set_rows id count", lambda c: c.set_rows(c.tensor("f16", (64, 10)), c.tensor("f32", (64, 4)),
                                                c.tensor("i64", (3,))), "one entry per src row"),
    ("cpy count", lambda c: c.cpy(c.tensor("f32", (64, 3)), c.tensor("f16", (64, 2))), "element count"),
    ("cpy from quantized", lambda c: c.cpy(c.tensor("q8_0", (64, 3)), c.tensor("f32", (64, 3))), "quantized"),
    ("add broadcast", lambda c: c.add(c.tensor("f32", (6, 4)), c.tensor("f32", (4, 4))), "broadcast"),
    ("mul type", lambda c: c.mul(c.tensor("f16", (6, 4)), c.tensor("f32", (6, 4))), "F32"),
    ("glu odd", lambda c: c.swiglu(c.tensor("f32", (7, 4))), "even"),
    ("glu shapes", lambda c: c.swiglu(c.tensor("f32", (6, 4)), c.tensor("f32", (6, 3))), "same shape"),
    ("mul_mat K", lambda c: c.mul_mat(c.tensor("f32", (64, 5)), c.tensor("f32", (63, 3))), "K"),
    ("mul_mat broadcast", lambda c: c.mul_mat(c.tensor("f32", (64, 5, 4)), c.tensor("f32", (64, 3, 6))),
     "broadcast"),
    ("mul_mat b type", lambda c: c.mul_mat(c.tensor("f32", (64, 5)), c.tensor("f16", (64, 3))), "F32"),
    ("mul_mat transposed a", lambda c: c.mul_mat(c.transpose(c.tensor("f32", (5, 64))), c.tensor("f32", (64, 3))),
     "transposed"),
    ("mul_mat_id tokens", lambda c: c.mul_mat_id(c.tensor("q4_0", (64, 6, 4)), c.tensor("f32", (64, 2, 5)),
                                                  c.tensor("i32", (2, 4))), "n_tokens"),
    ("rope pos", lambda c: c.rope(c.tensor("f32", (64, 3, 5)), c.tensor("i32", (4,)), 64), "positions"),
    ("rope n_dims", lambda c: c.rope(c.tensor("f32", (64, 3, 5)), c.tensor("i32", (5,)), 65), "n_dims"),
    ("soft_max mask", lambda c: c.soft_max(c.tensor("f32", (37, 5)), c.tensor("f16", (36, 5))), "mask"),
    ("soft_max alibi", lambda c: c.soft_max(c.tensor("f32", (37, 5)), None, 1.0, 8.0), "ALiBi"),
    ("fa gqa", lambda c: c.flash_attn_ext(c.tensor("f32", (64, 7, 5)), c.tensor("f16", (64, 33, 2)),
                                          c.tensor("f16", (64, 33, 2))), "n_head"),
    ("fa head size", lambda c: c.flash_attn_ext(c.tensor("f32", (128, 7, 4)), c.tensor("f16", (64, 33, 2)),
                                                c.tensor("f16", (64, 33, 2))), "head size"),
    ("fa mask", lambda c: c.flash_attn_ext(c.tensor("f32", (64, 7, 4)), c.tensor("f16", (64, 33, 2)),
                                           c.tensor("f16", (64, 33, 2)), c.tensor("f16", (32, 7))), "mask"),
    ("top_k k", lambda c: c.top_k(c.tensor("f32", (37, 4)), 38), "k=38"),
    ("sum_rows type", lambda c: c.sum_rows(c.tensor("i32", (37, 4))), "F32"),
    ("not a tensor", lambda c: c.silu("x"), "must be a Tensor"),
]


@pytest.mark.parametrize("name,build,match", BAD, ids=[b[0] for b in BAD])
def test_ops_refuse_bad_shapes(ctx, name, build, match):
    with pytest.raises(GGXShapeError, match=match):
        build(ctx)


def test_build_graph_topological_and_key():
    def make():
        c = ggx.Context()
        x = c.tensor("f32", (8, 3), name="x")
        w = c.tensor("f32", (8, 4), name="w")
        h = c.rms_norm(x, 1e-6)
        y = c.mul_mat(w, h)
        return c.silu(y), (x, w, h, y)

    out, (x, w, h, y) = make()
    g = build_graph(out)
    assert g.nodes == [h, y, out] and set(g.leafs) == {x, w}
    assert out.flags & ggx.TensorFlag.OUTPUT
    out2, _ = make()
    assert build_graph(out2).key == g.key
    c = ggx.Context()
    other = c.silu(c.mul_mat(c.tensor("f32", (8, 5)), c.rms_norm(c.tensor("f32", (8, 3)), 1e-6)))
    assert build_graph(other).key != g.key


def test_build_graph_deep_chain_no_recursion_limit():
    c = ggx.Context()
    t = c.tensor("f32", (4,))
    for _ in range(5000):
        t = c.scale(t, 1.0)
    assert len(build_graph(t).nodes) == 5000


@pytest.mark.parametrize("eps", [-1e-6, float("nan"), float("inf"), "x"])
@pytest.mark.parametrize("op", ["rms_norm", "norm"])
def test_norm_eps_must_be_finite_and_non_negative(ctx, op, eps):
    a = ctx.tensor(GType.F32, (8, 2))
    with pytest.raises(GGXShapeError, match="eps"):
        getattr(ctx, op)(a, eps)
