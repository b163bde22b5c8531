"""The NMSE bound each ggx-cuda kernel family needs in the conformance suite, declared through the
core's per-device hook (`Device.max_nmse_err`, ggml's max_nmse_err(backend)), never by changing
the core table.

* MMVQ / MMQ (quantized MUL_MAT, ops/mmvq.py, ops/mmq.py) quantize the activations to q8_1 blocks
  (32 values, f16 scale; MMQ's D4 layout a float scale): ggml's bound for activations quantized
  to the weight's vec_dot_type, 5e-4 (the conformance cases, host-run, measure at most 8.3e-5).
* Everything else computes in float (flash attention reads F16 K/V into float, cuBLAS runs with
  F32 compute, the elementwise and row kernels round as the reference does): the core table's
  bounds hold and nothing is declared.
"""
from __future__ import annotations

from ggx.ops import Op
from ggx.types import GType

Q8_1_ACTIVATIONS = (5e-4, "MMVQ / MMQ quantize the activations to q8_1 blocks of 32 (ggml's bound for "
                          "quantized activations)")


def max_nmse_err(op: Op, gtype: GType | None, default: float) -> tuple[float, str] | None:
    """The bound of `op` over characteristic type `gtype`, or None where the core table's holds."""
    if op in (Op.MUL_MAT, Op.MUL_MAT_ID) and gtype is not None and gtype.is_quantized:
        return Q8_1_ACTIVATIONS
    return None
