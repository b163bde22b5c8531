"""The reference backend: plain numpy, float64, every op of the catalogue — the oracle.

`RefBackendReg` is registered as a built-in by the core registry; its one device is named "ref".
"""
from .device import RefBackend, RefBackendReg, RefDevice

__all__ = ["RefBackend", "RefBackendReg", "RefDevice"]
