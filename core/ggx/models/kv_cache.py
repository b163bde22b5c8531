"""The KV cache: per layer one F16 K and one F16 V tensor [n_embd_kv, n_ctx] in device memory.

Each layer's K and V live in that layer's buffer type (a model split over devices keeps a
layer's cache on the device that runs the layer, as llama.cpp does); layers sharing a buffer
type share one buffer, so a one-device model has one cache buffer.

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

from collections.abc import Sequence

import numpy as np

from ..alloc import alloc_tensors
from ..backend import Buffer, BufferType
from ..errors import GGXShapeError, GGXStateError
from ..tensor import Tensor
from ..types import GType

KV_PAD = 256  # llama.cpp pads n_kv to 256 as well


class KVCache:
    """`buft`: one buffer type for every layer, or a list with one per layer."""

    def __init__(self, n_layer: int, n_embd_kv: int, n_ctx: int, buft: BufferType | Sequence[BufferType]):
        if n_ctx <= 0:
            raise GGXShapeError(f"KV cache: n_ctx must be positive, got {n_ctx}")
        bufts = [buft] * n_layer if isinstance(buft, BufferType) else list(buft)
        if len(bufts) != n_layer:
            raise GGXShapeError(f"KV cache: {len(bufts)} buffer types for {n_layer} layers")
        self.n_ctx = n_ctx
        self.k = [Tensor(GType.F16, (n_embd_kv, n_ctx), name=f"cache_k_l{i}") for i in range(n_layer)]
        self.v = [Tensor(GType.F16, (n_embd_kv, n_ctx), name=f"cache_v_l{i}") for i in range(n_layer)]
        #: the buffer type of each layer's K and V
        self.bufts: list[BufferType] = bufts
        groups: dict[int, tuple[BufferType, list[Tensor], list[Tensor]]] = {}
        for b, k, v in zip(bufts, self.k, self.v):
            g = groups.setdefault(id(b), (b, [], []))
            g[1].append(k)
            g[2].append(v)
        #: one buffer per distinct buffer type, in order of the first layer using it (its layers'
        #: K tensors, then their V tensors)
        self.buffers: list[Buffer] = [alloc_tensors(b, ks + vs) for b, ks, vs in groups.values()]
        self.n_past = 0
        self.n_zeroed = 0  # slots [0, n_zeroed) were zeroed (or written) since the last clear
        self.clear()

    @property
    def buffer(self) -> Buffer:
        """The cache's buffer, when it has one (every layer in one buffer type)."""
        if len(self.buffers) != 1:
            raise GGXStateError(f"the KV cache is split over {len(self.buffers)} buffers "
                                f"({', '.join(b.buft.name for b in self.buffers)}): use .buffers")
        return self.buffers[0]

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
            t.buffer.memset_tensor(t, 0, lo * row, (n_kv - lo) * row)
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
