// What the integer-dot-product kernels share (ggml-cuda's vecdotq.cuh / mmq.cuh basics): the q8_1
// activation blocks, their two layouts, and 32-bit loads of packed quants.
//
// * ggx_block_q8_1 (MMVQ): 32 values of a column; f16 d = amax / 127, f16 s = the sum of the 32
//   float values before quantizing (ggml-cuda's quantize_q8_1 stores the float sum, not d * sum(q)),
//   32 x i8 read as 8 ints. A column of K values is K / 32 consecutive blocks.
// * ggx_block_q8_1_mmq (MMQ): 128 values of a column, with a 16-byte header chosen per weight type
//   (ggml's mmq_q8_1_ds_layout): D4 = 4 float scales d, one per 32 values, for weights whose
//   offset is folded into their own quants (Q5_0, Q8_0, Q6_K); DS4 = 4 (f16 d, f16 s) pairs, s the
//   float sum of the 32 values, for weights whose min or offset multiplies the activation sum
//   (Q4_0, Q4_1, Q4_K, Q5_K). 144 bytes: the size of 4 q8_1 blocks.
//
// Packed quants are read 32 bits at a time: ggx_int_b2 from a 2-byte aligned block (Q4_0, Q5_0,
// Q8_0, Q6_K are 18 / 22 / 34 / 210 bytes), ggx_int_b4 from a 4-byte aligned one (Q4_1, Q4_K, Q5_K).

#pragma once

#include "common.cuh"

struct ggx_block_q8_1 {
    unsigned short d;
    unsigned short s;
    int qs[8];
};
static_assert(sizeof(ggx_block_q8_1) == 36, "block_q8_1 is 36 bytes");

#define GGX_QK8_1_MMQ 128

struct ggx_block_q8_1_mmq {
    unsigned int ds[4];  // D4: float bits of d; DS4: f16 d in the low half, f16 s in the high half
    int qs[32];
};
static_assert(sizeof(ggx_block_q8_1_mmq) == 144, "block_q8_1_mmq is 144 bytes");

// int i of a 2-byte aligned array of packed quants
static __device__ __forceinline__ int ggx_int_b2(const void * p, const int i) {
    const unsigned short * h = (const unsigned short *) p;
    return (int) ((unsigned int) h[2 * i] | ((unsigned int) h[2 * i + 1] << 16));
}

// int i of a 4-byte aligned array
static __device__ __forceinline__ int ggx_int_b4(const void * p, const int i) { return ((const int *) p)[i]; }

// the f16 halves of a DS4 header word as floats
static __device__ __forceinline__ float ggx_ds_d(const unsigned int ds) { return ggx_f16_to_f32((unsigned short) ds); }
static __device__ __forceinline__ float ggx_ds_s(const unsigned int ds) {
    return ggx_f16_to_f32((unsigned short) (ds >> 16));
}

// Quantize x, this lane's value of a 32-value group held by one warp: its q, and the group's scale d
// (amax / 127) and sum s = d * sum(q) (every lane gets them). A zero group gives q = 0, d = 0, s = 0.
// s is ggml-cpu's (quantize_row_q8_1_ref), not ggml-cuda's float sum of x: a weight's offset or min
// folded through s then meets the same quantized activations as the integer dot, so their rounding
// error is weighted by the centred weights, not by the uncentred quants (a deliberate deviation
// from ggml-cuda; docs/architecture.md, "CUDA").
static __device__ __forceinline__ int ggx_q8_1_group(const float x, float & d, float & sum) {
    const float amax = ggx_warp_reduce<ggx_max>(fabsf(x));
    d = amax / 127.0f;
    const int q = amax == 0.0f ? 0 : (int) roundf(x / d);
    sum = d * ggx_warp_sum((float) q);
    return q;
}
