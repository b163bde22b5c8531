// A host stand-in for the CUDA device environment, so a kernels/*.cu source (and the common.cuh it
// includes, which leaves the CUDA headers out under GGX_HOST_EMU) compiles with g++ and its kernels
// run on the CPU in tests (cuda_testing.host_build): one fiber (ucontext) per CUDA thread, the
// blocks of a grid one after another, __syncthreads a barrier of the block's fibers and the warp
// shuffles exchanges through a barrier of the warp's fibers (cooperative: the fibers of a block
// take turns on one OS thread, so shared memory needs no locking). __shared__ variables are
// function statics: one copy, reused by each block in turn. Half types are _Float16 / bfloat16 bit
// patterns with CUDA's round-to-nearest-even conversions; the __f*_rn operations are plain float
// operations (built with -ffp-contract=off: nothing is fused). CUDA's math functions (expf, erfcf,
// ...) are glibc's here.
#pragma once

#define GGX_HOST_EMU 1

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

using std::max;
using std::min;

// CUDA's reciprocal square root (2 ulp on a GPU; exact here)
static inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __restrict__

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

// --- bits and float operations ----------------------------------------------------------------------
template <class To, class From> static inline To hc_bits(From v) {
    static_assert(sizeof(To) == sizeof(From), "same size");
    To r;
    std::memcpy(&r, &v, sizeof(r));
    return r;
}

static inline unsigned __float_as_uint(float f) { return hc_bits<unsigned>(f); }
static inline float __uint_as_float(unsigned u) { return hc_bits<float>(u); }
static inline int __float_as_int(float f) { return hc_bits<int>(f); }
static inline float __int_as_float(int i) { return hc_bits<float>(i); }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }

// --- SIMD-in-a-word integer intrinsics -------------------------------------------------------------
// __dp4a(a, b, c): c + the dot product of a's and b's four signed bytes
static inline int hc_dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; ++i) {
        c += (int) (signed char) (a >> (8 * i)) * (int) (signed char) (b >> (8 * i));
    }
    return c;
}

// __vsubss4(a, b): per signed byte a - b, saturated to -128..127
static inline int hc_vsubss4(int a, int b) {
    unsigned int r = 0;
    for (int i = 0; i < 4; ++i) {
        int d = (int) (signed char) (a >> (8 * i)) - (int) (signed char) (b >> (8 * i));
        d = d < -128 ? -128 : (d > 127 ? 127 : d);
        r |= (unsigned int) (unsigned char) d << (8 * i);
    }
    return (int) r;
}

// --- halves ---------------------------------------------------------------------------------------
struct __half {
    unsigned short bits;
};
struct __nv_bfloat16 {
    unsigned short bits;
};

static inline __half __ushort_as_half(unsigned short b) { return __half{b}; }
static inline unsigned short __half_as_ushort(__half h) { return h.bits; }
static inline float __half2float(__half h) { return (float) hc_bits<_Float16>(h.bits); }
static inline __half __float2half_rn(float v) { return __half{hc_bits<unsigned short>((_Float16) v)}; }
static inline float __bfloat162float(__nv_bfloat16 b) { return hc_bits<float>((uint32_t) b.bits << 16); }
static inline __nv_bfloat16 __float2bfloat16_rn(float v) {
    if (v != v) {
        return __nv_bfloat16{(unsigned short) 0x7FC0};
    }
    uint32_t u = hc_bits<uint32_t>(v);
    u += 0x7FFF + ((u >> 16) & 1);
    return __nv_bfloat16{(unsigned short) (u >> 16)};
}

// --- fibers -----------------------------------------------------------------------------------------
struct hc_barrier {
    int n = 0, count = 0;
    unsigned gen = 0;
};

struct hc_fiber {
    ucontext_t ctx;
    dim3 idx;
    bool done = false;
};

static const size_t hc_stack_size = 256 * 1024;
static ucontext_t hc_main;
static std::vector<hc_fiber> hc_fibers;
static std::vector<std::unique_ptr<char[]>> hc_stacks;  // kept from launch to launch, never zeroed
static int hc_cur = 0;
static dim3 blockIdx, blockDim, gridDim;
static hc_barrier hc_block_bar;
static std::vector<hc_barrier> hc_warp_bars;
static std::vector<float> hc_shfl;
static void (*hc_body)(void *) = nullptr;
static void * hc_body_arg = nullptr;

#define threadIdx (hc_fibers[hc_cur].idx)

static inline void hc_yield() { swapcontext(&hc_fibers[hc_cur].ctx, &hc_main); }

static inline void hc_arrive(hc_barrier & b) {
    const unsigned g = b.gen;
    if (++b.count == b.n) {
        b.count = 0;
        b.gen++;
        return;
    }
    while (b.gen == g) {
        hc_yield();
    }
}

static inline void __syncthreads() { hc_arrive(hc_block_bar); }

// the flat index of the running thread is its fiber's (x fastest, then y, z): warps are 32
// consecutive flat indices, as in CUDA
static inline float __shfl_xor_sync(unsigned, float v, int lane_mask, int width = 32) {
    const int t = hc_cur;
    hc_shfl[t] = v;
    hc_arrive(hc_warp_bars[t / 32]);
    const int src = (t & ~(width - 1)) | ((t ^ lane_mask) & (width - 1));
    const float r = hc_shfl[src];
    hc_arrive(hc_warp_bars[t / 32]);
    return r;
}

// The host twin of mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 (D += A B, int8 in, int32 out)
// with PTX's fragment layout, lane = 4 g + c (g = lane / 4, c = lane % 4): a0 holds A[g][4c..4c+3],
// a1 A[g + 8][4c..4c+3] (A 16 x 16, row-major bytes), b0 B[4c..4c+3][g] (B 16 x 8, k-major),
// d0, d1 D[g][2c], D[g][2c + 1] and d2, d3 the same columns of row g + 8.
static std::vector<int> hc_mma_regs;

static inline void hc_mma_m16n8k16_s8(int & d0, int & d1, int & d2, int & d3, int a0, int a1, int b0) {
    const int t = hc_cur;
    const int lane = t % 32;
    const int base = t - lane;
    hc_mma_regs[3 * t] = a0;
    hc_mma_regs[3 * t + 1] = a1;
    hc_mma_regs[3 * t + 2] = b0;
    hc_arrive(hc_warp_bars[t / 32]);
    auto A = [&](int i, int k) {  // A[i][k]
        const int reg = hc_mma_regs[3 * (base + 4 * (i % 8) + k / 4) + (i < 8 ? 0 : 1)];
        return (int) (signed char) (reg >> (8 * (k % 4)));
    };
    auto B = [&](int k, int n) {  // B[k][n]
        return (int) (signed char) (hc_mma_regs[3 * (base + 4 * n + k / 4) + 2] >> (8 * (k % 4)));
    };
    int * d[4] = {&d0, &d1, &d2, &d3};
    for (int e = 0; e < 4; ++e) {
        const int i = lane / 4 + 8 * (e / 2);
        const int n = 2 * (lane % 4) + e % 2;
        int sum = 0;
        for (int k = 0; k < 16; ++k) {
            sum += A(i, k) * B(k, n);
        }
        *d[e] += sum;
    }
    hc_arrive(hc_warp_bars[t / 32]);
}

// the compute capability (ggml's 100 major + 10 minor) the host build emulates where a kernel's
// code depends on the architecture it is compiled for (set per launch by the test harness)
static int hc_cuda_arch = 900;

extern "C" void hc_set_arch(int cc) { hc_cuda_arch = cc; }

// dynamic shared memory (extern __shared__): one buffer of the launch's size, reused by the blocks
// in turn, filled with 0xCD before the launch (no block sees zeros it did not write)
static std::vector<unsigned char> hc_dynamic;

static inline void * hc_dynamic_shared() { return hc_dynamic.data(); }

static void hc_entry(int i) {
    hc_body(hc_body_arg);
    hc_fibers[i].done = true;
}

// Run body(arg) as every thread of every block of the grid.
static void hc_run(dim3 grid, dim3 block, void (*body)(void *), void * arg) {
    const int n = (int) (block.x * block.y * block.z);
    gridDim = grid;
    blockDim = block;
    hc_body = body;
    hc_body_arg = arg;
    hc_fibers.assign(n, hc_fiber{});
    hc_shfl.assign(n, 0.0f);
    hc_mma_regs.assign(3 * n, 0);
    while ((int) hc_stacks.size() < n) {
        hc_stacks.emplace_back(new char[hc_stack_size]);
    }
    for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
    for (unsigned bx = 0; bx < grid.x; ++bx) {
        blockIdx = dim3{bx, by, bz};
        hc_block_bar = hc_barrier{n, 0, 0};
        hc_warp_bars.assign((n + 31) / 32, hc_barrier{});
        for (int w = 0; w < (n + 31) / 32; ++w) {
            hc_warp_bars[w].n = std::min(32, n - 32 * w);
        }
        for (int i = 0; i < n; ++i) {
            hc_fiber & f = hc_fibers[i];
            f.idx = dim3{(unsigned) (i % block.x), (unsigned) (i / block.x % block.y), (unsigned) (i / (block.x * block.y))};
            f.done = false;
            getcontext(&f.ctx);
            f.ctx.uc_stack.ss_sp = hc_stacks[i].get();
            f.ctx.uc_stack.ss_size = hc_stack_size;
            f.ctx.uc_link = &hc_main;
            makecontext(&f.ctx, (void (*)()) hc_entry, 1, i);
        }
        for (bool busy = true; busy;) {
            busy = false;
            for (int i = 0; i < n; ++i) {
                if (!hc_fibers[i].done) {
                    hc_cur = i;
                    swapcontext(&hc_main, &hc_fibers[i].ctx);
                    busy = true;
                }
            }
        }
    }
}

// --- launching a kernel with its arguments as 64-bit slots -------------------------------------------
template <class T> static T hc_arg(unsigned long long s) {
    if constexpr (std::is_pointer_v<T>) {
        return reinterpret_cast<T>((uintptr_t) s);
    } else if constexpr (std::is_same_v<T, float>) {
        return hc_bits<float>((uint32_t) s);
    } else {
        return (T) (long long) s;
    }
}

template <class... P> struct hc_call {
    void (*f)(P...);
    const unsigned long long * slots;

    template <size_t... I> void go(std::index_sequence<I...>) { f(hc_arg<std::remove_cv_t<P>>(slots[I])...); }
    static void run(void * self) { static_cast<hc_call *>(self)->go(std::index_sequence_for<P...>{}); }
};

template <class... P>
static void hc_launch(void (*f)(P...), dim3 grid, dim3 block, unsigned shared, const unsigned long long * slots) {
    hc_call<P...> c{f, slots};
    hc_dynamic.assign(shared, 0xCD);
    hc_run(grid, block, &hc_call<P...>::run, &c);
}
