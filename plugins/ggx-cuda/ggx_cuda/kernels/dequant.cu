// Matrix products (ggml-cuda's cuBLAS fallback, convert.cu, and a simple MUL_MAT_ID):
//
//   k_mm_convert<S, D>  the values of a strided [ne0, ne1, ne2, ne3] tensor of type S (F32, F16,
//                       BF16 or a quantized type, dequantized exactly as ggml's dequantize_row_*)
//                       written contiguously as D (float, __half, __nv_bfloat16): the weights
//                       dequantized for cuBLAS, and the activations converted to the weights' half
//                       type (ggml-cuda's to_fp16 / to_bf16 of src1).
//   k_mm_zero           a float buffer set to zero (a product over K = 0).
//   k_mm_id<S>          MUL_MAT_ID: one warp per output row, per (expert slot, token): the dot
//                       product of the chosen expert's row (dequantized on the fly) with b's row,
//                       in float. ids stay on the device; an id out of range gives NaN.
//
// Every operand is addressed by byte strides (nb1..nb3; rows are contiguous: the graph requires
// it), so row-strided and permuted views work. Block layouts are GGUF's (core/ggx/quants.py).

#include "common.cuh"

#ifndef GGX_HOST_EMU
#include <cuda_bf16.h>
#endif

// --- reading values ---------------------------------------------------------------------------
// One traits struct per storage type: qk values in a block of ts bytes; get(block, j) is value j
// of the block (0 <= j < qk) as float. The float types and Q4_0, Q5_0, Q8_0, Q5_K, Q6_K are common.cuh's;
// Q4_1 and Q4_K compute q * d + m and d * q - m as written, which the compiler may contract into
// a fused multiply-add (common.cuh's rounds each operation).
template <typename E, int TS>
struct mm_elem {
    static constexpr int qk = 1;
    static constexpr int ts = TS;
    static __device__ __forceinline__ float get(const ggx_u8 * blk, int) { return E::load(blk); }
};

struct mm_f32 : mm_elem<ggx_f32, 4> {};
struct mm_f16 : mm_elem<ggx_f16, 2> {};
struct mm_bf16 : mm_elem<ggx_bf16, 2> {};
struct mm_q4_0 : ggx_q4_0 {};
struct mm_q5_0 : ggx_q5_0 {};
struct mm_q8_0 : ggx_q8_0 {};
struct mm_q5_K : ggx_q5_K {};
struct mm_q6_K : ggx_q6_K {};

struct mm_q4_1 : ggx_q4_1 {
    static __device__ __forceinline__ float get(const ggx_u8 * blk, int j) {
        const float d = ggx_f16_at(blk);
        const float m = ggx_f16_at(blk + 2);
        return (float) ggx_nibble(blk + 4, j) * d + m;
    }
};

struct mm_q4_K : ggx_q4_K {
    static __device__ __forceinline__ float get(const ggx_u8 * blk, int j) {
        int sc, m;
        scale_min(blk, j >> 5, sc, m);
        const float d1 = ggx_f16_at(blk) * (float) sc;
        const float m1 = ggx_f16_at(blk + 2) * (float) m;
        return d1 * (float) q(blk, j) - m1;
    }
};

// Value i of a row that starts at `row`.
template <typename S>
static __device__ __forceinline__ float mm_value(const ggx_u8 * row, int i) {
    return S::get(row + (ggx_i64) (i / S::qk) * S::ts, i % S::qk);
}

static __device__ __forceinline__ void mm_store(float * p, float v) { *p = v; }
static __device__ __forceinline__ void mm_store(__half * p, float v) { *p = __float2half_rn(v); }
static __device__ __forceinline__ void mm_store(__nv_bfloat16 * p, float v) { *p = __float2bfloat16_rn(v); }

// --- conversion to a contiguous buffer ---------------------------------------------------------
// One block of MM_CVT_BLOCK threads per (chunk of a row, row): block b is chunk b % nchunks of row
// b / nchunks, row r = (i1, i2, i3) = (r % ne1, r / ne1 % ne2, r / (ne1 ne2)). The blocks loop by
// gridDim.x, so a grid smaller than nrows * nchunks still covers everything.
#define MM_CVT_BLOCK 256

template <typename S, typename D>
__global__ void __launch_bounds__(MM_CVT_BLOCK) k_mm_convert(const ggx_u8 * src, D * dst, const int ne0,
        const int ne1, const int ne2, const ggx_i64 nrows, const ggx_i64 nb1, const ggx_i64 nb2, const ggx_i64 nb3) {
    const int nchunks = (ne0 + MM_CVT_BLOCK - 1) / MM_CVT_BLOCK;
    const ggx_i64 nblocks = nrows * nchunks;
    for (ggx_i64 b = blockIdx.x; b < nblocks; b += gridDim.x) {
        const ggx_i64 r = b / nchunks;
        const int i0 = (int) (b % nchunks) * MM_CVT_BLOCK + threadIdx.x;
        if (i0 >= ne0) {
            continue;
        }
        ggx_i64 i1, i2, i3;
        ggx_row_coords(r, ne1, ne2, i1, i2, i3);
        const ggx_u8 * row = src + i1 * nb1 + i2 * nb2 + i3 * nb3;
        mm_store(dst + r * ne0 + i0, mm_value<S>(row, i0));
    }
}

__global__ void __launch_bounds__(MM_CVT_BLOCK) k_mm_zero(float * dst, const ggx_i64 n) {
    for (ggx_i64 i = (ggx_i64) blockIdx.x * MM_CVT_BLOCK + threadIdx.x; i < n; i += (ggx_i64) gridDim.x * MM_CVT_BLOCK) {
        dst[i] = 0.0f;
    }
}

// --- MUL_MAT_ID ------------------------------------------------------------------------------
// out[m, e, t] = sum_k as[k, m, ids[e, t]] * b[k, e % b_ne1, t]. Block: MM_ID_WARPS warps, warp w
// computes row m = blockIdx.x * MM_ID_WARPS + w; blockIdx.y / .z loop over the expert slots e and
// tokens t (grids of at most 65535 there). Lanes take the values k = lane, lane + 32, ... and the
// partial sums meet by warp shuffles.
#define MM_ID_WARPS 4

template <typename S>
__global__ void __launch_bounds__(MM_ID_WARPS * GGX_WARP) k_mm_id(const ggx_u8 * as, const ggx_u8 * b,
        const ggx_u8 * ids, float * dst, const int K, const int M, const int n_expert, const int n_used,
        const int n_tokens, const int b_ne1, const ggx_i64 nb_as1, const ggx_i64 nb_as2, const ggx_i64 nb_b1,
        const ggx_i64 nb_b2, const ggx_i64 nb_ids0, const ggx_i64 nb_ids1, const ggx_i64 nb_dst1,
        const ggx_i64 nb_dst2) {
    const int lane = threadIdx.x % GGX_WARP;
    const int m = blockIdx.x * MM_ID_WARPS + threadIdx.x / GGX_WARP;
    if (m >= M) {
        return;
    }
    for (int t = blockIdx.z; t < n_tokens; t += gridDim.z) {
        for (int e = blockIdx.y; e < n_used; e += gridDim.y) {
            const int id = *(const int *) (ids + e * nb_ids0 + t * nb_ids1);
            float * out = (float *) ((ggx_u8 *) dst + e * nb_dst1 + t * nb_dst2) + m;
            if (id < 0 || id >= n_expert) {
                if (lane == 0) {
                    *out = ggx_nan();  // NaN: the reference refuses such an id
                }
                continue;
            }
            const ggx_u8 * row = as + (ggx_i64) id * nb_as2 + (ggx_i64) m * nb_as1;
            const float * y = (const float *) (b + (ggx_i64) (e % b_ne1) * nb_b1 + (ggx_i64) t * nb_b2);
            float sum = 0.0f;
            for (int k = lane; k < K; k += GGX_WARP) {
                sum += mm_value<S>(row, k) * y[k];
            }
            sum = ggx_warp_sum(sum);
            if (lane == 0) {
                *out = sum;
            }
        }
    }
}
