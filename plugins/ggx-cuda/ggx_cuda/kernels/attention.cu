// FLASH_ATTN_EXT (a simple, correct kernel; ggml-cuda's tiled/MMA kernels are a later issue):
//
//   out[:, h, t, b] = sum_j softmax_j(s_j) v[:, j, h / gqa, b / r3]
//   s_j = softcap * tanh(scale * q[:, t, h, b] . k[:, j, h / gqa, b / r3] / softcap)   (softcap != 0)
//         scale * q . k                                                              (softcap == 0)
//         + slope(h) * mask[j, t, h % mask_ne2, b % mask_ne3]                        (with a mask)
//
// One block of FA_BLOCK threads per (query row t, head h, batch b) = (blockIdx.x, .y, .z). The
// keys go by chunks of FA_CHUNK: each warp takes keys of the chunk in turn, its lanes stride over
// the head dimension (q in shared memory, float), and the scores land in shared memory; then the
// online softmax in float: running max M and sum S, the chunk's weights exp(s - M'), and each
// thread rescales and accumulates its output dims (d = tid, tid + FA_BLOCK, ...) over the chunk's
// value rows. D and Dv are at most FA_DMAX (the planner declines larger heads).
//
// ggml's semantics: a key at -inf is skipped (weight 0); a query row whose every key is -inf
// gives 0 (S == 0 leaves the output 0); a NaN score makes the row NaN. q/k/v/mask/out are
// addressed by byte strides (rows contiguous).

#include "common.cuh"

#define FA_BLOCK 128
#define FA_NWARPS (FA_BLOCK / GGX_WARP)
#define FA_CHUNK 128
#define FA_DMAX 256
#define FA_PER_THREAD (FA_DMAX / FA_BLOCK)

static_assert(FA_CHUNK == FA_BLOCK, "one score per thread in the softmax step");
static_assert(FA_DMAX % FA_BLOCK == 0, "whole output dims per thread");

// KT, VT: float or __half. mask: F16 or null (has_mask 0). slope(h) = 1 when max_bias <= 0, else
// h < n_head_log2 ? m0^(h+1) : m1^(2 (h - n_head_log2) + 1) (ggml's ALiBi).
template <typename KT, typename VT>
__global__ void __launch_bounds__(FA_BLOCK) k_flash_attn_ext(const ggx_u8 * q, const ggx_u8 * k, const ggx_u8 * v,
        const ggx_u8 * mask, float * dst, const int D, const int Dv, const int KV, const int gqa, const int r3,
        const int has_mask, const int mask_ne2, const int mask_ne3,
        const ggx_i64 nbq1, const ggx_i64 nbq2, const ggx_i64 nbq3, const ggx_i64 nbk1, const ggx_i64 nbk2,
        const ggx_i64 nbk3, const ggx_i64 nbv1, const ggx_i64 nbv2, const ggx_i64 nbv3, const ggx_i64 nbm1,
        const ggx_i64 nbm2, const ggx_i64 nbm3, const ggx_i64 nbd1, const ggx_i64 nbd2, const ggx_i64 nbd3,
        const float scale, const float max_bias, const float m0, const float m1, const int n_head_log2,
        const float softcap) {
    const int t = blockIdx.x;
    const int h = blockIdx.y;
    const int b = blockIdx.z;
    const int tid = threadIdx.x;
    const int lane = tid % GGX_WARP;
    const int warp = tid / GGX_WARP;

    __shared__ float sq[FA_DMAX];
    __shared__ float sp[FA_CHUNK];
    __shared__ float red[FA_NWARPS];

    const float * qrow = (const float *) (q + (ggx_i64) t * nbq1 + (ggx_i64) h * nbq2 + (ggx_i64) b * nbq3);
    for (int d = tid; d < D; d += FA_BLOCK) {
        sq[d] = qrow[d];
    }
    const ggx_u8 * kb = k + (ggx_i64) (h / gqa) * nbk2 + (ggx_i64) (b / r3) * nbk3;
    const ggx_u8 * vb = v + (ggx_i64) (h / gqa) * nbv2 + (ggx_i64) (b / r3) * nbv3;
    const __half * mrow = has_mask
        ? (const __half *) (mask + (ggx_i64) t * nbm1 + (ggx_i64) (h % mask_ne2) * nbm2 + (ggx_i64) (b % mask_ne3) * nbm3)
        : nullptr;
    const float slope = ggx_alibi_slope(h, max_bias, m0, m1, n_head_log2);

    const float neg_inf = -ggx_inf();
    float M = neg_inf;
    float S = 0.0f;
    float acc[FA_PER_THREAD];
#pragma unroll
    for (int i = 0; i < FA_PER_THREAD; ++i) {
        acc[i] = 0.0f;
    }
    __syncthreads();

    for (int j0 = 0; j0 < KV; j0 += FA_CHUNK) {
        const int nj = min(FA_CHUNK, KV - j0);
        // scores of the chunk
        for (int jj = warp; jj < nj; jj += FA_NWARPS) {
            const KT * krow = (const KT *) (kb + (ggx_i64) (j0 + jj) * nbk1);
            float dot = 0.0f;
            for (int d = lane; d < D; d += GGX_WARP) {
                dot += sq[d] * ggx_to_f32(krow[d]);
            }
            dot = ggx_warp_sum(dot);
            if (lane == 0) {
                float s = dot * scale;
                if (softcap != 0.0f) {
                    s = softcap * tanhf(s / softcap);
                }
                if (has_mask) {
                    s += slope * __half2float(mrow[j0 + jj]);
                }
                sp[jj] = s;
            }
        }
        __syncthreads();
        // online softmax: the chunk's max, the new running max, the weights
        const float s_own = tid < nj ? sp[tid] : neg_inf;
        const float M_new = ggx_max_nan(M, ggx_block_reduce_ordered<ggx_max_keep_nan, FA_NWARPS>(s_own, red));
        if (M_new == neg_inf) {  // every key so far is masked: nothing to add (uniform branch)
            __syncthreads();
            continue;
        }
        const float alpha = expf(M - M_new);  // 0 while M is -inf
        const float p_own = tid < nj ? expf(s_own - M_new) : 0.0f;
        if (tid < nj) {
            sp[tid] = p_own;
        }
        S = S * alpha + ggx_block_reduce_ordered<ggx_sum, FA_NWARPS>(p_own, red);  // its barriers also publish sp
        M = M_new;
#pragma unroll
        for (int i = 0; i < FA_PER_THREAD; ++i) {
            const int d = tid + i * FA_BLOCK;
            if (d < Dv) {
                float a = acc[i] * alpha;
                for (int jj = 0; jj < nj; ++jj) {
                    a += sp[jj] * ggx_to_f32(((const VT *) (vb + (ggx_i64) (j0 + jj) * nbv1))[d]);
                }
                acc[i] = a;
            }
        }
        __syncthreads();  // sp is rewritten by the next chunk
    }

    float * out = (float *) ((ggx_u8 *) dst + (ggx_i64) h * nbd1 + (ggx_i64) t * nbd2 + (ggx_i64) b * nbd3);
#pragma unroll
    for (int i = 0; i < FA_PER_THREAD; ++i) {
        const int d = tid + i * FA_BLOCK;
        if (d < Dv) {
            out[d] = S == 0.0f ? 0.0f : acc[i] / S;
        }
    }
}
