// FLASH_ATTN_EXT for K/V of one type KT (F16 instantiated; ggml-cuda's fattn-vec.cuh,
// fattn-tile.cuh and fattn-common.cuh's combine kernel, written for ggx):
//
//   out[:, h, t, b] = sum_j softmax_j(s_j) v[:, j, h / gqa, b / r3]
//   s_j = softcap * tanh(scale' * q . k_j) with scale' = scale / softcap   (softcap != 0)
//         scale * q . k_j                                                  (softcap == 0)
//         + slope(h) * mask[j, t, b % mask_ne3]                            (with a mask: one plane
//                                                                          over heads, ggml's rule)
//
//   k_fattn_vec<D, NCOLS, KT>   1 or 2 query rows t0.. of one head (blockIdx.x: row tile, .z: head
//       h + H * b), FA_VEC_THREADS threads. The keys go in chunks of FA_VEC_CHUNK; block y of
//       gridDim.y (the parallel blocks) takes chunks y, y + gridDim.y, ... Scores: 8 lanes per key
//       (lane group g of a warp takes key 4 * step + g), each lane a strided quarter-pair of the
//       head, reduced by shuffles within the 8; then the chunk's max per row over the block, the
//       running max M and each thread's share of the running sum S (M is block-uniform, so the
//       shares add up at the end), the weights exp(s - M) in shared memory, and each thread
//       accumulates its output dims d = tid, tid + FA_VEC_THREADS over the chunk's value rows.
//       One parallel block writes the normalized row; several write their unnormalized rows to
//       `parts` and (M, S) to `meta` for k_fattn_combine.
//   k_fattn_tile<D, KT>   FA_TILE_NCOLS query rows of one head, FA_TILE_THREADS threads: Q (scaled)
//       and a chunk of FA_TILE_KB key rows staged in shared memory as float, the score tile
//       (rows x keys) computed from shared memory, per-row online softmax by one warp per two rows,
//       then the chunk's value rows staged in the same buffer and each thread accumulating
//       (row, dim) pairs. Every K/V row is read once per tile of rows.
//   k_fattn_combine   parts and meta of P parallel blocks -> out: sum_l exp(M_l - M) parts_l /
//       sum_l exp(M_l - M) S_l with M = max_l M_l (blocks that saw only masked keys have M_l = -inf
//       and add nothing).
//
// ggml's semantics: a key at -inf is skipped (weight 0), a row whose every key is masked is 0,
// a NaN score makes the row NaN. q (F32), k, v, mask (F16) by byte strides (rows contiguous); out
// and parts contiguous: row r = (b * T + t) * H + h of out [D, H, T, B].

#include "common.cuh"

#define FA_VEC_THREADS 128
#define FA_VEC_WARPS (FA_VEC_THREADS / GGX_WARP)
#define FA_VEC_CHUNK FA_VEC_THREADS
#define FA_VEC_LANES_KQ 8
#define FA_TILE_NCOLS 16
#define FA_TILE_THREADS 256
#define FA_TILE_WARPS (FA_TILE_THREADS / GGX_WARP)

// the score of raw dot product `dot` (Q already scaled) for key j of a query row
static __device__ __forceinline__ float fattn_score(float dot, const float softcap, const __half * mrow, const int j,
                                                    const float slope) {
    if (softcap != 0.0f) {
        dot = softcap * tanhf(dot);
    }
    if (mrow) {
        dot += slope * __half2float(mrow[j]);
    }
    return dot;
}

// A chunk's new running max and its rescale factor for the old sums: (M', exp(M - M')); a max that
// is still -inf (every key so far masked) leaves the sums as they are
static __device__ __forceinline__ float fattn_rescale(float & M, const float chunk_max) {
    const float M_new = ggx_max_nan(M, chunk_max);
    const float alpha = M_new == -ggx_inf() ? 1.0f : expf(M - M_new);
    M = M_new;
    return alpha;
}

// ---------------------------------------------------------------- vec
template <int D, int NCOLS, typename KT>
__global__ void __launch_bounds__(FA_VEC_THREADS, 1) k_fattn_vec(const ggx_u8 * q, const ggx_u8 * k,
        const ggx_u8 * v, const ggx_u8 * mask, float * dst, float * parts, float * meta, const int T, const int H,
        const int KV, const int gqa, const int r3, const int mask_ne3, const ggx_i64 nbq1, const ggx_i64 nbq2,
        const ggx_i64 nbq3, const ggx_i64 nbk1, const ggx_i64 nbk2, const ggx_i64 nbk3, const ggx_i64 nbv1,
        const ggx_i64 nbv2, const ggx_i64 nbv3, const ggx_i64 nbm1, const ggx_i64 nbm3, const float scale,
        const float max_bias, const float m0, const float m1, const int n_head_log2, const float softcap) {
    static_assert(D % (2 * FA_VEC_LANES_KQ) == 0 && D <= 2 * FA_VEC_THREADS, "head size");
    constexpr int QPL = D / FA_VEC_LANES_KQ;  // q values per lane
    constexpr int DPT = (D + FA_VEC_THREADS - 1) / FA_VEC_THREADS;  // output dims per thread
    const int tid = threadIdx.x;
    const int lane = tid % GGX_WARP;
    const int warp = tid / GGX_WARP;
    const int t0 = blockIdx.x * NCOLS;
    const int h = blockIdx.z % H;
    const int b = blockIdx.z / H;

    __shared__ float sp[NCOLS][FA_VEC_CHUNK];
    __shared__ float red[FA_VEC_WARPS];

    // this lane's part of each query row: the pairs (2 p, 2 p + 1), p = lane % 8 + 8 i
    float qr[NCOLS][QPL];
    const __half * mrows[NCOLS];
    const float slope = ggx_alibi_slope(h, max_bias, m0, m1, n_head_log2);
#pragma unroll
    for (int c = 0; c < NCOLS; ++c) {
        const bool in = t0 + c < T;
        const float * qrow = (const float *) (q + (ggx_i64) min(t0 + c, T - 1) * nbq1 + (ggx_i64) h * nbq2
                                              + (ggx_i64) b * nbq3);
#pragma unroll
        for (int i = 0; i < QPL / 2; ++i) {
            const int p = lane % FA_VEC_LANES_KQ + FA_VEC_LANES_KQ * i;
            qr[c][2 * i] = in ? qrow[2 * p] * scale : 0.0f;
            qr[c][2 * i + 1] = in ? qrow[2 * p + 1] * scale : 0.0f;
        }
        mrows[c] = mask ? (const __half *) (mask + (ggx_i64) min(t0 + c, T - 1) * nbm1 + (ggx_i64) (b % mask_ne3) * nbm3)
                        : nullptr;
    }
    const ggx_u8 * kb = k + (ggx_i64) (h / gqa) * nbk2 + (ggx_i64) (b / r3) * nbk3;
    const ggx_u8 * vb = v + (ggx_i64) (h / gqa) * nbv2 + (ggx_i64) (b / r3) * nbv3;

    float M[NCOLS], S[NCOLS], acc[NCOLS][DPT];
#pragma unroll
    for (int c = 0; c < NCOLS; ++c) {
        M[c] = -ggx_inf();
        S[c] = 0.0f;
#pragma unroll
        for (int i = 0; i < DPT; ++i) {
            acc[c][i] = 0.0f;
        }
    }

    for (int j0 = blockIdx.y * FA_VEC_CHUNK; j0 < KV; j0 += gridDim.y * FA_VEC_CHUNK) {
        // scores: warp w takes keys j0 + 32 w .. + 31, four at a time (one per group of 8 lanes)
        for (int step = 0; step < GGX_WARP / 4; ++step) {
            const int jj = warp * GGX_WARP + 4 * step + lane / FA_VEC_LANES_KQ;
            const int j = min(j0 + jj, KV - 1);
            const KT * krow = (const KT *) (kb + (ggx_i64) j * nbk1);
            float dot[NCOLS];
#pragma unroll
            for (int c = 0; c < NCOLS; ++c) {
                dot[c] = 0.0f;
            }
#pragma unroll
            for (int i = 0; i < QPL / 2; ++i) {
                const int p = lane % FA_VEC_LANES_KQ + FA_VEC_LANES_KQ * i;
                const float k0 = ggx_to_f32(krow[2 * p]);
                const float k1 = ggx_to_f32(krow[2 * p + 1]);
#pragma unroll
                for (int c = 0; c < NCOLS; ++c) {
                    dot[c] += qr[c][2 * i] * k0 + qr[c][2 * i + 1] * k1;
                }
            }
#pragma unroll
            for (int c = 0; c < NCOLS; ++c) {
#pragma unroll
                for (int o = FA_VEC_LANES_KQ / 2; o > 0; o >>= 1) {
                    dot[c] += __shfl_xor_sync(0xffffffffu, dot[c], o, GGX_WARP);
                }
                if (lane % FA_VEC_LANES_KQ == 0) {
                    sp[c][jj] = j0 + jj < KV ? fattn_score(dot[c], softcap, mrows[c], j, slope) : -ggx_inf();
                }
            }
        }
        __syncthreads();
        // online softmax: every thread holds key tid of the chunk
#pragma unroll
        for (int c = 0; c < NCOLS; ++c) {
            const float s = sp[c][tid];
            const float alpha = fattn_rescale(M[c], ggx_block_reduce_ordered<ggx_max_keep_nan, FA_VEC_WARPS>(s, red));
            const float p = M[c] == -ggx_inf() ? 0.0f : expf(s - M[c]);
            S[c] = S[c] * alpha + p;
#pragma unroll
            for (int i = 0; i < DPT; ++i) {
                acc[c][i] *= alpha;
            }
            sp[c][tid] = p;  // the thread's own key: read and written by it alone
        }
        __syncthreads();
        const int nj = min(FA_VEC_CHUNK, KV - j0);
#pragma unroll
        for (int i = 0; i < DPT; ++i) {
            const int d = tid + i * FA_VEC_THREADS;
            if (d < D) {
                for (int jj = 0; jj < nj; ++jj) {
                    const float vv = ggx_to_f32(((const KT *) (vb + (ggx_i64) (j0 + jj) * nbv1))[d]);
#pragma unroll
                    for (int c = 0; c < NCOLS; ++c) {
                        acc[c][i] += sp[c][jj] * vv;
                    }
                }
            }
        }
        __syncthreads();  // sp is rewritten by the next chunk
    }

#pragma unroll
    for (int c = 0; c < NCOLS; ++c) {
        const float S_all = ggx_block_reduce_ordered<ggx_sum, FA_VEC_WARPS>(S[c], red);
        if (t0 + c >= T) {
            continue;
        }
        const ggx_i64 row = ((ggx_i64) b * T + t0 + c) * H + h;
#pragma unroll
        for (int i = 0; i < DPT; ++i) {
            const int d = tid + i * FA_VEC_THREADS;
            if (d < D) {
                if (gridDim.y == 1) {
                    dst[row * D + d] = S_all == 0.0f ? 0.0f : acc[c][i] / S_all;
                } else {
                    parts[(row * gridDim.y + blockIdx.y) * D + d] = acc[c][i];
                }
            }
        }
        if (gridDim.y > 1 && tid == 0) {
            meta[2 * (row * gridDim.y + blockIdx.y)] = M[c];
            meta[2 * (row * gridDim.y + blockIdx.y) + 1] = S_all;
        }
    }
}

// grid (T, H, B), FA_VEC_THREADS threads: row r = (b * T + t) * H + h of P parallel blocks' parts
__global__ void __launch_bounds__(FA_VEC_THREADS) k_fattn_combine(const float * parts, const float * meta, float * dst,
                                                                  const int D, const int P) {
    const ggx_i64 row = ((ggx_i64) blockIdx.z * gridDim.x + blockIdx.x) * gridDim.y + blockIdx.y;
    const float * ml = meta + 2 * row * P;
    float M = -ggx_inf();
    for (int l = 0; l < P; ++l) {
        M = ggx_max_nan(M, ml[2 * l]);
    }
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float num = 0.0f;
        float den = 0.0f;
        for (int l = 0; l < P; ++l) {
            const float w = ml[2 * l] == -ggx_inf() ? 0.0f : expf(ml[2 * l] - M);
            num += w * parts[(row * P + l) * D + d];
            den += w * ml[2 * l + 1];
        }
        dst[row * D + d] = den == 0.0f ? 0.0f : num / den;
    }
}

// ---------------------------------------------------------------- tile
// key rows per chunk: the K (then V) chunk as float takes at most 16 KiB
template <int D>
struct fattn_tile_kb {
    static constexpr int value = (4096 / D) / 8 * 8 > 64 ? 64 : (4096 / D) / 8 * 8;
};

// rows j0 .. j0 + nj of a K or V head (row stride nb1) into s[KB][D + 1] as float, zeros past nj
template <int D, int KB, typename KT>
static __device__ __forceinline__ void fattn_stage(float (*s)[D + 1], const ggx_u8 * base, const ggx_i64 nb1,
                                                   const int j0, const int nj) {
    for (int e = threadIdx.x; e < KB * D; e += FA_TILE_THREADS) {
        const int jj = e / D;
        s[jj][e % D] = jj < nj ? ggx_to_f32(((const KT *) (base + (ggx_i64) (j0 + jj) * nb1))[e % D]) : 0.0f;
    }
}

template <int D, typename KT>
__global__ void __launch_bounds__(FA_TILE_THREADS, 1) k_fattn_tile(const ggx_u8 * q, const ggx_u8 * k,
        const ggx_u8 * v, const ggx_u8 * mask, float * dst, const int T, const int H, const int KV, const int gqa,
        const int r3, const int mask_ne3, const ggx_i64 nbq1, const ggx_i64 nbq2, const ggx_i64 nbq3,
        const ggx_i64 nbk1, const ggx_i64 nbk2, const ggx_i64 nbk3, const ggx_i64 nbv1, const ggx_i64 nbv2,
        const ggx_i64 nbv3, const ggx_i64 nbm1, const ggx_i64 nbm3, const float scale, const float max_bias,
        const float m0, const float m1, const int n_head_log2, const float softcap) {
    constexpr int KB = fattn_tile_kb<D>::value;
    constexpr int NC = FA_TILE_NCOLS;
    constexpr int SPT = (NC * KB + FA_TILE_THREADS - 1) / FA_TILE_THREADS;  // scores per thread
    constexpr int OPT = (NC * D + FA_TILE_THREADS - 1) / FA_TILE_THREADS;  // (row, dim) outputs per thread
    const int tid = threadIdx.x;
    const int lane = tid % GGX_WARP;
    const int warp = tid / GGX_WARP;
    const int t0 = blockIdx.x * NC;
    const int h = blockIdx.y % H;
    const int b = blockIdx.y / H;

    __shared__ float sq[NC][D + 1];
    __shared__ float skv[KB][D + 1];
    __shared__ float ss[NC][KB];
    __shared__ float sM[NC];
    __shared__ float sS[NC];
    __shared__ float salpha[NC];

    for (int e = tid; e < NC * D; e += FA_TILE_THREADS) {
        const int c = e / D;
        const int d = e % D;
        const float * qrow = (const float *) (q + (ggx_i64) min(t0 + c, T - 1) * nbq1 + (ggx_i64) h * nbq2
                                              + (ggx_i64) b * nbq3);
        sq[c][d] = t0 + c < T ? qrow[d] * scale : 0.0f;
    }
    if (tid < NC) {
        sM[tid] = -ggx_inf();
        sS[tid] = 0.0f;
    }
    const ggx_u8 * kb = k + (ggx_i64) (h / gqa) * nbk2 + (ggx_i64) (b / r3) * nbk3;
    const ggx_u8 * vb = v + (ggx_i64) (h / gqa) * nbv2 + (ggx_i64) (b / r3) * nbv3;
    const float slope = ggx_alibi_slope(h, max_bias, m0, m1, n_head_log2);
    float acc[OPT];
#pragma unroll
    for (int i = 0; i < OPT; ++i) {
        acc[i] = 0.0f;
    }

    for (int j0 = 0; j0 < KV; j0 += KB) {
        const int nj = min(KB, KV - j0);
        __syncthreads();  // the previous chunk's values are consumed; Q is staged
        fattn_stage<D, KB, KT>(skv, kb, nbk1, j0, nj);
        __syncthreads();
#pragma unroll
        for (int i = 0; i < SPT; ++i) {
            const int e = tid + i * FA_TILE_THREADS;
            if (e < NC * KB) {
                const int c = e / KB;
                const int jj = e % KB;
                float dot = 0.0f;
                for (int d = 0; d < D; ++d) {
                    dot += sq[c][d] * skv[jj][d];
                }
                const __half * mrow = mask ? (const __half *) (mask + (ggx_i64) min(t0 + c, T - 1) * nbm1
                                                               + (ggx_i64) (b % mask_ne3) * nbm3)
                                           : nullptr;
                ss[c][jj] = jj < nj ? fattn_score(dot, softcap, mrow, j0 + jj, slope) : -ggx_inf();
            }
        }
        __syncthreads();
        // warp w: rows 2 w and 2 w + 1, lanes over the chunk's keys
        for (int c = warp; c < NC; c += FA_TILE_WARPS) {
            float mx = -ggx_inf();
            for (int jj = lane; jj < KB; jj += GGX_WARP) {
                mx = ggx_max_nan(mx, ss[c][jj]);
            }
            mx = ggx_warp_reduce<ggx_max_keep_nan>(mx);
            float M = sM[c];
            const float alpha = fattn_rescale(M, mx);
            float sum = 0.0f;
            for (int jj = lane; jj < KB; jj += GGX_WARP) {
                const float p = M == -ggx_inf() ? 0.0f : expf(ss[c][jj] - M);
                ss[c][jj] = p;
                sum += p;
            }
            sum = ggx_warp_sum(sum);
            if (lane == 0) {
                sM[c] = M;
                sS[c] = sS[c] * alpha + sum;
                salpha[c] = alpha;
            }
        }
        __syncthreads();
        fattn_stage<D, KB, KT>(skv, vb, nbv1, j0, nj);
        __syncthreads();
#pragma unroll
        for (int i = 0; i < OPT; ++i) {
            const int e = tid + i * FA_TILE_THREADS;
            if (e < NC * D) {
                const int c = e / D;
                const int d = e % D;
                float a = acc[i] * salpha[c];
                for (int jj = 0; jj < nj; ++jj) {
                    a += ss[c][jj] * skv[jj][d];
                }
                acc[i] = a;
            }
        }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < OPT; ++i) {
        const int e = tid + i * FA_TILE_THREADS;
        const int c = e / D;
        if (e < NC * D && t0 + c < T) {
            const ggx_i64 row = ((ggx_i64) b * T + t0 + c) * H + h;
            dst[row * D + e % D] = sS[c] == 0.0f ? 0.0f : acc[i] / sS[c];
        }
    }
}
