"""ggx-amx: the AMX extra buffer type (quantized weights in ggml's AMX tile layout, AMX tile kernels)."""
__version__ = "0.1.0"
