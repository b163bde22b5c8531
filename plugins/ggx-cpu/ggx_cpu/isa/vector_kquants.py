"""Q4_K and Q6_K dot products on SIMD vectors (ggml's vec_dot_q4_K_q8_K / vec_dot_q6_K_q8_K),
one source for every vector ISA, as `ggx_cpu.isa.vector` is for Q4_0/Q4_1/Q8_0.

Functions here replace `ggx_cpu.isa.portable`'s of the same name under a vector ISA (see
`ggx_cpu.kernels.matmul._vector_impl`); same signatures and layouts as there.
"""
