"""ggx-repack: the CPU_REPACK extra buffer type (quantized weights in interleaved SIMD layouts)."""
__version__ = "0.1.0"
