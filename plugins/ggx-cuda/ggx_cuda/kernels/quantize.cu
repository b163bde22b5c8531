// Activation quantization for the integer matrix products (ggml-cuda's quantize.cu):
//
//   k_quantize_q8_1        F32 columns -> q8_1 rows (MMVQ): column c = (i3 * ne2 + i2) * ne1 + i1 of
//                          x [K, ne1, ne2, ne3] becomes the K / 32 blocks at y + c * K / 32.
//   k_quantize_mmq<DS4>    F32 columns -> block_q8_1_mmq (MMQ): for channel z = i3 * ne2 + i2, the
//                          128-value block kb of column i1 is y[(z * nkb + kb) * ne1 + i1]: the blocks
//                          of one K range are consecutive over the columns, so a tile of columns is
//                          one contiguous load. nkb * 128 covers K rounded up to whole 256-value
//                          iterations; values past K quantize to 0. DS4 picks the header (q8_1.cuh).
//                          With `ids` (MUL_MAT_ID's grouped columns, mmid.cu) column i1 of the one
//                          channel is x's column ids[i1] (= i12 * ne1_src + i11).
//
// One warp per 32 values (a q8_1 group): the group's max |x| and sum of q (s = d * sum(q), ggml-cpu's
// recipe, not ggml-cuda's float sum: q8_1.cuh) by warp shuffles. x goes by
// its byte strides nb1..nb3 (rows contiguous), so permuted and strided views are read in place.

#include "q8_1.cuh"

#define Q8_1_BLOCK 256

__global__ void __launch_bounds__(Q8_1_BLOCK) k_quantize_q8_1(const ggx_u8 * x, ggx_block_q8_1 * y, const int K,
        const int ne1, const int ne2, const ggx_i64 ncols, const ggx_i64 nb1, const ggx_i64 nb2, const ggx_i64 nb3) {
    const int i0 = blockIdx.x * Q8_1_BLOCK + threadIdx.x;
    if (i0 >= K) {  // K is a multiple of 32: whole warps leave
        return;
    }
    const int nblocks = K / 32;
    for (ggx_i64 c = blockIdx.y; c < ncols; c += gridDim.y) {
        ggx_i64 i1, i2, i3;
        ggx_row_coords(c, ne1, ne2, i1, i2, i3);
        const float xi = ((const float *) (x + i1 * nb1 + i2 * nb2 + i3 * nb3))[i0];
        float d, sum;
        const int q = ggx_q8_1_group(xi, d, sum);
        ggx_block_q8_1 * b = y + c * nblocks + i0 / 32;
        ((signed char *) b->qs)[i0 % 32] = (signed char) q;
        if (i0 % 32 == 0) {
            b->d = ggx_f32_to_f16(d);
            b->s = ggx_f32_to_f16(sum);
        }
    }
}

// grid (nkb, ne1, ne2 * ne3), GGX_QK8_1_MMQ threads: one block_q8_1_mmq each. ggml's recipe:
// d_inv = 127 / amax, q = round(x * d_inv), d = 1 / d_inv (a zero group: q = 0, d = 0).
template <bool DS4>
__global__ void __launch_bounds__(GGX_QK8_1_MMQ) k_quantize_mmq(const ggx_u8 * x, ggx_block_q8_1_mmq * y,
        const int * ids, const int K, const int ne1_src, const int ne2, const ggx_i64 nb1, const ggx_i64 nb2,
        const ggx_i64 nb3) {
    const int kb = blockIdx.x;
    const int i1 = blockIdx.y;
    const int z = blockIdx.z;
    const int i0 = kb * GGX_QK8_1_MMQ + threadIdx.x;
    const ggx_u8 * row = ids ? x + (ggx_i64) (ids[i1] % ne1_src) * nb1 + (ggx_i64) (ids[i1] / ne1_src) * nb2
                             : x + (ggx_i64) i1 * nb1 + (ggx_i64) (z % ne2) * nb2 + (ggx_i64) (z / ne2) * nb3;
    const float xi = i0 < K ? ((const float *) row)[i0] : 0.0f;
    const float amax = ggx_warp_reduce<ggx_max>(fabsf(xi));
    const float d_inv = 127.0f / amax;
    const int q = amax == 0.0f ? 0 : (int) roundf(xi * d_inv);
    const float d = amax == 0.0f ? 0.0f : 1.0f / d_inv;
    const float sum = DS4 ? d * ggx_warp_sum((float) q) : 0.0f;  // d * sum(q), as ggx_q8_1_group
    ggx_block_q8_1_mmq * b = y + ((ggx_i64) z * gridDim.x + kb) * gridDim.y + i1;
    ((signed char *) b->qs)[threadIdx.x] = (signed char) q;
    if (threadIdx.x % 32 == 0) {
        b->ds[threadIdx.x / 32] = DS4 ? (unsigned int) ggx_f32_to_f16(d) | ((unsigned int) ggx_f32_to_f16(sum) << 16)
                                      : __float_as_uint(d);
    }
}
