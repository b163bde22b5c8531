// Row gathers and scatters of ggx-cuda: GET_ROWS and SET_ROWS.
//
//   rows_get<S>        out[i0, i10, i11, i12] = a[i0, ids[i10, i11, i12], i11 % a.ne2, i12 % a.ne3]
//                      with a's rows of type S (F32, F16, BF16, I32, Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K)
//                      dequantized to F32 (I32 stays I32), one thread per output element
//   rows_set<I, D>     dst[i0, ids[i1, i2 % ids.ne1, i3 % ids.ne2], i2, i3] = src[i0, i1, i2, i3]
//                      from F32 into D (F32, F16, BF16), ids of type I (int, long long)
//   rows_set_q<I, Q>   the same into a quantized D (Q8_0, Q4_0, Q4_1, Q5_0): one thread per block of 32
//
// Every operand comes with its byte strides (ggml's nb). An index outside the rows of the table
// is not followed (ggml does not check either; the reference raises): GET_ROWS writes a NaN row
// (0 for I32), SET_ROWS writes nothing.
//
// Conversions and quantizers are ggml's and bit-exact with the reference (core/ggx/quants.py):
// dequantization and quantization round every float operation on its own (__fmul_rn & co, no
// fused multiply-add), F16 rounds to nearest even with NaN made 0x7E00 (sign kept), BF16 is
// ggml_compute_fp32_to_bf16.

#include "common.cuh"

// ---------------------------------------------------------------- row types
// get(row, i0, nb0): element i0 of a row (nb0: the element stride, or the block stride of a
// quantized row); bad(): the value of a row that is not in the table; store(p, v): write a float
// as this type; quantize(x, out): 32 floats as one block
template <typename E>
struct rows_elem : E {
    typedef float out_t;
    static __device__ __forceinline__ out_t get(const char * row, long long i0, long long nb0) {
        return E::load(row + i0 * nb0);
    }
    static __device__ __forceinline__ out_t bad() { return ggx_nan(); }
};

template <typename B>
struct rows_block : B {
    typedef float out_t;
    static __device__ __forceinline__ out_t get(const char * row, long long i0, long long nb0) {
        return B::get(row + (i0 / B::qk) * nb0, (int) (i0 % B::qk));
    }
    static __device__ __forceinline__ out_t bad() { return ggx_nan(); }
};

struct rows_f32 : rows_elem<ggx_f32> {};
struct rows_f16 : rows_elem<ggx_f16> {};
struct rows_bf16 : rows_elem<ggx_bf16> {};
struct rows_q8_0 : rows_block<ggx_q8_0> {};
struct rows_q4_0 : rows_block<ggx_q4_0> {};
struct rows_q4_1 : rows_block<ggx_q4_1> {};
struct rows_q5_0 : rows_block<ggx_q5_0> {};
struct rows_q4_k : rows_block<ggx_q4_K> {};
struct rows_q5_k : rows_block<ggx_q5_K> {};
struct rows_q6_k : rows_block<ggx_q6_K> {};

struct rows_i32 {
    typedef int out_t;
    static __device__ __forceinline__ out_t get(const char * row, long long i0, long long nb0) {
        return *(const int *) (row + i0 * nb0);
    }
    static __device__ __forceinline__ out_t bad() { return 0; }
};

// ---------------------------------------------------------------- kernels
// The destination row of source row (i1, i2, i3) of SET_ROWS: ids[i1, i2 % nei1, i3 % nei2], or
// -1 for an index outside dst's ned1 rows (not followed)
template <typename I>
static __device__ __forceinline__ long long rows_target(const char * ids, long long i1, long long i2, long long i3,
                                                        long long nei1, long long nei2, long long nbi0,
                                                        long long nbi1, long long nbi2, long long ned1) {
    const long long r = (long long) *(const I *) (ids + i1 * nbi0 + (i2 % nei1) * nbi1 + (i3 % nei2) * nbi2);
    return r < 0 || r >= ned1 ? -1 : r;
}

// n output elements; the output's sizes ne0 (row length), ne1 = ids.ne0, ne2 = ids.ne1
template <typename S>
__global__ void rows_get(const char * a, const char * ids, char * d, long long n,
                         long long ne0, long long ne1, long long ne2,
                         long long nba0, long long nba1, long long nba2, long long nba3,
                         long long nea1, long long nea2, long long nea3,
                         long long nbi0, long long nbi1, long long nbi2,
                         long long nbd0, long long nbd1, long long nbd2, long long nbd3) {
    typedef typename S::out_t T;
    for (ggx_i64 i = ggx_thread_index(); i < n; i += ggx_thread_count()) {
        long long i0, i10, i11, i12;
        ggx_coords(i, ne0, ne1, ne2, n, i0, i10, i11, i12);
        const long long r = *(const int *) (ids + i10 * nbi0 + i11 * nbi1 + i12 * nbi2);
        T v;
        if (r < 0 || r >= nea1) {
            v = S::bad();
        } else {
            v = S::get(a + r * nba1 + (i11 % nea2) * nba2 + (i12 % nea3) * nba3, i0, nba0);
        }
        *(T *) (d + i0 * nbd0 + i10 * nbd1 + i11 * nbd2 + i12 * nbd3) = v;
    }
}

// n source elements; the source's sizes ne0, ne1, ne2; ids [ne1, nei1, nei2] broadcast over the
// source's dims 2 and 3; ned1: the rows of dst
template <typename I, typename D>
__global__ void rows_set(const char * s, const char * ids, char * d, long long n,
                         long long ne0, long long ne1, long long ne2,
                         long long nbs0, long long nbs1, long long nbs2, long long nbs3,
                         long long nei1, long long nei2,
                         long long nbi0, long long nbi1, long long nbi2,
                         long long ned1, long long nbd0, long long nbd1, long long nbd2, long long nbd3) {
    for (ggx_i64 i = ggx_thread_index(); i < n; i += ggx_thread_count()) {
        long long i0, i1, i2, i3;
        ggx_coords(i, ne0, ne1, ne2, n, i0, i1, i2, i3);
        const long long r = rows_target<I>(ids, i1, i2, i3, nei1, nei2, nbi0, nbi1, nbi2, ned1);
        if (r < 0) {
            continue;
        }
        const float v = *(const float *) (s + i0 * nbs0 + i1 * nbs1 + i2 * nbs2 + i3 * nbs3);
        D::store(d + i0 * nbd0 + r * nbd1 + i2 * nbd2 + i3 * nbd3, v);
    }
}

// as rows_set, over n blocks of 32 source values; ne0 counts blocks (the row length / 32) and nbd0
// is the destination's block stride
template <typename I, typename Q>
__global__ void rows_set_q(const char * s, const char * ids, char * d, long long n,
                           long long ne0, long long ne1, long long ne2,
                           long long nbs0, long long nbs1, long long nbs2, long long nbs3,
                           long long nei1, long long nei2,
                           long long nbi0, long long nbi1, long long nbi2,
                           long long ned1, long long nbd0, long long nbd1, long long nbd2, long long nbd3) {
    for (ggx_i64 i = ggx_thread_index(); i < n; i += ggx_thread_count()) {
        long long ib, i1, i2, i3;
        ggx_coords(i, ne0, ne1, ne2, n, ib, i1, i2, i3);
        const long long r = rows_target<I>(ids, i1, i2, i3, nei1, nei2, nbi0, nbi1, nbi2, ned1);
        if (r < 0) {
            continue;
        }
        const char * src = s + ib * 32 * nbs0 + i1 * nbs1 + i2 * nbs2 + i3 * nbs3;
        float x[32];
        for (int k = 0; k < 32; k++) {
            x[k] = *(const float *) (src + k * nbs0);
        }
        Q::quantize(x, d + ib * nbd0 + r * nbd1 + i2 * nbd2 + i3 * nbd3);
    }
}
