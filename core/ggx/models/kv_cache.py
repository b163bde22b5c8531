"""The KV cache: per layer one F16 K and one F16 V tensor [n_embd_kv, n_ctx] in one device buffer.

Slot j holds the keys (values) of the token at position j: row j of each tensor, its n_head_kv
heads of head_dim values side by side. The graph writes new rows in place with set_rows (the
slots are input data, not shapes) and reads the first `n_kv` rows, where `n_kv` is the filled
length rounded up to `KV_PAD` slots: the mask hides the padding, and the graph shape (hence the
scheduler's plan) stays the same for KV_PAD decode steps in a row.

Visible slots that no token has written yet must hold zeros, not leftover or uninitialized
bytes (a masked slot's weight is 0, but 0 * NaN is NaN in the soft_max path). Rather than
zeroing the whole cache on every reset (94 MiB for SmolLM2 at n_ctx 4096: ~0.2 s of page
faults at load), `batch_inputs` zeroes slots as they first become visible after a reset.
"""
from __future__ import annotations

import numpy as np

from ..backend import Buffer, BufferType, BufferUsage
from ..errors import GGXShapeError
from ..tensor import Tensor
from ..types import GType

KV_PAD = 256  # llama.cpp pads n_kv to 256 as well


class KVCache:
    def __init__(self, n_layer: int, n_embd_kv: int, n_ctx: int, buft: BufferType):
        if n_ctx <= 0:
            raise GGXShapeError(f"KV cache: n_ctx must be positive, got {n_ctx}")
        self.n_ctx = n_ctx
        self.k = [Tensor(GType.F16, (n_embd_kv, n_ctx), name=f"cache_k_l{i}") for i in range(n_layer)]
        self.v = [Tensor(GType.F16, (n_embd_kv, n_ctx), name=f"cache_v_l{i}") for i in range(n_layer)]
        tensors = self.k + self.v
        align = buft.alignment
        offsets, size = [], 0
        for t in tensors:
            size = (size + align - 1) // align * align
            offsets.append(size)
            size += buft.get_alloc_size(t)
        self.buffer: Buffer = buft.alloc_buffer(size)
        self.buffer.usage = BufferUsage.ANY
        for t, off in zip(tensors, offsets):
            t.buffer, t.offset = self.buffer, off
            self.buffer.init_tensor(t)
        self.n_past = 0
        self.n_zeroed = 0  # slots [0, n_zeroed) were zeroed (or written) since the last clear
        self.clear()

    def clear(self) -> None:
        """Forget every token; slots are zeroed again as they become visible (`batch_inputs`)."""
        self.n_past = 0
        self.n_zeroed = 0

    def _zero_slots(self, n_kv: int) -> None:
        """Zero slots [n_zeroed, n_kv) of every layer's K and V."""
        lo = self.n_zeroed
        if n_kv <= lo:
            return
        for t in self.k + self.v:
            row = t.nb[1]
            self.buffer.memset_tensor(t, 0, lo * row, (n_kv - lo) * row)
        self.n_zeroed = n_kv

    def n_kv_for(self, n_filled: int) -> int:
        """Visible slots for a batch ending at `n_filled` tokens: rounded up to KV_PAD, at most n_ctx."""
        if n_filled > self.n_ctx:
            raise GGXShapeError(f"KV cache: {n_filled} tokens do not fit in a context of {self.n_ctx}")
        return min(self.n_ctx, -(-n_filled // KV_PAD) * KV_PAD)

    def batch_inputs(self, n_tokens: int, n_kv: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(pos I32 [T], kv_idx I64 [T], mask F16 numpy (T, n_kv)) for the next `n_tokens` tokens."""
        start = self.n_past
        if start + n_tokens > self.n_ctx:
            raise GGXShapeError(f"KV cache: {start} + {n_tokens} tokens do not fit in a context of {self.n_ctx}")
        self._zero_slots(n_kv)
        pos = np.arange(start, start + n_tokens, dtype=np.int32)
        slots = np.arange(n_kv)
        mask = np.where(slots[None, :] <= pos[:, None], 0.0, -np.inf).astype(np.float16)  # causal
        return pos, pos.astype(np.int64), mask
