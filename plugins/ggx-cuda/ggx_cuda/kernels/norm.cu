// RMS_NORM and NORM over rows of F32 (ggml-cuda's norm.cu): one block per row, warp-shuffle
// reductions, partial sums of the warps combined through shared memory.
//
// Every operand is addressed by byte strides (nb0..nb3), so strided and permuted views work.
// Row r of the flattened grid is (i1, i2, i3) = (r % ne1, r / ne1 % ne2, r / (ne1 * ne2)).
//
// ggml's edge semantics: the row is scaled by 1/sqrt(mean + eps) (rsqrtf), so eps 0 over a zero
// (RMS_NORM) or constant (NORM) row gives 0 * inf = NaN, and an inf in a row gives NaN there.
// NORM centres first and takes the variance of the centred row (as ggml's CPU norm and the
// reference do), so a constant row has a variance of exactly 0.

#include "common.cuh"

// RMS: dst = x * rsqrtf(mean(x^2) + eps) (RMS_NORM); else dst = (x - mean) * rsqrtf(mean((x - mean)^2)
// + eps) (NORM). RMS_NORM is NORM's arithmetic with the mean 0 (x - 0 is x).
template <bool RMS>
__global__ void k_norm_f32(const char * x, char * dst, const int ncols, const int ne1, const int ne2,
                           const ggx_i64 nb00, const ggx_i64 nb01, const ggx_i64 nb02, const ggx_i64 nb03,
                           const ggx_i64 nb0, const ggx_i64 nb1, const ggx_i64 nb2, const ggx_i64 nb3,
                           const float eps) {
    __shared__ float s[GGX_WARP];
    ggx_i64 i1, i2, i3;
    ggx_row_coords(blockIdx.x, ne1, ne2, i1, i2, i3);
    const char * xr = x + i1 * nb01 + i2 * nb02 + i3 * nb03;
    char * dr = dst + i1 * nb1 + i2 * nb2 + i3 * nb3;

    float mean = 0.0f;
    if (!RMS) {
        float sum = 0.0f;
        for (int c = threadIdx.x; c < ncols; c += blockDim.x) {
            sum += *(const float *) (xr + c * nb00);
        }
        mean = ggx_block_sum(sum, s) / (float) ncols;
    }

    float var = 0.0f;
    for (int c = threadIdx.x; c < ncols; c += blockDim.x) {
        const float d = *(const float *) (xr + c * nb00) - mean;
        var += d * d;
    }
    const float scale = rsqrtf(ggx_block_sum(var, s) / (float) ncols + eps);
    for (int c = threadIdx.x; c < ncols; c += blockDim.x) {
        *(float *) (dr + c * nb0) = (*(const float *) (xr + c * nb00) - mean) * scale;
    }
}
