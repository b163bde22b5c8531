"""The CPU kernels, one module per op family. Each exposes `fn(node, n_threads) -> Launch`
wrappers that validate the node and its sources and return the bound call of one numba kernel
(compiled on first use, cached); see `common` for the convention.

This package module itself imports nothing heavy: the device layer reads the type tables below
to answer supports_op without loading numba.
"""
from ggx.types import GType

#: Types rows can be read from (dequantized to F32): GET_ROWS sources, CPY sources are the floats.
LOAD_TYPES = frozenset({GType.F32, GType.F16, GType.BF16, GType.Q4_0, GType.Q4_1, GType.Q5_0, GType.Q8_0,
                        GType.Q8_1, GType.Q4_K, GType.Q6_K, GType.Q8_K})
#: Types F32 rows can be stored as (ggml's reference from_float): SET_ROWS and CPY destinations.
STORE_TYPES = frozenset({GType.F32, GType.F16, GType.BF16, GType.Q4_0, GType.Q4_1, GType.Q5_0, GType.Q8_0})
#: Destinations quantized by the core's numpy quantizer (ggx.quants) after a numba gather to F32:
#: rare as CPY/SET_ROWS targets (KV caches use F16/Q8_0/Q4_0), so not worth numba kernels yet.
SLOW_STORE_TYPES = frozenset({GType.Q4_K, GType.Q6_K})
#: Source types CPY converts from (anything else copies only to its own type).
FLOAT_TYPES = frozenset({GType.F32, GType.F16, GType.BF16})
