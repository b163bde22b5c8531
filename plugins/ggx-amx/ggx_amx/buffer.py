"""AMX: the extra buffer type holding weights in ggml's AMX tile layout (ggml-cpu/amx/amx.cpp).

- `set_tensor` packs a whole tensor (offset 0, all of its ggml bytes) into the layout of
  layout.py; `get_alloc_size` is the packed size (Q8_0 and Q4_K tiles are larger than their
  blocks). The layout is not ggml's block layout, so the type is not host memory (`is_host`
  False) and the buffer is write-only: `get_tensor` raises GGXUnsupported, `cpy_tensor`
  declines; `memset_tensor` / `clear` fill raw bytes, as ggml's AMX buffer does.
- `supports_op` is ggml's: MUL_MAT whose weight (not a view) lives here, of a type with AMX
  kernels (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K), output rows (the weight's rows) divisible by 32, K
  divisible by 32 (256 for the K-quants), contiguous F32 activations in host memory, F32
  destination. ggx also takes MUL_MAT_ID (3-D expert weights, the same rules per expert), which
  ggml's AMX type does not. The verdict is kept per op node.
- `prepare_forward`: a launch for every op supports_op accepted (no CPU kernel can read the
  layout): one compiled call, `kernels.amx_mm`, on the engine this type was made for: "amx" (the
  tile instructions) or "emulated" (`GGX_AMX_EMULATE=1`: the same tiling loop with the tile
  instructions modeled in software, for testing; its name says so: AMX_EMULATED).
"""
from __future__ import annotations

import numpy as np

from ggx.backend import Device, Launch
from ggx.errors import GGXUnsupported
from ggx.host import TransformedBuffer, tensor_array
from ggx.ops import Op
from ggx.tensor import Tensor
from ggx_cpu.extension import Deferred
from ggx_cpu.traits import CpuExtraBufferType, expert_offsets

from .layout import TileFormat, pack, tile_format

NAMES = {"amx": "AMX", "emulated": "AMX_EMULATED"}
ROWS_MULTIPLE = 32  # output rows per kernel task (ggml: op->ne[0] % (TILE_N * 2) == 0)


class AmxBuffer(TransformedBuffer):
    """Host memory holding weights in the AMX layout; write-only (see the module docstring)."""

    transformed = "packed into AMX tiles"

    def transform(self, tensor: Tensor, data: np.ndarray) -> np.ndarray:
        why = self.buft.why_not_weight(tensor)
        if why is not None:
            raise GGXUnsupported(f"{self.buft.name}: {why}; keep it in the plain CPU buffer")
        return pack(tensor.type, data, tensor.ne)


class AmxBufferType(CpuExtraBufferType):
    """The AMX extra buffer type of one CPU device, running `engine` ("amx" or "emulated")."""

    buffer_class = AmxBuffer

    def __init__(self, device: Device, engine: str):
        if engine not in NAMES:
            raise GGXUnsupported(f"AMX: unknown engine {engine!r} ({', '.join(NAMES)})")
        super().__init__(device)
        self.engine = engine
        self.name = NAMES[engine]
        self.emulated = engine == "emulated"  # never timed (`ggx tune`), as benchmarks/amx.py

    def why_not_weight(self, t: Tensor) -> str | None:
        """Why weight `t` cannot be packed here (None: it can)."""
        fmt = tile_format(t.type)
        if fmt is None:
            return f"{t.describe()}: no AMX kernel for {t.type.name} (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K)"
        if t.ne[1] % ROWS_MULTIPLE:
            return f"{t.describe()}: {t.ne[1]} rows, not a multiple of {ROWS_MULTIPLE}"
        if t.ne[0] % fmt.block_size:
            return f"{t.describe()}: K = {t.ne[0]} is not a multiple of {fmt.block_size}"
        if t.ne[3] != 1:
            return f"{t.describe()} is 4-D"
        return None

    def get_alloc_size(self, tensor: Tensor) -> int:
        fmt = tile_format(tensor.type)
        if fmt is None or tensor.view_src is not None or tensor.ne[1] % 16:
            return tensor.nbytes
        return max(tensor.nbytes, fmt.packed_nbytes(tensor.ne))

    # --- ops ------------------------------------------------------------------------------------
    def refusal(self, op: Tensor) -> str | None:
        why = self.why_not_weight(op.src[0])
        if why is not None:
            return why
        if not op.src[1].is_contiguous() or not op.is_contiguous():  # ggml: ggml_is_contiguous(src1)
            return f"activations {op.src[1].describe()} and destination {op.describe()} must be contiguous"
        return None

    def bind(self, op: Tensor, n_threads: int) -> Launch:
        a = op.src[0]
        w = a.data_buffer.packed_bytes()
        fmt = tile_format(a.type)
        if op.op is Op.MUL_MAT_ID:  # columns grouped by the ids' values: planned at every compute
            return Deferred(_made_id, op, fmt, w, self.engine, n_threads)
        x = tensor_array(op.src[1]).reshape(-1, a.ne[0])
        cols = np.arange(x.shape[0], dtype=np.int64)
        return _bind(fmt, self.engine, w, np.array([a.data_offset], np.int64), a.ne, x,
                     np.array([0, x.shape[0]], np.int64), cols, cols, True, tensor_array(op).reshape(-1), n_threads)


def _made_id(op: Tensor, fmt: TileFormat, w: np.ndarray, engine: str, n_threads: int) -> Launch:
    """MUL_MAT_ID's launch, made at every compute: the used experts' columns from the ids (checked)."""
    a, b = op.src[0], op.src[1]
    wg, cols = expert_offsets(op, fmt.packed_nbytes((a.ne[0], a.ne[1], 1, 1)))
    x = tensor_array(b).reshape(-1, a.ne[0])
    return _bind(fmt, engine, w, wg, a.ne, x, cols.cstart, cols.ycol, cols.slot, False, tensor_array(op).reshape(-1),
                 n_threads)


def _bind(fmt: TileFormat, engine: str, w: np.ndarray, wg: np.ndarray, ne: tuple[int, ...], x: np.ndarray,
          cstart: np.ndarray, ycol: np.ndarray, ocol: np.ndarray, direct: bool, out: np.ndarray,
          n_threads: int) -> Launch:
    """ggx-cpu's quantizer of the activation rows x [n, K] (to the weight's vec_dot_type), then
    `kernels.amx_mm` over the tasks (`kernels.tasks`), a split kernel: ggx-cpu's backend runs it
    as jobs of its worker threads for one token (fused with the rest of a decode step, as
    CPU_REPACK's products), as a parallel region for a batch."""
    import numba

    from ggx_cpu.extension import act_launch, in_order, split, token

    from .kernels import BLOCK, amx_mm, tasks
    from .tiles import engine as engine_token
    from .tiles import tile_config

    n = max(1, min(n_threads, numba.config.NUMBA_NUM_THREADS))
    act, quantize = act_launch(x, fmt.gtype.vec_dot_type, n)
    mm = split(amx_mm, token(), engine_token(engine), fmt, w, wg, ne[0], ne[1], act.qs, act.d, act.s, act.s4,
               cstart, ycol, ocol, direct, tile_config(), out, *tasks(cstart, ne[1] // BLOCK), parts=n)
    return in_order(quantize, mm)
