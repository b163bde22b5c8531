// What the kernel sources of ggx-cuda share (ggml-cuda's common.cuh): float bit patterns, F16 /
// BF16 conversions as ggml rounds them, element types (load / store a float), the GGUF blocks
// with their dequantizers and ggml's reference quantizers, flat-index and row coordinates, and
// warp / block reductions. A source includes it with #include "common.cuh"; every compile passes
// the kernels folder as an include directory (CupyDriver, the NVRTC checks, the host builds).
//
// The dequantizers and quantizers round every float operation on its own (__fmul_rn & co: no
// fused multiply-add contraction), so their values are the reference's (core/ggx/quants.py) bit
// for bit. Block layouts are GGUF's.
//
// Built for the host (tests/host_cuda_shim.h, GGX_HOST_EMU defined) the CUDA headers are not
// included: the shim stands in for what is used here.

#pragma once

#ifndef GGX_HOST_EMU
#include <cuda_fp16.h>
#endif

#define GGX_WARP 32

// Dynamic shared memory (the launch's size): `extern __shared__` on a GPU; built for the host, the
// shim's one buffer of the launch's size (a function-static `extern` array cannot be declared there)
#ifndef GGX_HOST_EMU
#define GGX_DYNAMIC_SHARED(T, name) extern __shared__ T name[]
#else
#define GGX_DYNAMIC_SHARED(T, name) T * name = (T *) hc_dynamic_shared()
#endif

typedef long long ggx_i64;
typedef unsigned char ggx_u8;

// ---------------------------------------------------------------- float bit patterns
static __device__ __forceinline__ float ggx_inf() { return __int_as_float(0x7f800000); }
static __device__ __forceinline__ float ggx_nan() { return __int_as_float(0x7fc00000); }

// ---------------------------------------------------------------- F16 / BF16
static __device__ __forceinline__ float ggx_f16_to_f32(unsigned short h) {
    return __half2float(__ushort_as_half(h));
}

// round to nearest even; NaN becomes the quiet NaN 0x7E00, sign kept (ggml's)
static __device__ __forceinline__ unsigned short ggx_f32_to_f16(float f) {
    if (f != f) {
        return (__float_as_uint(f) >> 31) ? 0xFE00 : 0x7E00;
    }
    return __half_as_ushort(__float2half_rn(f));
}

static __device__ __forceinline__ float ggx_bf16_to_f32(unsigned short h) {
    return __uint_as_float(((unsigned int) h) << 16);
}

// ggml_compute_fp32_to_bf16
static __device__ __forceinline__ unsigned short ggx_f32_to_bf16(float f) {
    const unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep the top bits, force quiet
        return (unsigned short) ((u >> 16) | 64);
    }
    return (unsigned short) ((u + (0x7fffu + ((u >> 16) & 1u))) >> 16);
}

// An F16 value read a byte at a time (a block scale: a quantized block is only 2-byte aligned)
static __device__ __forceinline__ float ggx_f16_at(const void * p) {
    const ggx_u8 * b = (const ggx_u8 *) p;
    return ggx_f16_to_f32((unsigned short) (b[0] | (b[1] << 8)));
}

// a K / V / mask value of either half type, as float
static __device__ __forceinline__ float ggx_to_f32(const float v) { return v; }
static __device__ __forceinline__ float ggx_to_f32(const __half v) { return __half2float(v); }

// ---------------------------------------------------------------- element types
// load(p): the value at p as float; store(p, v): v written as this type, ggml's rounding
struct ggx_f32 {
    static __device__ __forceinline__ float load(const void * p) { return *(const float *) p; }
    static __device__ __forceinline__ void store(void * p, float v) { *(float *) p = v; }
};

struct ggx_f16 {
    static __device__ __forceinline__ float load(const void * p) { return ggx_f16_to_f32(*(const unsigned short *) p); }
    static __device__ __forceinline__ void store(void * p, float v) { *(unsigned short *) p = ggx_f32_to_f16(v); }
};

struct ggx_bf16 {
    static __device__ __forceinline__ float load(const void * p) { return ggx_bf16_to_f32(*(const unsigned short *) p); }
    static __device__ __forceinline__ void store(void * p, float v) { *(unsigned short *) p = ggx_f32_to_bf16(v); }
};

// ---------------------------------------------------------------- GGUF blocks
// qk values in a block of ts bytes; get(b, j): value j of the block at b (0 <= j < qk) as float;
// quantize(x, out): qk floats as one block, exactly as ggml's quantize_row_*_ref.

// nibble j of 32 packed in 16 bytes: values j and j + 16 share byte j (low, high)
static __device__ __forceinline__ int ggx_nibble(const ggx_u8 * qs, int j) {
    return (qs[j & 15] >> ((j >> 4) << 2)) & 0xF;
}

// a 4-bit quant of Q4_0 / Q4_1: x * id + bias (each operation rounded), truncated, clamped to 0..15
static __device__ __forceinline__ int ggx_q4(float x, float id, float bias) {
    const int q = (int) truncf(__fadd_rn(__fmul_rn(x, id), bias));
    return q < 0 ? 0 : (q > 15 ? 15 : q);
}

// Q4_0: f16 d, 16 bytes of nibbles; value = (q - 8) * d
struct ggx_q4_0 {
    static constexpr int qk = 32;
    static constexpr int ts = 18;
    static __device__ __forceinline__ float get(const void * p, int j) {
        const ggx_u8 * b = (const ggx_u8 *) p;
        return __fmul_rn(ggx_f16_at(b), (float) (ggx_nibble(b + 2, j) - 8));
    }
    // max = the value of largest magnitude (the first), d = max / -8, q = MIN(15, (int8_t)(x / d + 8.5))
    static __device__ __forceinline__ void quantize(const float * x, char * out) {
        float amax = 0.0f;
        float vmax = 0.0f;
        for (int j = 0; j < 32; j++) {
            const float v = x[j];
            if (amax < fabsf(v)) {
                amax = fabsf(v);
                vmax = v;
            }
        }
        const float d = __fdiv_rn(vmax, -8.0f);
        const float id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
        *(unsigned short *) out = ggx_f32_to_f16(d);
        for (int j = 0; j < 16; j++) {
            out[2 + j] = (char) (unsigned char) (ggx_q4(x[j], id, 8.5f) | (ggx_q4(x[j + 16], id, 8.5f) << 4));
        }
    }
};

// Q4_1: f16 d, f16 m, 16 bytes of nibbles; value = q * d + m
struct ggx_q4_1 {
    static constexpr int qk = 32;
    static constexpr int ts = 20;
    static __device__ __forceinline__ float get(const void * p, int j) {
        const ggx_u8 * b = (const ggx_u8 *) p;
        return __fadd_rn(__fmul_rn(ggx_f16_at(b), (float) ggx_nibble(b + 4, j)), ggx_f16_at(b + 2));
    }
    // d = (max - min) / 15, m = min, q = MIN(15, (int8_t)((x - min) / d + 0.5))
    static __device__ __forceinline__ void quantize(const float * x, char * out) {
        float vmin = 3.402823466e+38f;
        float vmax = -3.402823466e+38f;
        for (int j = 0; j < 32; j++) {
            const float v = x[j];
            if (v < vmin) {
                vmin = v;
            }
            if (v > vmax) {
                vmax = v;
            }
        }
        const float d = __fdiv_rn(__fsub_rn(vmax, vmin), 15.0f);
        const float id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
        *(unsigned short *) out = ggx_f32_to_f16(d);
        *(unsigned short *) (out + 2) = ggx_f32_to_f16(vmin);
        for (int j = 0; j < 16; j++) {
            const int q0 = ggx_q4(__fsub_rn(x[j], vmin), id, 0.5f);
            const int q1 = ggx_q4(__fsub_rn(x[j + 16], vmin), id, 0.5f);
            out[4 + j] = (char) (unsigned char) (q0 | (q1 << 4));
        }
    }
};

// a 5-bit quant of Q5_0: x * id + 16.5 (each operation rounded), truncated, clamped to 0..31
static __device__ __forceinline__ int ggx_q5(float x, float id) {
    const int q = (int) truncf(__fadd_rn(__fmul_rn(x, id), 16.5f));
    return q < 0 ? 0 : (q > 31 ? 31 : q);
}

// Q5_0: f16 d, 4 bytes qh (little-endian; bit j is bit 4 of value j), 16 bytes of nibbles as
// Q4_0's; value = (q - 16) * d. The block is 22 bytes: only 2-byte aligned, qh read bytewise
struct ggx_q5_0 {
    static constexpr int qk = 32;
    static constexpr int ts = 22;
    static __device__ __forceinline__ float get(const void * p, int j) {
        const ggx_u8 * b = (const ggx_u8 *) p;
        const int h = (b[2 + (j >> 3)] >> (j & 7)) & 1;
        return __fmul_rn(ggx_f16_at(b), (float) ((ggx_nibble(b + 6, j) | (h << 4)) - 16));
    }
    // max = the value of largest magnitude (the first), d = max / -16, q = MIN(31, (int8_t)(x / d + 16.5))
    static __device__ __forceinline__ void quantize(const float * x, char * out) {
        float amax = 0.0f;
        float vmax = 0.0f;
        for (int j = 0; j < 32; j++) {
            const float v = x[j];
            if (amax < fabsf(v)) {
                amax = fabsf(v);
                vmax = v;
            }
        }
        const float d = __fdiv_rn(vmax, -16.0f);
        const float id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
        *(unsigned short *) out = ggx_f32_to_f16(d);
        unsigned int qh = 0;
        for (int j = 0; j < 16; j++) {
            const int q0 = ggx_q5(x[j], id);
            const int q1 = ggx_q5(x[j + 16], id);
            out[6 + j] = (char) (unsigned char) ((q0 & 0xF) | ((q1 & 0xF) << 4));
            qh |= ((unsigned int) (q0 >> 4) << j) | ((unsigned int) (q1 >> 4) << (j + 16));
        }
        for (int k = 0; k < 4; k++) {
            out[2 + k] = (char) (unsigned char) (qh >> (8 * k));
        }
    }
};

// Q8_0: f16 d, 32 x i8; value = q * d
struct ggx_q8_0 {
    static constexpr int qk = 32;
    static constexpr int ts = 34;
    static __device__ __forceinline__ float get(const void * p, int j) {
        const ggx_u8 * b = (const ggx_u8 *) p;
        return __fmul_rn((float) (signed char) b[2 + j], ggx_f16_at(b));
    }
    // d = amax / 127, q = roundf(x / d) (half away from zero)
    static __device__ __forceinline__ void quantize(const float * x, char * out) {
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) {
            const float v = fabsf(x[j]);
            amax = amax > v ? amax : v;  // ggml's MAX(amax, v)
        }
        const float d = __fdiv_rn(amax, 127.0f);
        const float id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
        *(unsigned short *) out = ggx_f32_to_f16(d);
        for (int j = 0; j < 32; j++) {
            out[2 + j] = (char) (signed char) (int) roundf(__fmul_rn(x[j], id));
        }
    }
};

// Q4_K: 256 values; f16 d, f16 dmin, 12 bytes of 6-bit scales and mins (8 sub-blocks of 32,
// ggml's get_scale_min_k4), 128 bytes of nibbles (64-value groups: the first 32 in low nibbles,
// the next 32 in high ones); value = (d * sc) * q - dmin * m
struct ggx_q4_K {
    static constexpr int qk = 256;
    static constexpr int ts = 144;
    // scale and min of sub-block s (0 <= s < 8)
    static __device__ __forceinline__ void scale_min(const ggx_u8 * b, int s, int & sc, int & m) {
        const ggx_u8 * scales = b + 4;
        if (s < 4) {
            sc = scales[s] & 63;
            m = scales[s + 4] & 63;
        } else {
            sc = (scales[s + 4] & 0xF) | ((scales[s - 4] >> 6) << 4);
            m = (scales[s + 4] >> 4) | ((scales[s] >> 6) << 4);
        }
    }
    // the 4-bit quant of value j
    static __device__ __forceinline__ int q(const ggx_u8 * b, int j) {
        return (b[16 + (j >> 6) * 32 + (j & 31)] >> (4 * ((j >> 5) & 1))) & 0xF;
    }
    static __device__ __forceinline__ float get(const void * p, int j) {
        const ggx_u8 * b = (const ggx_u8 *) p;
        int sc, m;
        scale_min(b, j >> 5, sc, m);
        const float d = __fmul_rn(ggx_f16_at(b), (float) sc);
        const float dm = __fmul_rn(ggx_f16_at(b + 2), (float) m);
        return __fsub_rn(__fmul_rn(d, (float) q(b, j)), dm);
    }
};

// Q5_K: 256 values; f16 d, f16 dmin, Q4_K's 12 bytes of scales and mins, 32 bytes qh, 128 bytes of
// nibbles (as Q4_K's). The fifth bit of value l of sub-block s (s = j / 32, l = j % 32) is bit s of
// qh[l]; value = (d * sc) * q - dmin * m
struct ggx_q5_K {
    static constexpr int qk = 256;
    static constexpr int ts = 176;
    static __device__ __forceinline__ int q(const ggx_u8 * b, int j) {
        const int lo = (b[48 + (j >> 6) * 32 + (j & 31)] >> (4 * ((j >> 5) & 1))) & 0xF;
        return lo | (((b[16 + (j & 31)] >> (j >> 5)) & 1) << 4);
    }
    static __device__ __forceinline__ float get(const void * p, int j) {
        const ggx_u8 * b = (const ggx_u8 *) p;
        int sc, m;
        ggx_q4_K::scale_min(b, j >> 5, sc, m);
        const float d = __fmul_rn(ggx_f16_at(b), (float) sc);
        const float dm = __fmul_rn(ggx_f16_at(b + 2), (float) m);
        return __fsub_rn(__fmul_rn(d, (float) q(b, j)), dm);
    }
};

// Q6_K: 256 values; 128 bytes of low nibbles ql, 64 bytes of 2-bit high parts qh, 16 x i8 scales
// (one per 16 values), f16 d. Value j: half n = j / 128, quarter c = (j % 128) / 32, l = j % 32;
// the low 4 bits from ql[64 n + l + 32 (c & 1)] (the high nibble for c >= 2), the high 2 bits
// (qh[32 n + l] >> 2c) & 3; value = (d * scale) * (q - 32)
struct ggx_q6_K {
    static constexpr int qk = 256;
    static constexpr int ts = 210;
    static __device__ __forceinline__ float get(const void * p, int j) {
        const ggx_u8 * b = (const ggx_u8 *) p;
        const int n = j >> 7;
        const int c = (j >> 5) & 3;
        const int l = j & 31;
        const int lo = (b[64 * n + l + 32 * (c & 1)] >> (4 * (c >> 1))) & 0xF;
        const int hi = (b[128 + 32 * n + l] >> (2 * c)) & 3;
        const float d = __fmul_rn(ggx_f16_at(b + 208), (float) (signed char) b[192 + (j >> 4)]);
        return __fmul_rn(d, (float) ((lo | (hi << 4)) - 32));
    }
};

// ---------------------------------------------------------------- coordinates
template <typename T>
static __device__ __forceinline__ void ggx_split(T i, T ne0, T ne1, T ne2, ggx_i64 & i0, ggx_i64 & i1, ggx_i64 & i2,
                                                 ggx_i64 & i3) {
    i0 = i % ne0;
    i /= ne0;
    i1 = i % ne1;
    i /= ne1;
    i2 = i % ne2;
    i3 = i / ne2;
}

// i -> (i0, i1, i2, i3) for sizes ne0, ne1, ne2 (ne3 is whatever is left). `bound` bounds i and
// the sizes (the element count): under 2^32, the cheaper 32-bit division does (uniform branch)
static __device__ __forceinline__ void ggx_coords(ggx_i64 i, ggx_i64 ne0, ggx_i64 ne1, ggx_i64 ne2, ggx_i64 bound,
                                                  ggx_i64 & i0, ggx_i64 & i1, ggx_i64 & i2, ggx_i64 & i3) {
    if (bound <= 0xffffffffLL) {
        ggx_split<unsigned int>((unsigned int) i, (unsigned int) ne0, (unsigned int) ne1, (unsigned int) ne2,
                                i0, i1, i2, i3);
        return;
    }
    ggx_split<ggx_i64>(i, ne0, ne1, ne2, i0, i1, i2, i3);
}

// row r of the rows of a [ne0, ne1, ne2, ne3] tensor -> (i1, i2, i3)
static __device__ __forceinline__ void ggx_row_coords(ggx_i64 r, ggx_i64 ne1, ggx_i64 ne2, ggx_i64 & i1, ggx_i64 & i2,
                                                      ggx_i64 & i3) {
    i1 = r % ne1;
    i2 = (r / ne1) % ne2;
    i3 = r / (ne1 * ne2);
}

// The first index and the step of a grid-stride loop over the threads of the grid (x only)
static __device__ __forceinline__ ggx_i64 ggx_thread_index() { return (ggx_i64) blockIdx.x * blockDim.x + threadIdx.x; }
static __device__ __forceinline__ ggx_i64 ggx_thread_count() { return (ggx_i64) gridDim.x * blockDim.x; }

// ggml's ALiBi slope of head h: m0^(h + 1) for h < n_head_log2, else m1^(2 (h - n_head_log2) + 1);
// 1 without a positive max_bias
static __device__ __forceinline__ float ggx_alibi_slope(const int h, const float max_bias, const float m0,
                                                        const float m1, const int n_head_log2) {
    float slope = 1.0f;
    if (max_bias > 0.0f) {
        const float base = h < n_head_log2 ? m0 : m1;
        const int exph = h < n_head_log2 ? h + 1 : 2 * (h - n_head_log2) + 1;
        slope = powf(base, (float) exph);
    }
    return slope;
}

// ---------------------------------------------------------------- reductions
// OP: identity() and apply(a, b), an associative float operation
struct ggx_sum {
    static __device__ __forceinline__ float identity() { return 0.0f; }
    static __device__ __forceinline__ float apply(float a, float b) { return a + b; }
};

struct ggx_max {
    static __device__ __forceinline__ float identity() { return -ggx_inf(); }
    static __device__ __forceinline__ float apply(float a, float b) { return fmaxf(a, b); }
};

// OP over the 32 lanes of the warp (a butterfly: every lane gets the result)
template <typename OP>
static __device__ __forceinline__ float ggx_warp_reduce(float v) {
#pragma unroll
    for (int o = GGX_WARP / 2; o > 0; o >>= 1) {
        v = OP::apply(v, __shfl_xor_sync(0xffffffffu, v, o, GGX_WARP));
    }
    return v;
}

static __device__ __forceinline__ float ggx_warp_sum(float v) { return ggx_warp_reduce<ggx_sum>(v); }

// OP over the block (blockDim.x a multiple of 32), for every thread: the warps' results meet in
// `s` (GGX_WARP floats of shared memory) and are reduced by a warp again. The leading barrier lets
// the block call it again with the same `s`.
template <typename OP>
static __device__ __forceinline__ float ggx_block_reduce(float v, float * s) {
    v = ggx_warp_reduce<OP>(v);
    if (blockDim.x > GGX_WARP) {
        const int w = threadIdx.x / GGX_WARP;
        const int l = threadIdx.x % GGX_WARP;
        __syncthreads();
        if (l == 0) {
            s[w] = v;
        }
        __syncthreads();
        v = l < (int) (blockDim.x / GGX_WARP) ? s[l] : OP::identity();
        v = ggx_warp_reduce<OP>(v);
    }
    return v;
}

static __device__ __forceinline__ float ggx_block_sum(float v, float * s) { return ggx_block_reduce<ggx_sum>(v, s); }

// max that keeps a NaN (fmaxf drops it): softmax's running max, where a NaN score makes a NaN row
static __device__ __forceinline__ float ggx_max_nan(const float a, const float b) { return (a > b || a != a) ? a : b; }

struct ggx_max_keep_nan {
    static __device__ __forceinline__ float identity() { return -ggx_inf(); }
    static __device__ __forceinline__ float apply(float a, float b) { return ggx_max_nan(a, b); }
};

// OP over a block of NWARPS warps (1-D), for every thread: the warps' results in red[NWARPS],
// combined in warp order by each thread (the same value everywhere, whatever OP's rounding). The
// leading barrier lets the block call it again with the same `red`.
template <typename OP, int NWARPS>
static __device__ __forceinline__ float ggx_block_reduce_ordered(float v, float * red) {
    v = ggx_warp_reduce<OP>(v);
    __syncthreads();
    if (threadIdx.x % GGX_WARP == 0) {
        red[threadIdx.x / GGX_WARP] = v;
    }
    __syncthreads();
    float r = OP::identity();
#pragma unroll
    for (int w = 0; w < NWARPS; ++w) {
        r = OP::apply(r, red[w]);
    }
    return r;
}
static __device__ __forceinline__ float ggx_block_max(float v, float * s) { return ggx_block_reduce<ggx_max>(v, s); }
