// MUL_MAT_ID's grouping by expert (ggml-cuda's mmid.cu helper, written for ggx):
//
//   k_mmid_group   ids [n_used, n_tokens] (I32, byte strides) -> for expert e = 0, 1, ..., its
//       (token t, slot s) pairs in (t, s) order, as grouped columns c = bounds[e] .. bounds[e + 1]:
//       ids_src1[c] = t * b_ne1 + s % b_ne1 (the column of b it multiplies), ids_dst[c] =
//       t * n_used + s (its column of the output [M, n_used, n_tokens]). An id outside
//       0..n_expert-1 (the reference refuses it) joins no expert: its output column is NaN, and the
//       grouped columns past bounds[n_expert] read b's column 0 (quantized, never multiplied).
//       One block; thread k counts and lists experts k, k + blockDim.x, ... (two passes over the
//       ids), thread 0 turns the counts into bounds between them. Everything stays on the device:
//       no host sync, so the node can be captured in a CUDA graph.

#include "common.cuh"

#define MMID_BLOCK 256

__global__ void __launch_bounds__(MMID_BLOCK) k_mmid_group(const ggx_u8 * ids, int * ids_src1, int * ids_dst,
        int * bounds, float * dst, const int n_expert, const int n_used, const int n_tokens, const int b_ne1,
        const int M, const ggx_i64 nb_ids0, const ggx_i64 nb_ids1, const ggx_i64 nb_dst1, const ggx_i64 nb_dst2) {
    const int npairs = n_used * n_tokens;
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
        int count = 0;
        for (int p = 0; p < npairs; ++p) {
            count += *(const int *) (ids + (p % n_used) * nb_ids0 + (p / n_used) * nb_ids1) == e;
        }
        bounds[e + 1] = count;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        bounds[0] = 0;
        for (int e = 0; e < n_expert; ++e) {
            bounds[e + 1] += bounds[e];
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
        int c = bounds[e];
        for (int p = 0; p < npairs; ++p) {  // p = t * n_used + s: (t, s) order
            const int s = p % n_used;
            const int t = p / n_used;
            if (*(const int *) (ids + s * nb_ids0 + t * nb_ids1) == e) {
                ids_src1[c] = t * b_ne1 + s % b_ne1;
                ids_dst[c] = p;
                ++c;
            }
        }
    }
    for (int p = threadIdx.x; p < npairs; p += blockDim.x) {
        if (p >= bounds[n_expert]) {  // the places of the pairs left out: a column the quantizer can read
            ids_src1[p] = 0;
            ids_dst[p] = -1;
        }
        const int s = p % n_used;
        const int t = p / n_used;
        const int id = *(const int *) (ids + s * nb_ids0 + t * nb_ids1);
        if (id < 0 || id >= n_expert) {
            float * out = (float *) ((ggx_u8 *) dst + s * nb_dst1 + t * nb_dst2);
            for (int m = 0; m < M; ++m) {
                out[m] = ggx_nan();
            }
        }
    }
}
