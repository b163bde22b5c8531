// MMQ (ggml-cuda's mul_mat_q, mmq.cuh): quantized weights times many activation columns quantized
// to block_q8_1_mmq (quantize.cu), as tiles of int8 in shared memory.
//
//   k_mul_mat_q<T, JMAX>   dst tiles of MMQ_I rows x J columns, J <= JMAX a multiple of 8 (ggml
//       instantiates every J; ggx one kernel per power of two from 16, J a launch argument: the
//       same tiles from 4 instead of 16 instantiations per type). Work unit: one MMQ_ITER_K (256)
//       slice of K of one tile; the units of all tiles (tile t = (z * ntx + jt) * nty + it: rows
//       fastest, z the channel) are split evenly over the grid's blocks (stream-K, ggml's
//       decomposition): block b takes units [b * total / nblocks, (b + 1) * total / nblocks). A
//       tile the block finishes goes to dst (plus, by k_mmq_fixup, what earlier blocks did of it);
//       the unfinished tile its range ends in goes to fixup[b]. With nblocks = tiles every block
//       does whole tiles and no fixup runs (ggml's choice when the tiling is >= 90 % efficient).
//       Per unit: the weight tile (MMQ_I rows x 256 values) is unpacked by T::load32 into int8
//       quants, a float scale per 16 values and a float min per 32 (the term q8_1's sum s
//       multiplies: Q4_0's -8 d, Q4_1's m, Q4_K / Q5_K's -dmin m); the activation tile (J columns
//       x 256 values) is copied with its per-32 d (and s). Products, per compiled architecture
//       (MMQ_MMA, as ggml picks its data layout by __CUDA_ARCH__): from sm_80 int8 mma.sync m16n8k16
//       (warp w: rows 16 w.. + 15, all J columns in n8 tiles), before it __dp4a over 16-value
//       groups (thread: rows lane + 32 i, columns warp + 8 j); each group's int32 sums scaled by the
//       weight's and the activation's scale.
//       MUL_MAT_ID (bounds not null): the activations are grouped by expert (mmid.cu): channel z
//       is expert z, its columns are bounds[z] .. bounds[z + 1] of the grouped y (one channel), and
//       column c of them goes to dst column ids_dst[c]; a column tile past an expert's columns
//       is empty and skipped (the tiles per expert cover the most an expert can get).
//   k_mmq_fixup   adds the partial tiles in fixup of the blocks before b that worked on the tile b
//       finished (one launch block per stream-K block; nothing to do for most).
//
// Shared memory (dynamic): x quants [MMQ_I][68 ints] (256 int8 + padding), x scales [MMQ_I][17],
// x mins [MMQ_I][9], y quants [J][68], y d [J][8], y s [J][8]. Weight rows past nrows read the
// last row and are not written; values past K are zero (the activations are zero-padded there).

#include "q8_1.cuh"

#ifndef GGX_HOST_EMU
#define mmq_dp4a __dp4a
#define mmq_vsub4 __vsubss4
#define MMQ_SHARED(T, name) extern __shared__ T name[]
#define MMQ_MMA (__CUDA_ARCH__ >= 800)
#else  // the host build runs either path: the architecture the test emulates
#define mmq_dp4a hc_dp4a
#define mmq_vsub4 hc_vsubss4
#define MMQ_SHARED(T, name) T * name = (T *) hc_dynamic_shared()
#define MMQ_MMA (hc_cuda_arch >= 800)
#endif

#define MMQ_I 128
#define MMQ_NWARPS 8
#define MMQ_ITER_K 256
#define MMQ_XQ 68  // ints per weight row of the tile: 64 + padding (row starts 4 banks apart)
#define MMQ_XD 17
#define MMQ_XM 9
#define MMQ_YQ 68

// ---------------------------------------------------------------- weights: 32 values at a time
// load32(row, g, q, d0, d1, m): values 32 g .. 32 g + 31 of a row as 8 ints of int8 quants q, the
// scales of their two halves, and the min term per 32 (0 where the type has none: DS4 false).

// the 32 nibbles at qs (byte j: values j and j + 16) as 8 ints of int8 values 0..15; B4: the bytes
// are 4-byte aligned (Q4_1), else 2-byte (Q4_0)
template <bool B4>
static __device__ __forceinline__ void mmq_nibbles(const ggx_u8 * qs, int * q) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int v = B4 ? ggx_int_b4(qs, i) : ggx_int_b2(qs, i);
        q[i] = v & 0x0F0F0F0F;
        q[i + 4] = (v >> 4) & 0x0F0F0F0F;
    }
}

// Q4_0: q = nibble, min -8 d
struct mmq_q4_0 {
    static constexpr int qk = 32, ts = 18;
    static constexpr bool ds4 = true;
    static __device__ __forceinline__ void load32(const ggx_u8 * row, const int g, int * q, float & d0, float & d1,
                                                  float & m) {
        const ggx_u8 * b = row + (ggx_i64) g * ts;
        mmq_nibbles<false>(b + 2, q);
        d0 = d1 = ggx_f16_at(b);
        m = -8.0f * d0;
    }
};

// Q4_1: q = nibble, min m
struct mmq_q4_1 {
    static constexpr int qk = 32, ts = 20;
    static constexpr bool ds4 = true;
    static __device__ __forceinline__ void load32(const ggx_u8 * row, const int g, int * q, float & d0, float & d1,
                                                  float & m) {
        const ggx_u8 * b = row + (ggx_i64) g * ts;
        mmq_nibbles<true>(b + 4, q);
        d0 = d1 = ggx_f16_at(b);
        m = ggx_f16_at(b + 2);
    }
};

// bit 4 of four consecutive values (the low 4 bits of h) moved to bit 4 of each byte
static __device__ __forceinline__ int mmq_spread4(const int h) {
    return ((h << 4) & 0x00000010) | ((h << 11) & 0x00001000) | ((h << 18) & 0x00100000) | ((h << 25) & 0x10000000);
}

// Q5_0: q = (nibble | fifth bit) - 16, no min
struct mmq_q5_0 {
    static constexpr int qk = 32, ts = 22;
    static constexpr bool ds4 = false;
    static __device__ __forceinline__ void load32(const ggx_u8 * row, const int g, int * q, float & d0, float & d1,
                                                  float & m) {
        const ggx_u8 * b = row + (ggx_i64) g * ts;
        const int qh = ggx_int_b2(b + 2, 0);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int v = ggx_int_b2(b + 6, i);
            q[i] = mmq_vsub4((v & 0x0F0F0F0F) | mmq_spread4(qh >> (4 * i)), 0x10101010);
            q[i + 4] = mmq_vsub4(((v >> 4) & 0x0F0F0F0F) | mmq_spread4(qh >> (16 + 4 * i)), 0x10101010);
        }
        d0 = d1 = ggx_f16_at(b);
        m = 0.0f;
    }
};

// Q8_0: q as stored
struct mmq_q8_0 {
    static constexpr int qk = 32, ts = 34;
    static constexpr bool ds4 = false;
    static __device__ __forceinline__ void load32(const ggx_u8 * row, const int g, int * q, float & d0, float & d1,
                                                  float & m) {
        const ggx_u8 * b = row + (ggx_i64) g * ts;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            q[i] = ggx_int_b2(b + 2, i);
        }
        d0 = d1 = ggx_f16_at(b);
        m = 0.0f;
    }
};

// Q4_K / Q5_K: sub-block s of a super-block, q = nibble (| fifth bit: bit s of qh[l]),
// scale d * sc, min -dmin * m (the 6-bit pair of get_scale_min_k4)
template <bool QH>
struct mmq_k_min {
    static constexpr int qk = 256, ts = QH ? 176 : 144;
    static constexpr bool ds4 = true;
    static __device__ __forceinline__ void load32(const ggx_u8 * row, const int g, int * q, float & d0, float & d1,
                                                  float & m) {
        const ggx_u8 * b = row + (ggx_i64) (g / 8) * ts;
        const int s = g % 8;
        const ggx_u8 * qs = b + (QH ? 48 : 16) + 32 * (s / 2);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            int v = (ggx_int_b4(qs, i) >> (4 * (s % 2))) & 0x0F0F0F0F;
            if (QH) {
                v |= ((ggx_int_b4(b + 16, i) >> s) & 0x01010101) << 4;
            }
            q[i] = v;
        }
        int sc, mn;
        ggx_q4_K::scale_min(b, s, sc, mn);
        d0 = d1 = ggx_f16_at(b) * (float) sc;
        m = -ggx_f16_at(b + 2) * (float) mn;
    }
};

struct mmq_q4_K : mmq_k_min<false> {};
struct mmq_q5_K : mmq_k_min<true> {};

// Q6_K: sub-block s = 4 n + c (half n, quarter c): low nibbles from ql, two bits from qh, -32;
// a scale per 16 values
struct mmq_q6_K {
    static constexpr int qk = 256, ts = 210;
    static constexpr bool ds4 = false;
    static __device__ __forceinline__ void load32(const ggx_u8 * row, const int g, int * q, float & d0, float & d1,
                                                  float & m) {
        const ggx_u8 * b = row + (ggx_i64) (g / 8) * ts;
        const int s = g % 8;
        const int n = s / 4;
        const int c = s % 4;
        const ggx_u8 * ql = b + 64 * n + 32 * (c % 2);
        const ggx_u8 * qh = b + 128 + 32 * n;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int lo = (ggx_int_b2(ql, i) >> (4 * (c / 2))) & 0x0F0F0F0F;
            const int hi = ((ggx_int_b2(qh, i) >> (2 * c)) & 0x03030303) << 4;
            q[i] = mmq_vsub4(lo | hi, 0x20202020);
        }
        const float d = ggx_f16_at(b + 208);
        const signed char * sc = (const signed char *) (b + 192);
        d0 = d * (float) sc[2 * s];
        d1 = d * (float) sc[2 * s + 1];
        m = 0.0f;
    }
};

// ---------------------------------------------------------------- MMA
// D += A B for one 16 x 8 output tile from a 16 x 16 int8 A and a 16 x 8 int8 B (PTX's fragments:
// see the host twin in tests/host_cuda_shim.h). The real instruction is compile-checked only.
static __device__ __forceinline__ void mmq_mma(int & d0, int & d1, int & d2, int & d3, const int a0, const int a1,
                                               const int b0) {
#ifdef GGX_HOST_EMU
    hc_mma_m16n8k16_s8(d0, d1, d2, d3, a0, a1, b0);
#elif __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};"
                 : "+r"(d0), "+r"(d1), "+r"(d2), "+r"(d3)
                 : "r"(a0), "r"(a1), "r"(b0));
#else
    __trap();  // the planner picks MMA only from compute capability 8.0
#endif
}

// ---------------------------------------------------------------- the kernel
// A thread's JMAX / 2 accumulators: MMA, [n8 tile nt][fragment element e] at 4 nt + e; dp4a,
// [row lane + 32 a][column warp + 8 e] at a * JMAX / 8 + e. The (row, column) in the tile of one:
template <int JMAX>
static __device__ __forceinline__ void mmq_pos(const int k, int & i, int & j) {
    const int lane = threadIdx.x;
    const int warp = threadIdx.y;
    if (MMQ_MMA) {
        i = 16 * warp + lane / 4 + 8 * ((k % 4) / 2);
        j = 8 * (k / 4) + 2 * (lane % 4) + k % 2;
    } else {
        i = lane + GGX_WARP * (k / (JMAX / 8));
        j = warp + MMQ_NWARPS * (k % (JMAX / 8));
    }
}

// The columns of tile (z, column tile starting at col0): the first one's index in y's channel
// (ycol0), how many there are (0: an empty tile), and where column j of them goes in dst.
struct mmq_cols {
    int ycol0;
    int n;
    const int * ids_dst;  // MUL_MAT_ID: dst column of y column c; null: col0 + j

    static __device__ __forceinline__ mmq_cols of(const int * bounds, const int * ids_dst, const int z,
                                                  const int col0, const int J, const int ncols) {
        if (bounds) {
            const int c0 = bounds[z] + col0;
            return {c0, min(J, bounds[z + 1] - c0), ids_dst};
        }
        return {col0, min(J, ncols - col0), nullptr};
    }
    __device__ __forceinline__ int dst_col(const int j) const { return ids_dst ? ids_dst[ycol0 + j] : ycol0 + j; }
};

template <typename T, int JMAX>
__global__ void __launch_bounds__(MMQ_NWARPS * GGX_WARP, 1) k_mul_mat_q(const ggx_u8 * x,
        const ggx_block_q8_1_mmq * y, float * dst, float * fixup, const int * ids_dst, const int * bounds,
        const int J, const int K, const int nrows, const int ncols,
        const ggx_i64 stride_row_x, const int nty, const int ntx, const int ne12, const int channel_ratio,
        const int sample_ratio, const ggx_i64 stride_channel_x, const ggx_i64 stride_sample_x,
        const ggx_i64 stride_col_dst, const ggx_i64 stride_channel_dst, const ggx_i64 stride_sample_dst,
        const ggx_i64 total) {
    static_assert(JMAX % 8 == 0 && JMAX <= 128, "JMAX");
    MMQ_SHARED(int, smem);
    int * xq = smem;
    float * xd = (float *) (xq + MMQ_I * MMQ_XQ);
    float * xm = xd + MMQ_I * MMQ_XD;
    int * yq = (int *) (xm + MMQ_I * MMQ_XM);
    float * yd = (float *) (yq + J * MMQ_YQ);
    float * ys = yd + J * 8;

    const int tid = threadIdx.x + GGX_WARP * threadIdx.y;
    const int ipt = (K + MMQ_ITER_K - 1) / MMQ_ITER_K;  // units per tile
    const int nkb = 2 * ipt;  // block_q8_1_mmq per column and channel
    ggx_i64 kbc = (ggx_i64) blockIdx.x * total / gridDim.x;
    const ggx_i64 kbc_stop = (ggx_i64) (blockIdx.x + 1) * total / gridDim.x;

    while (kbc < kbc_stop) {
        const ggx_i64 tile = kbc / ipt;
        const int k0 = (int) (kbc % ipt);
        const int k1 = (int) min((ggx_i64) ipt, k0 + (kbc_stop - kbc));
        const int row0 = (int) (tile % nty) * MMQ_I;
        const int col0 = (int) ((tile / nty) % ntx) * J;
        const int z = (int) (tile / ((ggx_i64) nty * ntx));
        const int i2 = z % ne12;
        const int i3 = z / ne12;
        const mmq_cols cols = mmq_cols::of(bounds, ids_dst, z, col0, J, ncols);
        if (cols.n <= 0) {  // an expert with fewer columns (the same for every thread)
            kbc += k1 - k0;
            continue;
        }
        const ggx_u8 * xs = x + (ggx_i64) (i3 / sample_ratio) * stride_sample_x
                              + (ggx_i64) (i2 / channel_ratio) * stride_channel_x;

        float acc[JMAX / 2];
#pragma unroll
        for (int k = 0; k < JMAX / 2; ++k) {
            acc[k] = 0.0f;
        }

        for (int it = k0; it < k1; ++it) {
            __syncthreads();  // the previous unit is done with the tiles
            for (int task = tid; task < MMQ_I * 8; task += MMQ_NWARPS * GGX_WARP) {
                const int r = task / 8;
                const int s = task % 8;
                const int g = it * 8 + s;
                int * q = xq + r * MMQ_XQ + s * 8;
                float d0 = 0.0f, d1 = 0.0f, m = 0.0f;
                if (32 * g < K) {
                    T::load32(xs + (ggx_i64) min(row0 + r, nrows - 1) * stride_row_x, g, q, d0, d1, m);
                } else {
#pragma unroll
                    for (int l = 0; l < 8; ++l) {
                        q[l] = 0;
                    }
                }
                xd[r * MMQ_XD + 2 * s] = d0;
                xd[r * MMQ_XD + 2 * s + 1] = d1;
                xm[r * MMQ_XM + s] = m;
            }
            // y's channel z (MUL_MAT_ID: its only one), blocks 2 it and 2 it + 1 of the tile's columns
            const ggx_block_q8_1_mmq * yb = y + ((ggx_i64) (bounds ? 0 : z) * nkb + 2 * it) * ncols + cols.ycol0;
            for (int e = tid; e < J * 64; e += MMQ_NWARPS * GGX_WARP) {
                const int j = e / 64;
                const int t = e % 64;
                yq[j * MMQ_YQ + t] = j < cols.n ? yb[(t / 32) * ncols + j].qs[t % 32] : 0;
            }
            for (int e = tid; e < J * 8; e += MMQ_NWARPS * GGX_WARP) {
                const int j = e / 8;
                const int g = e % 8;
                const unsigned int h = j < cols.n ? yb[(g / 4) * ncols + j].ds[g % 4] : 0u;
                yd[j * 8 + g] = T::ds4 ? ggx_ds_d(h) : __uint_as_float(h);
                ys[j * 8 + g] = T::ds4 ? ggx_ds_s(h) : 0.0f;
            }
            __syncthreads();

            if (MMQ_MMA) {
                const int lane = threadIdx.x;
                const int ia = 16 * threadIdx.y + lane / 4;
#pragma unroll 1
                for (int g = 0; g < 16; ++g) {
                    const int a0 = xq[ia * MMQ_XQ + 4 * g + lane % 4];
                    const int a1 = xq[(ia + 8) * MMQ_XQ + 4 * g + lane % 4];
                    const float da = xd[ia * MMQ_XD + g];
                    const float db = xd[(ia + 8) * MMQ_XD + g];
#pragma unroll
                    for (int nt = 0; nt < JMAX / 8; ++nt) {
                        if (nt >= J / 8) {
                            break;
                        }
                        int c[4] = {0, 0, 0, 0};
                        mmq_mma(c[0], c[1], c[2], c[3], a0, a1, yq[(8 * nt + lane / 4) * MMQ_YQ + 4 * g + lane % 4]);
                        const int j = 8 * nt + 2 * (lane % 4);
                        const float dy0 = yd[j * 8 + g / 2];
                        const float dy1 = yd[(j + 1) * 8 + g / 2];
                        acc[4 * nt + 0] += da * dy0 * (float) c[0];
                        acc[4 * nt + 1] += da * dy1 * (float) c[1];
                        acc[4 * nt + 2] += db * dy0 * (float) c[2];
                        acc[4 * nt + 3] += db * dy1 * (float) c[3];
                    }
                }
                if (T::ds4) {
#pragma unroll
                    for (int s = 0; s < 8; ++s) {
                        const float ma = xm[ia * MMQ_XM + s];
                        const float mb = xm[(ia + 8) * MMQ_XM + s];
#pragma unroll
                        for (int nt = 0; nt < JMAX / 8; ++nt) {
                            if (nt >= J / 8) {
                                break;
                            }
                            const int j = 8 * nt + 2 * (lane % 4);
                            acc[4 * nt + 0] += ma * ys[j * 8 + s];
                            acc[4 * nt + 1] += ma * ys[(j + 1) * 8 + s];
                            acc[4 * nt + 2] += mb * ys[j * 8 + s];
                            acc[4 * nt + 3] += mb * ys[(j + 1) * 8 + s];
                        }
                    }
                }
            } else {
#pragma unroll 1
                for (int g = 0; g < 16; ++g) {
#pragma unroll
                    for (int a = 0; a < MMQ_I / GGX_WARP; ++a) {
                        const int i = threadIdx.x + GGX_WARP * a;
                        const int * xi = xq + i * MMQ_XQ + 4 * g;
                        const float dx = xd[i * MMQ_XD + g];
#pragma unroll
                        for (int e = 0; e < JMAX / MMQ_NWARPS; ++e) {
                            const int j = threadIdx.y + MMQ_NWARPS * e;
                            if (j >= J) {
                                break;
                            }
                            const int * yi = yq + j * MMQ_YQ + 4 * g;
                            int sum = mmq_dp4a(xi[0], yi[0], 0);
                            sum = mmq_dp4a(xi[1], yi[1], sum);
                            sum = mmq_dp4a(xi[2], yi[2], sum);
                            sum = mmq_dp4a(xi[3], yi[3], sum);
                            acc[a * (JMAX / 8) + e] += dx * yd[j * 8 + g / 2] * (float) sum;
                        }
                    }
                }
                if (T::ds4) {
#pragma unroll
                    for (int s = 0; s < 8; ++s) {
#pragma unroll
                        for (int a = 0; a < MMQ_I / GGX_WARP; ++a) {
                            const float mx = xm[(threadIdx.x + GGX_WARP * a) * MMQ_XM + s];
#pragma unroll
                            for (int e = 0; e < JMAX / MMQ_NWARPS; ++e) {
                                if (threadIdx.y + MMQ_NWARPS * e >= J) {
                                    break;
                                }
                                acc[a * (JMAX / 8) + e] += mx * ys[(threadIdx.y + MMQ_NWARPS * e) * 8 + s];
                            }
                        }
                    }
                }
            }
        }

        // a finished tile to dst, the unfinished last one to this block's fixup slot
        const bool finished = k1 == ipt;
        float * out = bounds ? dst : dst + (ggx_i64) i3 * stride_sample_dst + (ggx_i64) i2 * stride_channel_dst;
        float * part = fixup + (ggx_i64) blockIdx.x * MMQ_I * J;
#pragma unroll
        for (int k = 0; k < JMAX / 2; ++k) {
            int i, j;
            mmq_pos<JMAX>(k, i, j);
            if (j >= J) {
                continue;
            }
            if (!finished) {
                part[j * MMQ_I + i] = acc[k];
            } else if (row0 + i < nrows && j < cols.n) {
                out[(ggx_i64) cols.dst_col(j) * stride_col_dst + row0 + i] = acc[k];
            }
        }
        kbc += k1 - k0;
    }
}

// grid: the stream-K blocks; block b adds to the tile it finished (if it did not start it) the
// partial tiles the blocks before it left in fixup for that tile
__global__ void __launch_bounds__(MMQ_NWARPS * GGX_WARP) k_mmq_fixup(const float * fixup, float * dst,
        const int * ids_dst, const int * bounds, const int K, const int J, const int nrows, const int ncols,
        const int nty, const int ntx, const int ne12, const ggx_i64 stride_col_dst, const ggx_i64 stride_channel_dst,
        const ggx_i64 stride_sample_dst, const ggx_i64 total) {
    const ggx_i64 ipt = (K + MMQ_ITER_K - 1) / MMQ_ITER_K;
    const ggx_i64 b = blockIdx.x;
    const ggx_i64 kbc = b * total / gridDim.x;
    const ggx_i64 kbc_stop = (b + 1) * total / gridDim.x;
    const ggx_i64 tile = kbc / ipt;
    if (kbc == kbc_stop || kbc % ipt == 0 || kbc_stop < (tile + 1) * ipt) {
        return;  // no work, or its first tile is whole, or it does not finish it
    }
    const int row0 = (int) (tile % nty) * MMQ_I;
    const int col0 = (int) ((tile / nty) % ntx) * J;
    const int z = (int) (tile / ((ggx_i64) nty * ntx));
    const mmq_cols cols = mmq_cols::of(bounds, ids_dst, z, col0, J, ncols);
    float * out = bounds ? dst : dst + (ggx_i64) (z / ne12) * stride_sample_dst + (ggx_i64) (z % ne12) * stride_channel_dst;
    for (int e = threadIdx.x; e < MMQ_I * J; e += blockDim.x) {
        const int i = e % MMQ_I;
        const int j = e / MMQ_I;
        if (row0 + i >= nrows || j >= cols.n) {
            continue;
        }
        float sum = 0.0f;
        for (ggx_i64 bp = b - 1; bp >= 0; --bp) {
            const ggx_i64 start = bp * total / gridDim.x;
            const ggx_i64 stop = (bp + 1) * total / gridDim.x;
            if (stop == start) {
                continue;  // an empty range
            }
            if ((stop - 1) / ipt != tile) {
                break;  // its last unit is in an earlier tile
            }
            sum += fixup[bp * MMQ_I * J + e];
            if (start <= tile * ipt) {
                break;  // it started the tile
            }
        }
        out[(ggx_i64) cols.dst_col(j) * stride_col_dst + row0 + i] += sum;
    }
}
