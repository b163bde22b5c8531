// Elementwise ops of ggx-cuda: ADD, MUL (b repeated over a), SCALE, SILU, GELU (tanh, erf,
// quick), GLU (SWIGLU, GEGLU; fused [gate|up] rows or two sources) and SUM_ROWS.
//
// Every operand comes with its byte strides nb0..nb3 (ggml's nb), so any view works; every kernel
// walks its flat element index with a grid-stride loop (the grid may be smaller than the work).
// All values are F32, arithmetic is float. No libc headers: NVRTC's built-ins and common.cuh.
//
// Kernels (instantiations named in ggx_cuda/ops/elementwise.py):
//   ew_binary<OP>  OP: 0 ADD, 1 MUL
//   ew_unary<OP>   OP: 0 SCALE (x*s + b), 1 SILU, 2 GELU (tanh), 3 GELU_ERF, 4 GELU_QUICK
//   ew_glu<KIND>   KIND: 0 SWIGLU, 1 GEGLU
//   ew_sum_rows

#include "common.cuh"

#define EW_ADD 0
#define EW_MUL 1

#define EW_SCALE 0
#define EW_SILU 1
#define EW_GELU 2
#define EW_GELU_ERF 3
#define EW_GELU_QUICK 4

#define EW_SWIGLU 0
#define EW_GEGLU 1

static __device__ __forceinline__ float ew_silu(float x) {
    // ggml: x / (1 + exp(-x)); silu(-inf) = -inf / inf = NaN as in ggml and the reference
    return x / (1.0f + expf(-x));
}

static __device__ __forceinline__ float ew_gelu_tanh(float x) {
    // 0.5 x (1 + tanh(u)) written as x * sigmoid(2u): the same function, without the cancellation
    // of 1 + tanh(u) for negative x. ggml's clamps: x <= -10 gives 0, x >= 10 gives x.
    const float GELU_COEF_A = 0.044715f;
    const float SQRT_2_OVER_PI = 0.79788456080286535587989211986876f;
    if (x <= -10.0f) {
        return 0.0f;
    }
    if (x >= 10.0f) {
        return x;
    }
    const float u = SQRT_2_OVER_PI * x * (1.0f + GELU_COEF_A * x * x);
    return x / (1.0f + expf(-2.0f * u));
}

static __device__ __forceinline__ float ew_gelu_erf(float x) {
    // 0.5 x (1 + erf(x / sqrt 2)), with 1 + erf(z) = erfc(-z) (no cancellation for negative x)
    const float SQRT_2_INV = 0.70710678118654752440084436210484f;
    return 0.5f * x * erfcf(-x * SQRT_2_INV);
}

static __device__ __forceinline__ float ew_gelu_quick(float x) {
    const float GELU_QUICK_COEF = -1.702f;
    return x * (1.0f / (1.0f + expf(GELU_QUICK_COEF * x)));
}

// d = a OP b, b repeated over a: b's index in dim k is a's modulo neb_k
template <int OP>
__global__ void ew_binary(const char * a, const char * b, char * d, long long n,
                          long long ne0, long long ne1, long long ne2,
                          long long nba0, long long nba1, long long nba2, long long nba3,
                          long long neb0, long long neb1, long long neb2, long long neb3,
                          long long nbb0, long long nbb1, long long nbb2, long long nbb3,
                          long long nbd0, long long nbd1, long long nbd2, long long nbd3) {
    for (ggx_i64 i = ggx_thread_index(); i < n; i += ggx_thread_count()) {
        long long i0, i1, i2, i3;
        ggx_coords(i, ne0, ne1, ne2, n, i0, i1, i2, i3);
        const float x = *(const float *) (a + i0 * nba0 + i1 * nba1 + i2 * nba2 + i3 * nba3);
        const float y = *(const float *) (b + (i0 % neb0) * nbb0 + (i1 % neb1) * nbb1 +
                                          (i2 % neb2) * nbb2 + (i3 % neb3) * nbb3);
        const float r = OP == EW_ADD ? x + y : x * y;
        *(float *) (d + i0 * nbd0 + i1 * nbd1 + i2 * nbd2 + i3 * nbd3) = r;
    }
}

// d = f(a); p0, p1 are SCALE's s and b (unused by the others)
template <int OP>
__global__ void ew_unary(const char * a, char * d, long long n, long long ne0, long long ne1, long long ne2,
                         long long nba0, long long nba1, long long nba2, long long nba3,
                         long long nbd0, long long nbd1, long long nbd2, long long nbd3, float p0, float p1) {
    for (ggx_i64 i = ggx_thread_index(); i < n; i += ggx_thread_count()) {
        long long i0, i1, i2, i3;
        ggx_coords(i, ne0, ne1, ne2, n, i0, i1, i2, i3);
        const float x = *(const float *) (a + i0 * nba0 + i1 * nba1 + i2 * nba2 + i3 * nba3);
        float r;
        if (OP == EW_SCALE) {
            r = fmaf(x, p0, p1);
        } else if (OP == EW_SILU) {
            r = ew_silu(x);
        } else if (OP == EW_GELU) {
            r = ew_gelu_tanh(x);
        } else if (OP == EW_GELU_ERF) {
            r = ew_gelu_erf(x);
        } else {
            r = ew_gelu_quick(x);
        }
        *(float *) (d + i0 * nbd0 + i1 * nbd1 + i2 * nbd2 + i3 * nbd3) = r;
    }
}

// d = act(gate) * up over d's shape; the planner points gate and up at the two halves of a fused
// row (same strides) or at the two sources
template <int KIND>
__global__ void ew_glu(const char * g, const char * u, char * d, long long n,
                       long long ne0, long long ne1, long long ne2,
                       long long nbg0, long long nbg1, long long nbg2, long long nbg3,
                       long long nbu0, long long nbu1, long long nbu2, long long nbu3,
                       long long nbd0, long long nbd1, long long nbd2, long long nbd3) {
    for (ggx_i64 i = ggx_thread_index(); i < n; i += ggx_thread_count()) {
        long long i0, i1, i2, i3;
        ggx_coords(i, ne0, ne1, ne2, n, i0, i1, i2, i3);
        const float x = *(const float *) (g + i0 * nbg0 + i1 * nbg1 + i2 * nbg2 + i3 * nbg3);
        const float y = *(const float *) (u + i0 * nbu0 + i1 * nbu1 + i2 * nbu2 + i3 * nbu3);
        const float act = KIND == EW_SWIGLU ? ew_silu(x) : ew_gelu_tanh(x);
        *(float *) (d + i0 * nbd0 + i1 * nbd1 + i2 * nbd2 + i3 * nbd3) = act * y;
    }
}

// d[0, i1, i2, i3] = sum over i0 of a[i0, i1, i2, i3]: one block per row (blockDim.x a multiple of
// 32, at most 1024), rows walked with a grid-stride loop
__global__ void ew_sum_rows(const char * a, char * d, long long nrows, long long ne0, long long ne1, long long ne2,
                            long long nba0, long long nba1, long long nba2, long long nba3,
                            long long nbd1, long long nbd2, long long nbd3) {
    __shared__ float partial[GGX_WARP];
    for (long long row = blockIdx.x; row < nrows; row += gridDim.x) {
        long long i1, i2, i3;
        ggx_row_coords(row, ne1, ne2, i1, i2, i3);
        const char * src = a + i1 * nba1 + i2 * nba2 + i3 * nba3;
        float s = 0.0f;
        for (long long i0 = threadIdx.x; i0 < ne0; i0 += blockDim.x) {
            s += *(const float *) (src + i0 * nba0);
        }
        s = ggx_block_sum(s, partial);  // its leading barrier: partial[] is free again
        if (threadIdx.x == 0) {
            *(float *) (d + i1 * nbd1 + i2 * nbd2 + i3 * nbd3) = s;
        }
    }
}
