"""F32 GEMM from register tiles: C[M x N] += A[M x K] B[K x N] (ggml's simd-gemm.h).

The micro-kernel keeps an RM x (NV vectors of LANES floats) block of C in registers across the
whole K loop: per k it loads NV vectors of B's row k, broadcasts A[i, k] for each of the RM rows
and does RM * NV fused multiply-adds, so the accumulators never touch memory inside the loop.
It is written as one LLVM loop (the accumulators are phi values), not left to the vectorizer,
so that they stay in registers whatever numba does around them.

The tile shape is that of ggml's simd_gemm for the float SIMD form (`ggx_cpu.isa.vmath.FloatSimd`,
the kernels' compile-time token): AVX-512 has 32 vector registers, so 4 x 4 vectors of 16;
AVX2 has 16, so 6 x 2 of 8 (12 accumulators + 2 B vectors + 1 broadcast). Every element of C
is summed over k in order with one FMA per step, as ggml's simd_gemm does, so C has ggml's bits.

Layouts (element offsets into 1-D float32 arrays; row-major with the given row strides):
A(i, k) = A[ao + i*lda + k], B(k, n) = B[bo + k*ldb + n], C(i, n) = C[co + i*ldc + n].
`gemm` needs M a multiple of RM (callers pad their rows) and N a multiple of LANES; nothing is
bounds-checked (the caller sizes its scratch). `pack_transposed_8x8` fills a B operand from the
rows of a matrix stored the other way round (F32 or F16).
"""
from __future__ import annotations

from llvmlite import ir
from numba import njit
from numba.core import types
from numba.extending import intrinsic

from .codegen import I64, declare
from .tokens import token_constant
from .vmath import FloatSimdType, lanes


@token_constant
def tile_rows(fs) -> int:
    """RM: the rows of C one micro-kernel call computes (M must be a multiple)."""
    return fs.tile_rows


@token_constant
def tile_cols(fs) -> int:
    """NV * LANES: the columns of C one full-width micro-kernel call computes."""
    return fs.tile_vectors * fs.lanes


def _data(context, builder, arrty, arr, off):
    ary = context.make_array(arrty)(context, builder, arr)
    return builder.gep(ary.data, [off])


def _micro_kernel(narrow: bool):
    """The intrinsic (fs, C, co, ldc, A, ao, lda, B, bo, ldb, K): C block += A block x B block,
    RM rows by NV vectors (or one vector when `narrow`, for the columns left of a row)."""
    @intrinsic
    def kernel(typingctx, fs, c, co, ldc, a, ao, lda, b, bo, ldb, k):
        if not isinstance(fs, FloatSimdType):
            return None
        for arr in (c, a, b):
            if not (isinstance(arr, types.Array) and arr.dtype == types.float32):
                return None
        rm, nv, width = fs.tile_rows, 1 if narrow else fs.tile_vectors, fs.lanes
        intp = types.intp

        def codegen(context, builder, sig, args):
            _, c_arr, co_, ldc_, a_arr, ao_, lda_, b_arr, bo_, ldb_, k_ = args
            vty = ir.VectorType(ir.FloatType(), width)
            vptr = vty.as_pointer()
            fma = declare(builder, f"llvm.fmuladd.v{width}f32", vty, [vty, vty, vty])
            cp = _data(context, builder, sig.args[1], c_arr, co_)
            ap = _data(context, builder, sig.args[4], a_arr, ao_)
            bp = _data(context, builder, sig.args[7], b_arr, bo_)

            def at(p, i):
                return builder.gep(p, [i])

            def c_ptr(i, v):
                off = builder.add(builder.mul(ir.Constant(I64, i), ldc_), ir.Constant(I64, v * width))
                return builder.bitcast(at(cp, off), vptr)

            init = [[builder.load(c_ptr(i, v), align=4) for v in range(nv)] for i in range(rm)]
            entry = builder.block
            loop = builder.append_basic_block("tile_k")
            done = builder.append_basic_block("tile_done")
            builder.cbranch(builder.icmp_signed(">", k_, ir.Constant(I64, 0)), loop, done)

            builder.position_at_end(loop)
            kk = builder.phi(I64)
            kk.add_incoming(ir.Constant(I64, 0), entry)
            accs = [[builder.phi(vty) for _ in range(nv)] for _ in range(rm)]
            brow = at(bp, builder.mul(kk, ldb_))
            bvec = [builder.load(builder.bitcast(at(brow, ir.Constant(I64, v * width)), vptr), align=4)
                    for v in range(nv)]
            new = []
            for i in range(rm):
                av = builder.load(at(ap, builder.add(builder.mul(ir.Constant(I64, i), lda_), kk)))
                av = builder.insert_element(ir.Constant(vty, ir.Undefined), av, ir.Constant(ir.IntType(32), 0))
                av = builder.shuffle_vector(av, ir.Constant(vty, ir.Undefined),
                                            ir.Constant(ir.VectorType(ir.IntType(32), width), [0] * width))
                new.append([builder.call(fma, [av, bvec[v], accs[i][v]]) for v in range(nv)])
            for i in range(rm):
                for v in range(nv):
                    accs[i][v].add_incoming(init[i][v], entry)
                    accs[i][v].add_incoming(new[i][v], loop)
            knext = builder.add(kk, ir.Constant(I64, 1))
            kk.add_incoming(knext, loop)
            builder.cbranch(builder.icmp_signed("<", knext, k_), loop, done)

            builder.position_at_end(done)
            outs = [[builder.phi(vty) for _ in range(nv)] for _ in range(rm)]  # phis head their block
            for i in range(rm):
                for v in range(nv):
                    outs[i][v].add_incoming(init[i][v], entry)
                    outs[i][v].add_incoming(new[i][v], loop)
                    builder.store(outs[i][v], c_ptr(i, v), align=4)
            return context.get_dummy_value()

        return types.void(fs, c, intp, intp, a, intp, intp, b, intp, intp, intp), codegen

    return kernel


micro_kernel = _micro_kernel(narrow=False)
micro_kernel.__doc__ = "C[RM x NV*LANES] += A[RM x K] B[K x NV*LANES] at the given offsets (module docstring)."
micro_kernel_narrow = _micro_kernel(narrow=True)
micro_kernel_narrow.__doc__ = "C[RM x LANES] += A[RM x K] B[K x LANES]: the columns a full tile leaves."


@njit(cache=True, inline="always")
def gemm(fs, c, co, ldc, a, ao, lda, b, bo, ldb, m, n, k):
    """C[m x n] += A[m x k] B[k x n] (module docstring; m % RM == 0, n % LANES == 0)."""
    rm, w, lw = tile_rows(fs), tile_cols(fs), lanes(fs)
    for i in range(0, m, rm):
        j = 0
        while j + w <= n:
            micro_kernel(fs, c, co + i * ldc + j, ldc, a, ao + i * lda, lda, b, bo + j, ldb, k)
            j += w
        while j < n:
            micro_kernel_narrow(fs, c, co + i * ldc + j, ldc, a, ao + i * lda, lda, b, bo + j, ldb, k)
            j += lw


def _transpose8(builder, rows):
    """The 8 columns of the 8x8 matrix whose rows are the <8 x float> values `rows` (three rounds
    of two-vector shuffles, the unpack / shuffle / lane-permute ladder of an AVX transpose)."""
    def shuf(a, b, mask):
        return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(ir.IntType(32), 8), mask))

    lo32, hi32 = [0, 8, 1, 9, 4, 12, 5, 13], [2, 10, 3, 11, 6, 14, 7, 15]
    lo64, hi64 = [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15]
    lo128, hi128 = [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]
    a = []
    for p in range(0, 8, 2):
        a += [shuf(rows[p], rows[p + 1], lo32), shuf(rows[p], rows[p + 1], hi32)]
    # a[2p] holds (row 2p, row 2p+1) columns 0,1 | 4,5; a[2p+1] columns 2,3 | 6,7
    b = []
    for p in (0, 4):
        b += [shuf(a[p], a[p + 2], lo64), shuf(a[p], a[p + 2], hi64),
              shuf(a[p + 1], a[p + 3], lo64), shuf(a[p + 1], a[p + 3], hi64)]
    # b[c] (c < 4) holds rows 0..3 of columns c | c+4, b[4 + c] rows 4..7
    return [shuf(b[c % 4], b[4 + c % 4], lo128 if c < 4 else hi128) for c in range(8)]


@intrinsic
def pack_transposed_8x8(typingctx, dst, do, ldd, src, so, lds):
    """dst(i, j) = src(j, i) for i, j < 8: dst float32 at dst[do + i*ldd + j], src float32 or IEEE
    half bits (uint16, converted exactly) at src[so + j*lds + i]. Packs 8 rows of K into 8
    columns of the transposed B operand of S = Q K^T with vector loads, shuffles and stores
    instead of 64 scalar stores one row apart."""
    if not (isinstance(dst, types.Array) and dst.dtype == types.float32 and isinstance(src, types.Array)
            and src.dtype in (types.float32, types.uint16)):
        return None
    half = src.dtype == types.uint16
    intp = types.intp

    def codegen(context, builder, sig, args):
        d_arr, do_, ldd_, s_arr, so_, lds_ = args
        f8 = ir.VectorType(ir.FloatType(), 8)
        in_ty = ir.VectorType(ir.HalfType(), 8) if half else f8
        sp = _data(context, builder, sig.args[3], s_arr, so_)
        dp = _data(context, builder, sig.args[0], d_arr, do_)
        rows = []
        for j in range(8):
            p = builder.gep(sp, [builder.mul(ir.Constant(I64, j), lds_)])
            x = builder.load(builder.bitcast(p, in_ty.as_pointer()), align=2 if half else 4)
            rows.append(builder.fpext(x, f8) if half else x)
        for i, col in enumerate(_transpose8(builder, rows)):
            p = builder.gep(dp, [builder.mul(ir.Constant(I64, i), ldd_)])
            builder.store(col, builder.bitcast(p, f8.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.void(dst, intp, intp, src, intp, intp), codegen
