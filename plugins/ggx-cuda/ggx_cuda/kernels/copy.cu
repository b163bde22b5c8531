// Copies of ggx-cuda: CPY, DUP, CONT. Element i (in ne order) of the source becomes element i of
// the destination; the two may differ in shape (same element count) and in strides.
//
//   cpy_raw<U>          same-type copy of whole blocks (an element type is a block of one),
//                       moved as units U of 1, 2, 4 or 8 bytes: bit-exact for every type
//   cpy_convert<S, D>   F32 / F16 / BF16 to F32 / F16 / BF16, one thread per element
//   cpy_to_q<S, Q>      F32 / F16 / BF16 to Q8_0 / Q4_0 / Q4_1 / Q5_0 (contiguous destination), one
//                       thread per block, exactly as ggml's quantize_row_*_ref
//
// Rounding is ggml's (and the reference's, core/ggx/quants.py): F16 round-to-nearest-even with NaN
// made the quiet NaN 0x7E00 (sign kept); BF16 ggml_compute_fp32_to_bf16; quantizers with every
// float operation rounded on its own (__fmul_rn & co: no fused multiply-add contraction).

#include "common.cuh"

// element types (cpy_convert, cpy_to_q: load to float, store from float) and quantizers (cpy_to_q:
// one block of 32)
struct cpy_f32 : ggx_f32 {};
struct cpy_f16 : ggx_f16 {};
struct cpy_bf16 : ggx_bf16 {};
struct cpy_q8_0 : ggx_q8_0 {};
struct cpy_q4_0 : ggx_q4_0 {};
struct cpy_q4_1 : ggx_q4_1 {};
struct cpy_q5_0 : ggx_q5_0 {};

// ---------------------------------------------------------------- kernels
// n units of U bytes, upb units per block; sizes count blocks in dim 0, strides are bytes
// (nb0 is the block stride). Unit k of flat block j goes from src block j to dst block j.
template <typename U>
__global__ void cpy_raw(const char * src, char * dst, long long n, long long upb,
                        long long sne0, long long sne1, long long sne2,
                        long long snb0, long long snb1, long long snb2, long long snb3,
                        long long dne0, long long dne1, long long dne2,
                        long long dnb0, long long dnb1, long long dnb2, long long dnb3) {
    for (ggx_i64 i = ggx_thread_index(); i < n; i += ggx_thread_count()) {
        const long long j = i / upb;
        const long long k = i - j * upb;
        long long i0, i1, i2, i3;
        ggx_coords(j, sne0, sne1, sne2, n, i0, i1, i2, i3);
        const U v = *(const U *) (src + i0 * snb0 + i1 * snb1 + i2 * snb2 + i3 * snb3 + k * (long long) sizeof(U));
        ggx_coords(j, dne0, dne1, dne2, n, i0, i1, i2, i3);
        *(U *) (dst + i0 * dnb0 + i1 * dnb1 + i2 * dnb2 + i3 * dnb3 + k * (long long) sizeof(U)) = v;
    }
}

template <typename S, typename D>
__global__ void cpy_convert(const char * src, char * dst, long long n,
                            long long sne0, long long sne1, long long sne2,
                            long long snb0, long long snb1, long long snb2, long long snb3,
                            long long dne0, long long dne1, long long dne2,
                            long long dnb0, long long dnb1, long long dnb2, long long dnb3) {
    for (ggx_i64 i = ggx_thread_index(); i < n; i += ggx_thread_count()) {
        long long i0, i1, i2, i3;
        ggx_coords(i, sne0, sne1, sne2, n, i0, i1, i2, i3);
        const float v = S::load(src + i0 * snb0 + i1 * snb1 + i2 * snb2 + i3 * snb3);
        ggx_coords(i, dne0, dne1, dne2, n, i0, i1, i2, i3);
        D::store(dst + i0 * dnb0 + i1 * dnb1 + i2 * dnb2 + i3 * dnb3, v);
    }
}

// Block j of the contiguous destination holds source elements 32j .. 32j+31 (flat, ne order),
// read with the source's sizes and strides, whatever they are.
template <typename S, typename Q>
__global__ void cpy_to_q(const char * src, char * dst, long long nblocks,
                         long long sne0, long long sne1, long long sne2,
                         long long snb0, long long snb1, long long snb2, long long snb3) {
    for (ggx_i64 j = ggx_thread_index(); j < nblocks; j += ggx_thread_count()) {
        long long i0, i1, i2, i3;
        ggx_coords(j * 32, sne0, sne1, sne2, nblocks * 32, i0, i1, i2, i3);
        float x[32];
        for (int k = 0; k < 32; k++) {
            x[k] = S::load(src + i0 * snb0 + i1 * snb1 + i2 * snb2 + i3 * snb3);
            if (++i0 == sne0) {  // carry into the next row, plane, ...
                i0 = 0;
                if (++i1 == sne1) {
                    i1 = 0;
                    if (++i2 == sne2) {
                        i2 = 0;
                        ++i3;
                    }
                }
            }
        }
        Q::quantize(x, dst + j * Q::ts);
    }
}
