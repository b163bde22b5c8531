"""ggx-cuda: CUDA devices (CUDA0, ...) through CuPy, kernels compiled at run time with NVRTC."""
__version__ = "0.1.0"
