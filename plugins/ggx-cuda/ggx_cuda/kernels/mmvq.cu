// MMVQ (ggml-cuda's mul_mat_vec_q): quantized weights times 1..8 activation columns quantized to
// q8_1 rows (quantize.cu), integer dot products with __dp4a.
//
//   k_mul_mat_vec_q<T, NCOLS, NWARPS, RPB>
//     dst[row, j, channel, sample] = sum_k x[k, row, channel / channel_ratio, sample / sample_ratio]
//                                          * y[k, j, channel, sample]
//     grid (ceil(nrows / RPB), channels, samples), block (32, NWARPS): RPB rows per block. Thread
//     tid takes the blocks kbx = tid / (qi / vdr), + NWARPS * 32 * vdr / qi, ... of each row, and in
//     each the vdr ints at kqs = vdr * (tid % (qi / vdr)) (T::qi: ints of quants per block, T::vdr:
//     ints per thread; ggml's values). The warps' partial sums meet in shared memory, warp 0 sums
//     them by shuffles and lane i writes row row0 + i.
//
// Weights go by byte strides (stride_row_x, stride_channel_x, stride_sample_x; blocks are read in
// place), y by block strides, dst by float strides. Rows past nrows (the last block's) read the
// last row and are not written. The offsets of Q4_0 (-8) and Q5_0 (-16) and the mins of Q4_1,
// Q4_K, Q5_K multiply q8_1's stored sum s (one multiply per block, not per value); Q6_K's -32 is
// subtracted in the packed quants.

#include "q8_1.cuh"

#ifndef GGX_HOST_EMU
#define ggx_dp4a __dp4a
#define ggx_vsub4 __vsubss4
#else
#define ggx_dp4a hc_dp4a
#define ggx_vsub4 hc_vsubss4
#endif

// ---------------------------------------------------------------- per-type dot products
// vec_dot(bx, by, iqs): this thread's part of block bx (at its first byte) times the q8_1 blocks
// by[0..qk/32) it spans, from int iqs of the block's quants.

// the dot product of 2 ints of nibbles from int iqs of qs (byte j: values j and j + 16) with the
// q8_1 block's quants of the same values; B4: qs 4-byte aligned (Q4_1), else 2-byte (Q4_0)
template <bool B4>
static __device__ __forceinline__ int mmvq_nibble_dot(const ggx_u8 * qs, const ggx_block_q8_1 * by, const int iqs) {
    int sumi = 0;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int v = B4 ? ggx_int_b4(qs, iqs + i) : ggx_int_b2(qs, iqs + i);
        sumi = ggx_dp4a(v & 0x0F0F0F0F, by->qs[iqs + i], sumi);
        sumi = ggx_dp4a((v >> 4) & 0x0F0F0F0F, by->qs[iqs + i + 4], sumi);
    }
    return sumi;
}

// Q4_0: f16 d, 16 bytes of nibbles (byte j: values j and j + 16)
struct mmvq_q4_0 {
    static constexpr int qk = 32, qi = 4, vdr = 2;
    static __device__ __forceinline__ float vec_dot(const ggx_u8 * bx, const ggx_block_q8_1 * by, const int iqs) {
        const int sumi = mmvq_nibble_dot<false>(bx + 2, by, iqs);
        // -8 per quant: each of the qi / vdr threads of a block subtracts its share of 8 * s
        return ggx_f16_at(bx) * ((float) sumi * ggx_f16_to_f32(by->d) - (8.0f * vdr / qi) * ggx_f16_to_f32(by->s));
    }
};

// Q4_1: f16 d, f16 m, 16 bytes of nibbles
struct mmvq_q4_1 {
    static constexpr int qk = 32, qi = 4, vdr = 2;
    static __device__ __forceinline__ float vec_dot(const ggx_u8 * bx, const ggx_block_q8_1 * by, const int iqs) {
        const int sumi = mmvq_nibble_dot<true>(bx + 4, by, iqs);
        const float d = ggx_f16_at(bx) * ggx_f16_to_f32(by->d);
        const float ms = ggx_f16_at(bx + 2) * ggx_f16_to_f32(by->s);
        return (float) sumi * d + ms * ((float) vdr / qi);
    }
};

// Q5_0: f16 d, 4 bytes qh (bit j: bit 4 of value j), 16 bytes of nibbles
struct mmvq_q5_0 {
    static constexpr int qk = 32, qi = 4, vdr = 2;
    static __device__ __forceinline__ float vec_dot(const ggx_u8 * bx, const ggx_block_q8_1 * by, const int iqs) {
        const int qh = ggx_int_b2(bx + 2, 0);
        int sumi = 0;
#pragma unroll
        for (int i = 0; i < vdr; ++i) {
            const int v = ggx_int_b2(bx + 6, iqs + i);
            const int h = qh >> (4 * (iqs + i));  // the fifth bits of values 4 (iqs + i) .. + 3, then + 16
            int v0 = v & 0x0F0F0F0F;
            v0 |= (h << 4) & 0x00000010;
            v0 |= (h << 11) & 0x00001000;
            v0 |= (h << 18) & 0x00100000;
            v0 |= (h << 25) & 0x10000000;
            int v1 = (v >> 4) & 0x0F0F0F0F;
            v1 |= (h >> 12) & 0x00000010;
            v1 |= (h >> 5) & 0x00001000;
            v1 |= (h << 2) & 0x00100000;
            v1 |= (h << 9) & 0x10000000;
            sumi = ggx_dp4a(v0, by->qs[iqs + i], sumi);
            sumi = ggx_dp4a(v1, by->qs[iqs + i + qi], sumi);
        }
        return ggx_f16_at(bx) * ((float) sumi * ggx_f16_to_f32(by->d) - (16.0f * vdr / qi) * ggx_f16_to_f32(by->s));
    }
};

// Q8_0: f16 d, 32 x i8
struct mmvq_q8_0 {
    static constexpr int qk = 32, qi = 8, vdr = 2;
    static __device__ __forceinline__ float vec_dot(const ggx_u8 * bx, const ggx_block_q8_1 * by, const int iqs) {
        int sumi = 0;
#pragma unroll
        for (int i = 0; i < vdr; ++i) {
            sumi = ggx_dp4a(ggx_int_b2(bx + 2, iqs + i), by->qs[iqs + i], sumi);
        }
        return ggx_f16_at(bx) * ggx_f16_to_f32(by->d) * (float) sumi;
    }
};

// The 6-bit scales and mins of a Q4_K / Q5_K super-block's sub-blocks 2g and 2g + 1 (get_scale_min_k4
// for a pair, read 16 bits at a time): sc[0..1] scales, sc[2..3] mins
static __device__ __forceinline__ void mmvq_k_scales(const ggx_u8 * scales, const int g, ggx_u8 sc[4]) {
    const unsigned short * s = (const unsigned short *) scales;
    unsigned short aux[2];
    if (g < 2) {
        aux[0] = s[g] & 0x3f3f;
        aux[1] = s[g + 2] & 0x3f3f;
    } else {
        aux[0] = ((s[g + 2] >> 0) & 0x0f0f) | ((s[g - 2] & 0xc0c0) >> 2);
        aux[1] = ((s[g + 2] >> 4) & 0x0f0f) | ((s[g] & 0xc0c0) >> 2);
    }
    sc[0] = aux[0] & 0xff;
    sc[1] = aux[0] >> 8;
    sc[2] = aux[1] & 0xff;
    sc[3] = aux[1] >> 8;
}

// Q4_K / Q5_K, 16 threads per super-block: thread iqs (0, 2, .., 30) takes 64-value group
// g = iqs / 8 (sub-blocks 2g, 2g + 1: q8_1 blocks 2g, 2g + 1) and in it the values l = 4k..4k+3 and
// 16+4k..16+4k+3 of both sub-blocks, k = (iqs / 2) % 4. QH: Q5_K (the fifth bits at byte 16).
template <bool QH>
struct mmvq_k_min {
    static constexpr int qk = 256, qi = 32, vdr = 2;
    static __device__ __forceinline__ float vec_dot(const ggx_u8 * bx, const ggx_block_q8_1 * by, const int iqs) {
        const int g = iqs / 8;
        const int k = (iqs / 2) % 4;
        const ggx_u8 * qs = bx + (QH ? 48 : 16) + 32 * g;
        const int v[2] = {ggx_int_b4(qs, k), ggx_int_b4(qs, k + 4)};
        int h[2] = {0, 0};
        if (QH) {
            h[0] = ggx_int_b4(bx + 16, k) >> (2 * g);
            h[1] = ggx_int_b4(bx + 16, k + 4) >> (2 * g);
        }
        ggx_u8 sc[4];
        mmvq_k_scales(bx + 4, g, sc);
        float sum_d = 0.0f;
        float sum_m = 0.0f;
#pragma unroll
        for (int i = 0; i < 2; ++i) {  // sub-block 2g + i: low nibbles, then high ones
            const ggx_block_q8_1 * b8 = by + 2 * g + i;
            int v0 = (v[0] >> (4 * i)) & 0x0F0F0F0F;
            int v1 = (v[1] >> (4 * i)) & 0x0F0F0F0F;
            if (QH) {
                v0 |= ((h[0] >> i) << 4) & 0x10101010;
                v1 |= ((h[1] >> i) << 4) & 0x10101010;
            }
            const int dot = ggx_dp4a(v1, b8->qs[k + 4], ggx_dp4a(v0, b8->qs[k], 0));
            const int sum_u = ggx_dp4a(0x01010101, b8->qs[k + 4], ggx_dp4a(0x01010101, b8->qs[k], 0));
            const float d8 = ggx_f16_to_f32(b8->d);
            sum_d += d8 * (float) (dot * sc[i]);
            sum_m += d8 * (float) (sum_u * sc[2 + i]);
        }
        return ggx_f16_at(bx) * sum_d - ggx_f16_at(bx + 2) * sum_m;
    }
};

struct mmvq_q4_K : mmvq_k_min<false> {};
struct mmvq_q5_K : mmvq_k_min<true> {};

// Q6_K, 32 threads per super-block (ggml's index math): thread iqs reads int iqs of ql, the two
// bits per value it needs from qh, and two scales; its values meet q8_1 blocks bq8 and bq8 + 2.
struct mmvq_q6_K {
    static constexpr int qk = 256, qi = 32, vdr = 1;
    static __device__ __forceinline__ float vec_dot(const ggx_u8 * bx, const ggx_block_q8_1 * by, const int iqs) {
        const int half = iqs / 16;
        const int bq8 = 4 * half + (iqs % 16) / 8;
        const int scale0 = 8 * half + (iqs % 16) / 4;
        const int vh_shift = 2 * ((iqs % 16) / 8);
        const int vl = ggx_int_b2(bx, iqs);
        const int vh = ggx_int_b2(bx + 128, 8 * half + iqs % 8) >> vh_shift;
        const signed char * scales = (const signed char *) (bx + 192) + scale0;
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const ggx_block_q8_1 * b8 = by + bq8 + 2 * i;
            const int vil = (vl >> (4 * i)) & 0x0F0F0F0F;
            const int vih = ((vh >> (4 * i)) << 4) & 0x30303030;
            const int vi = ggx_vsub4(vil | vih, 0x20202020);  // q - 32 per byte
            sum += ggx_f16_to_f32(b8->d) * (float) (ggx_dp4a(vi, b8->qs[iqs % 8], 0) * scales[4 * i]);
        }
        return ggx_f16_at(bx + 208) * sum;
    }
};

// ---------------------------------------------------------------- the kernel
template <typename T, int NCOLS, int NWARPS, int RPB>
__global__ void __launch_bounds__(NWARPS * GGX_WARP, 1) k_mul_mat_vec_q(const ggx_u8 * x, const ggx_block_q8_1 * y,
        float * dst, const int blocks_per_row, const int nrows, const int block_bytes, const ggx_i64 stride_row_x,
        const ggx_i64 stride_col_y, const ggx_i64 stride_col_dst, const int channel_ratio,
        const ggx_i64 stride_channel_x, const ggx_i64 stride_channel_y, const ggx_i64 stride_channel_dst,
        const int sample_ratio, const ggx_i64 stride_sample_x, const ggx_i64 stride_sample_y,
        const ggx_i64 stride_sample_dst) {
    constexpr int threads_per_block = T::qi / T::vdr;
    constexpr int blocks_per_iter = NWARPS * GGX_WARP / threads_per_block;
    const int tid = GGX_WARP * threadIdx.y + threadIdx.x;
    const int row0 = RPB * blockIdx.x;
    const int channel = blockIdx.y;
    const int sample = blockIdx.z;

    const ggx_u8 * xs = x + (ggx_i64) (sample / sample_ratio) * stride_sample_x
                          + (ggx_i64) (channel / channel_ratio) * stride_channel_x;
    const ggx_block_q8_1 * ys = y + sample * stride_sample_y + channel * stride_channel_y;
    const ggx_u8 * rows[RPB];
#pragma unroll
    for (int i = 0; i < RPB; ++i) {
        rows[i] = xs + (ggx_i64) min(row0 + i, nrows - 1) * stride_row_x;
    }

    float tmp[NCOLS][RPB];
#pragma unroll
    for (int j = 0; j < NCOLS; ++j) {
#pragma unroll
        for (int i = 0; i < RPB; ++i) {
            tmp[j][i] = 0.0f;
        }
    }
    const int kqs = T::vdr * (tid % threads_per_block);
    for (int kbx = tid / threads_per_block; kbx < blocks_per_row; kbx += blocks_per_iter) {
        const int kby = kbx * (T::qk / 32);
#pragma unroll
        for (int j = 0; j < NCOLS; ++j) {
#pragma unroll
            for (int i = 0; i < RPB; ++i) {
                tmp[j][i] += T::vec_dot(rows[i] + (ggx_i64) kbx * block_bytes, ys + j * stride_col_y + kby, kqs);
            }
        }
    }

    __shared__ float tmp_shared[NWARPS > 1 ? NWARPS - 1 : 1][NCOLS][RPB][GGX_WARP];
    if (threadIdx.y > 0) {
#pragma unroll
        for (int j = 0; j < NCOLS; ++j) {
#pragma unroll
            for (int i = 0; i < RPB; ++i) {
                tmp_shared[threadIdx.y - 1][j][i][threadIdx.x] = tmp[j][i];
            }
        }
    }
    __syncthreads();
    if (threadIdx.y > 0) {
        return;
    }
    float * out = dst + sample * stride_sample_dst + channel * stride_channel_dst + row0;
#pragma unroll
    for (int j = 0; j < NCOLS; ++j) {
        float mine = 0.0f;
#pragma unroll
        for (int i = 0; i < RPB; ++i) {
#pragma unroll
            for (int w = 0; w < NWARPS - 1; ++w) {
                tmp[j][i] += tmp_shared[w][j][i][threadIdx.x];
            }
            tmp[j][i] = ggx_warp_sum(tmp[j][i]);
            if (i == (int) threadIdx.x) {
                mine = tmp[j][i];
            }
        }
        if ((int) threadIdx.x < RPB && row0 + (int) threadIdx.x < nrows) {
            out[j * stride_col_dst + threadIdx.x] = mine;
        }
    }
}
