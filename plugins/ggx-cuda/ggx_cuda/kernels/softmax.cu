// SOFT_MAX over rows of F32 (ggml-cuda's softmax.cu): softmax over ne0 of
//     v = x * scale + slope(i2) * mask[i1, i2 % ne12, i3 % ne13]
// with an optional mask (F32 or F16, T; null: none) and ALiBi slopes (max_bias > 0).
//
// One block per row. The values v, then exp(v - max), are kept in dynamic shared memory when
// the row fits (use_shared) and in the destination row otherwise; each thread touches only its
// own columns across the passes, so that needs no barrier. The first GGX_WARP floats of the
// dynamic shared memory are the inter-warp reduction buffer.
//
// ggml's edge semantics: exp(v - max) scaled by 1/sum with no guard, so a row that is all -inf
// (-inf - -inf), or holds +inf or NaN, is NaN throughout.
//
// Every operand is addressed by byte strides.

#include "common.cuh"

template <typename T>
__global__ void k_soft_max_f32(const char * x, const char * mask, char * dst, const int ncols,
                               const int ne01, const int ne02, const int ne12, const int ne13,
                               const ggx_i64 nb00, const ggx_i64 nb01, const ggx_i64 nb02,
                               const ggx_i64 nb03,
                               const ggx_i64 nb10, const ggx_i64 nb11, const ggx_i64 nb12,
                               const ggx_i64 nb13,
                               const ggx_i64 nb0, const ggx_i64 nb1, const ggx_i64 nb2,
                               const ggx_i64 nb3,
                               const float scale, const float max_bias, const float m0, const float m1,
                               const int n_head_log2, const int use_shared) {
    GGX_DYNAMIC_SHARED(float, softmax_smem);
    float * s = softmax_smem;
    float * vals = softmax_smem + GGX_WARP;

    ggx_i64 i1, i2, i3;
    ggx_row_coords(blockIdx.x, ne01, ne02, i1, i2, i3);
    const char * xr = x + i1 * nb01 + i2 * nb02 + i3 * nb03;
    char * dr = dst + i1 * nb1 + i2 * nb2 + i3 * nb3;
    const char * mr = mask ? mask + i1 * nb11 + (i2 % ne12) * nb12 + (i3 % ne13) * nb13 : nullptr;

    const float slope = ggx_alibi_slope((int) i2, max_bias, m0, m1, n_head_log2);

    float max_val = -ggx_inf();
    for (int c = threadIdx.x; c < ncols; c += blockDim.x) {
        float v = *(const float *) (xr + c * nb00) * scale;
        if (mr) {
            v += slope * ggx_to_f32(*(const T *) (mr + c * nb10));
        }
        if (use_shared) {
            vals[c] = v;
        } else {
            *(float *) (dr + c * nb0) = v;
        }
        max_val = fmaxf(max_val, v);
    }
    max_val = ggx_block_max(max_val, s);

    float sum = 0.0f;
    for (int c = threadIdx.x; c < ncols; c += blockDim.x) {
        float * vp = use_shared ? vals + c : (float *) (dr + c * nb0);
        const float e = expf(*vp - max_val);
        *vp = e;
        sum += e;
    }
    sum = ggx_block_sum(sum, s);

    const float inv_sum = 1.0f / sum;
    for (int c = threadIdx.x; c < ncols; c += blockDim.x) {
        const float e = use_shared ? vals[c] : *(const float *) (dr + c * nb0);
        *(float *) (dr + c * nb0) = e * inv_sum;
    }
}
