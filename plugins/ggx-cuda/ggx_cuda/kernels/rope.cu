// ROPE over F32 [head_dim, n_head, n_tokens, ne3] with positions I32 [n_tokens] (ggml-cuda's
// rope.cu, modes NORMAL and NEOX, with YaRN).
//
// Pair i (0 <= i < n_dims/2) of the row of token i2 rotates by
//     theta_extrap = pos[i2] * powf(theta_scale, i),   theta_scale = freq_base^(-2/n_dims)
// as ggml-cuda computes it, divided by freq_factors[i] when the op has them (ggml_rope_ext's c,
// ff != null; ggml-cuda's has_ff); YaRN mixes freq_scale * theta_extrap (interpolation) with
// theta_extrap by the ramp over the correction dims [corr0, corr1] when ext_factor != 0, and
// scales cos/sin by attn_factor * (1 + 0.1 log(1/freq_scale)) then. NORMAL rotates
// (x[2i], x[2i+1]), NEOX (x[i], x[i + n_dims/2]); elements n_dims .. ne0-1 are copied.
//
// A block is blockDim.y rows, each row's work items (n_dims/2 pairs, then ne0 - n_dims copies)
// strided over threadIdx.x. Every operand is addressed by byte strides.

#include "common.cuh"

template <bool NEOX>
__global__ void k_rope_f32(const char * x, const char * pos, const char * ff, char * dst, const int ne0,
                           const int n_dims,
                           const int ne1, const int ne2, const ggx_i64 nrows,
                           const ggx_i64 nb00, const ggx_i64 nb01, const ggx_i64 nb02, const ggx_i64 nb03,
                           const ggx_i64 nb_pos,
                           const ggx_i64 nb0, const ggx_i64 nb1, const ggx_i64 nb2, const ggx_i64 nb3,
                           const float theta_scale, const float freq_scale, const float ext_factor,
                           const float attn_factor, const float corr0, const float corr1) {
    const ggx_i64 row = (ggx_i64) blockIdx.x * blockDim.y + threadIdx.y;
    if (row >= nrows) {
        return;
    }
    ggx_i64 i1, i2, i3;
    ggx_row_coords(row, ne1, ne2, i1, i2, i3);
    const char * xr = x + i1 * nb01 + i2 * nb02 + i3 * nb03;
    char * dr = dst + i1 * nb1 + i2 * nb2 + i3 * nb3;

    const int half = n_dims / 2;
    const int n_items = half + (ne0 - n_dims);
    const float p = (float) *(const int *) (pos + i2 * nb_pos);

    for (int t = threadIdx.x; t < n_items; t += blockDim.x) {
        if (t >= half) {
            const ggx_i64 i = n_dims + (t - half);
            *(float *) (dr + i * nb0) = *(const float *) (xr + i * nb00);
            continue;
        }
        const int j0 = NEOX ? t : 2 * t;
        const int j1 = NEOX ? t + half : 2 * t + 1;

        // rope_yarn
        const float freq_factor = ff != nullptr ? *(const float *) (ff + (ggx_i64) t * 4) : 1.0f;
        const float theta_extrap = p * powf(theta_scale, (float) t) / freq_factor;
        const float theta_interp = freq_scale * theta_extrap;
        float theta = theta_interp;
        float mscale = attn_factor;
        if (ext_factor != 0.0f) {
            const float y = ((float) t - corr0) / fmaxf(0.001f, corr1 - corr0);
            const float ramp_mix = (1.0f - fminf(1.0f, fmaxf(0.0f, y))) * ext_factor;
            theta = theta_interp * (1.0f - ramp_mix) + theta_extrap * ramp_mix;
            mscale *= 1.0f + 0.1f * logf(1.0f / freq_scale);
        }
        const float cos_theta = cosf(theta) * mscale;
        const float sin_theta = sinf(theta) * mscale;

        const float x0 = *(const float *) (xr + j0 * nb00);
        const float x1 = *(const float *) (xr + j1 * nb00);
        *(float *) (dr + j0 * nb0) = x0 * cos_theta - x1 * sin_theta;
        *(float *) (dr + j1 * nb0) = x0 * sin_theta + x1 * cos_theta;
    }
}
