"""ggx-cpu: the CPU backend of ggx (device "CPU"), numba kernels for every op of the catalogue."""
__version__ = "0.1.0"
