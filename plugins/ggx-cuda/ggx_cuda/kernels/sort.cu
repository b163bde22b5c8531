// ARGSORT and TOP_K over rows of F32 giving I32 indices (ggml-cuda's argsort.cu): a bitonic sort
// of the row's indices, padded to a power of two (ncols_pad), one block per row.
//
// The indices live in dynamic shared memory (ncols_pad ints) or, for rows too long for it, in
// global scratch (ncols_pad ints per block of the launch, `scratch` non-null); a block's barrier
// orders its global accesses as well. Each thread takes the elements threadIdx.x + k*blockDim.x,
// so a row may be longer than the block.
//
// The order is total, so the result is the reference's (numpy's stable argsort): values by the
// order asked (DESC: descending), NaN after every number, equal values by increasing index
// (stable), padding last. The first n_out sorted indices are written: n_out = ncols for ARGSORT,
// k for TOP_K (the k largest, in descending order).
//
// Every operand is addressed by byte strides. Rows are row0 + blockIdx.x of the flattened
// (i1, i2, i3) rows, so long rows can go over a bounded scratch in several launches.

#include "common.cuh"

// Whether index a comes after index b in the sorted row.
template <bool DESC>
static __device__ __forceinline__ bool sort_after(const char * xr, const ggx_i64 nb00, const int ncols, const int a,
                                                  const int b) {
    if (a >= ncols || b >= ncols) {  // padding goes last, among itself by index
        return a >= ncols && (b < ncols || a > b);
    }
    const float xa = *(const float *) (xr + a * nb00);
    const float xb = *(const float *) (xr + b * nb00);
    const bool na = xa != xa;
    const bool nb = xb != xb;
    if (na || nb) {  // NaN goes after every number
        return na && (!nb || a > b);
    }
    if (xa != xb) {
        return DESC ? xa < xb : xa > xb;
    }
    return a > b;
}

template <bool DESC>
__global__ void k_argsort_f32_i32(const char * x, char * dst, int * scratch, const int ncols, const int ncols_pad,
                                  const int n_out, const int ne1, const int ne2, const ggx_i64 row0,
                                  const ggx_i64 nb00, const ggx_i64 nb01, const ggx_i64 nb02, const ggx_i64 nb03,
                                  const ggx_i64 nb0, const ggx_i64 nb1, const ggx_i64 nb2, const ggx_i64 nb3) {
    GGX_DYNAMIC_SHARED(int, sort_smem);
    int * idx = scratch ? scratch + (ggx_i64) blockIdx.x * ncols_pad : sort_smem;

    ggx_i64 i1, i2, i3;
    ggx_row_coords(row0 + blockIdx.x, ne1, ne2, i1, i2, i3);
    const char * xr = x + i1 * nb01 + i2 * nb02 + i3 * nb03;
    char * dr = dst + i1 * nb1 + i2 * nb2 + i3 * nb3;

    for (int c = threadIdx.x; c < ncols_pad; c += blockDim.x) {
        idx[c] = c;
    }
    __syncthreads();

    for (int k = 2; k <= ncols_pad; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int c = threadIdx.x; c < ncols_pad; c += blockDim.x) {
                const int p = c ^ j;
                if (p > c) {
                    const int a = idx[c];
                    const int b = idx[p];
                    // (c & k) == 0: this run ascends (in the sorted order), else it descends
                    const bool swap = (c & k) == 0 ? sort_after<DESC>(xr, nb00, ncols, a, b)
                                                   : sort_after<DESC>(xr, nb00, ncols, b, a);
                    if (swap) {
                        idx[c] = b;
                        idx[p] = a;
                    }
                }
            }
            __syncthreads();
        }
    }

    for (int c = threadIdx.x; c < n_out; c += blockDim.x) {
        *(int *) (dr + c * nb0) = idx[c];
    }
}
