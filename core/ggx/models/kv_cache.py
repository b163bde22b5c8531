"""The KV cache: per layer one F16 K and one F16 V tensor [n_embd_kv, slots] in device memory.

Each layer's K and V live in that layer's buffer type (a model split over devices keeps a
layer's cache on the device that runs the layer, as llama.cpp does); layers sharing a buffer
type share one buffer, so a one-device model has one cache buffer.

Layers come in up to two groups, each with its own slots (llama.cpp's iSWA cache):
- full-context layers: `n_ctx` slots, slot j holds the token at position j;
- sliding-window layers (a model with `n_swa` > 0): a query at position p sees only keys at
  positions p - n_swa < k <= p, so their group keeps `n_ctx_swa` = n_swa + n_batch slots
  (rounded up to KV_PAD, at most n_ctx) used as a ring: position p goes to slot p % n_ctx_swa,
  and memory does not grow with the context. n_batch more than the window is what lets the
  first token of a batch still see its window while the batch's later tokens overwrite the
  oldest slots (the batch's K and V are written before its attention reads them).
  `swa_full` gives this group n_ctx slots too (llama.cpp's swa_full): same results, more memory.
Each row of a slot holds n_head_kv heads of head_dim values side by side. The graph writes new
rows in place with set_rows (the slots are input data, not shapes) and reads a group's first
`n_kv` slots: its filled length rounded up to KV_PAD, at most its size. The mask hides padding,
slots of later positions and keys outside the window, so the graph shape (hence the
scheduler's plan) stays the same for KV_PAD decode steps in a row, and for good once the ring
is full.

Several sequences (`n_seq` > 1, the server's parallel slots): each sequence id owns a region of
every group, `n_ctx // n_seq` slots of the full-context layers and its own sliding-window ring,
in the same tensors (llama.cpp's cache with one stream per sequence). A sequence's tokens go to
its region only, and its mask covers its region only, so it sees its own cells and nothing
else; sequences are added (`seq_add`), cleared (`seq_clear`) and removed (`seq_rm`)
independently. A sequence reads its region exactly as a one-sequence cache of that size would
(the same slots in the same order, the same n_kv), which is what makes a sequence's attention
independent of its neighbours (ggx.models.batched). A one-sequence cache holds sequence 0 from
the start and `plan`/`commit`/`n_past` work on it.

Visible slots that no token has written yet must hold zeros, not leftover or uninitialized
bytes (a masked slot's weight is 0, but 0 * NaN is NaN in the soft_max path). Rather than
zeroing the whole cache on every reset (94 MiB for SmolLM2 at n_ctx 4096: ~0.2 s of page
faults at load), `plan` zeroes slots as they first become visible after a reset
(per sequence region).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..alloc import alloc_tensors
from ..backend import Buffer, BufferType
from ..errors import GGXShapeError, GGXStateError
from ..tensor import Tensor
from ..types import GType

KV_PAD = 256  # llama.cpp pads n_kv (and the SWA cache size) to 256 as well


@dataclass
class SlotGroup:
    """The slots shared by a group of layers: `size` slots per sequence, sequence s owning slots
    [s * size, (s + 1) * size); its position p lives in slot s * size + p % size."""

    size: int  # slots per sequence
    window: int  # 0: every earlier position is visible; else only the last `window` positions
    layers: list[int]
    #: cell_pos[j]: the position slot j holds, -1 when empty
    cell_pos: np.ndarray
    #: zeroed[s]: slots [0, zeroed[s]) of sequence s's region were zeroed (or written) since its last clear
    zeroed: list[int] = field(default_factory=lambda: [0])

    @property
    def n_zeroed(self) -> int:
        """Zeroed slots of sequence 0 (the one-sequence cache's)."""
        return self.zeroed[0]

    def n_kv_for(self, n_filled: int) -> int:
        return min(self.size, -(-n_filled // KV_PAD) * KV_PAD)

    def base(self, seq: int) -> int:
        """The first slot of sequence `seq`'s region."""
        return seq * self.size


@dataclass
class GroupBatch:
    """One group's inputs for one sequence's tokens in a batch."""

    n_kv: int  # slots the graph reads, from the region's first slot (`base`)
    kv_idx: np.ndarray  # I64 [T]: the slot of each token (absolute, inside the region)
    mask: np.ndarray  # F16 (T, n_kv): 0 where token t may see slot base + j, -inf elsewhere
    cell_pos: np.ndarray  # the region's cell positions once the batch is written
    base: int = 0  # the region's first slot


@dataclass
class CacheBatch:
    """What one sequence's tokens in a batch need from the cache: the graph's shapes and its input
    data. A batch of several sequences is a list of these, one per sequence."""

    start: int  # position of the batch's first token
    pos: np.ndarray  # I32 [T]
    full: GroupBatch  # full-context layers
    swa: GroupBatch | None  # sliding-window layers (None: the model has none)
    seq: int = 0

    @property
    def n_tokens(self) -> int:
        return int(self.pos.size)

    @property
    def n_kv(self) -> int:
        return self.full.n_kv

    @property
    def n_kv_swa(self) -> int:
        return self.swa.n_kv if self.swa is not None else 0


class KVCache:
    """`buft`: one buffer type for every layer, or a list with one per layer.

    `swa_layers[il]` marks the sliding-window layers of a model with window `n_swa`; `n_batch`
    is the most tokens a batch will hold (it sizes their ring, see the module docstring).
    `n_seq` sequences share the `n_ctx` slots of the full-context layers, n_ctx // n_seq each.
    """

    def __init__(self, n_layer: int, n_embd_kv: int, n_ctx: int, buft: BufferType | Sequence[BufferType],
                 swa_layers: Sequence[bool] = (), n_swa: int = 0, n_batch: int = 512, swa_full: bool = False,
                 n_seq: int = 1):
        if n_ctx <= 0:
            raise GGXShapeError(f"KV cache: n_ctx must be positive, got {n_ctx}")
        if n_batch <= 0:
            raise GGXShapeError(f"KV cache: n_batch must be positive, got {n_batch}")
        if not 1 <= n_seq <= n_ctx:
            raise GGXShapeError(f"KV cache: n_seq must be in 1..n_ctx ({n_ctx}), got {n_seq}")
        bufts = [buft] * n_layer if isinstance(buft, BufferType) else list(buft)
        if len(bufts) != n_layer:
            raise GGXShapeError(f"KV cache: {len(bufts)} buffer types for {n_layer} layers")
        swa = [bool(s) for s in swa_layers] if n_swa > 0 else []
        if swa and len(swa) != n_layer:
            raise GGXShapeError(f"KV cache: {len(swa)} sliding-window flags for {n_layer} layers")
        self.n_seq = n_seq
        #: the context of each sequence (the whole n_ctx for one sequence)
        self.n_ctx_seq = n_ctx // n_seq
        self.n_ctx = self.n_ctx_seq * n_seq
        self.n_batch = n_batch
        per_seq = self.n_ctx_seq
        #: slots of the sliding-window layers per sequence (n_ctx_seq when there are none, or with swa_full)
        self.n_ctx_swa = per_seq if swa_full or not any(swa) else min(per_seq, -(-(n_swa + n_batch) // KV_PAD) * KV_PAD)
        self.full = SlotGroup(per_seq, 0, [il for il in range(n_layer) if not (swa and swa[il])],
                              np.full(self.n_ctx, -1, np.int64), [0] * n_seq)
        self.swa: SlotGroup | None = None
        if any(swa):
            self.swa = SlotGroup(self.n_ctx_swa, n_swa, [il for il in range(n_layer) if swa[il]],
                                 np.full(self.n_ctx_swa * n_seq, -1, np.int64), [0] * n_seq)
        slots = [self.n_ctx_swa * n_seq if swa and swa[il] else self.n_ctx for il in range(n_layer)]
        self.k = [Tensor(GType.F16, (n_embd_kv, slots[i]), name=f"cache_k_l{i}") for i in range(n_layer)]
        self.v = [Tensor(GType.F16, (n_embd_kv, slots[i]), name=f"cache_v_l{i}") for i in range(n_layer)]
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
        self._past = [0] * n_seq
        #: which sequence ids are added (a one-sequence cache holds sequence 0 from the start)
        self.in_use = [n_seq == 1] + [False] * (n_seq - 1)
        self.clear()

    @property
    def buffer(self) -> Buffer:
        """The cache's buffer, when it has one (every layer in one buffer type)."""
        if len(self.buffers) != 1:
            raise GGXStateError(f"the KV cache is split over {len(self.buffers)} buffers "
                                f"({', '.join(b.buft.name for b in self.buffers)}): use .buffers")
        return self.buffers[0]

    @property
    def groups(self) -> list[SlotGroup]:
        return [self.full] if self.swa is None else [self.full, self.swa]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)

    @property
    def n_past(self) -> int:
        """Tokens of sequence 0 (the one-sequence cache's sequence)."""
        return self._past[0]

    # --- sequences ------------------------------------------------------------------------------
    def seq_pos(self, seq: int) -> int:
        """Tokens sequence `seq` holds (the position its next token takes)."""
        self._check_seq(seq)
        return self._past[seq]

    def seq_add(self) -> int:
        """A free sequence id, now in use and empty; GGXStateError when all n_seq are in use."""
        for s, used in enumerate(self.in_use):
            if not used:
                self.in_use[s] = True
                self.seq_clear(s)
                return s
        raise GGXStateError(f"KV cache: all {self.n_seq} sequences are in use")

    def seq_rm(self, seq: int) -> None:
        """Forget sequence `seq` and free its id (the other sequences are untouched)."""
        self.seq_clear(seq)
        self.in_use[seq] = False

    def seq_clear(self, seq: int) -> None:
        """Forget the tokens of sequence `seq` (it stays in use); its slots are zeroed again as
        they become visible."""
        self._check_seq(seq)
        self._past[seq] = 0
        for g in self.groups:
            g.cell_pos[g.base(seq): g.base(seq) + g.size] = -1
            g.zeroed[seq] = 0

    def seq_keep(self, seq: int, n: int) -> bool:
        """Keep the first `n` tokens of sequence `seq` and forget the rest (llama.cpp's
        seq_rm(seq, n, -1)), so that a sequence sharing that prefix goes on from it instead of
        being evaluated again. False, changing nothing, when a sliding-window ring no longer
        holds the window the next position needs (later positions overwrote it)."""
        self._check_seq(seq)
        if not 0 <= n <= self._past[seq]:
            raise GGXShapeError(f"KV cache: cannot keep {n} tokens of a sequence of {self._past[seq]}")
        for g in self.groups:
            if g.window and g.size < self.n_ctx_seq:
                need = np.arange(max(0, n - g.window + 1), n)
                if (g.cell_pos[g.base(seq) + need % g.size] != need).any():
                    return False
        for g in self.groups:
            region = g.cell_pos[g.base(seq): g.base(seq) + g.size]  # a view: cleared in place
            region[region >= n] = -1
        self._past[seq] = n
        return True

    def _check_seq(self, seq: int) -> None:
        if not (isinstance(seq, int) and 0 <= seq < self.n_seq):
            raise GGXShapeError(f"KV cache: sequence id {seq!r} is outside 0..{self.n_seq - 1}")

    def clear(self) -> None:
        """Forget every token of every sequence; slots are zeroed again as they become visible (`plan`)."""
        for s in range(self.n_seq):
            self.seq_clear(s)

    def _zero_slots(self, g: SlotGroup, seq: int, n_kv: int) -> None:
        """Zero slots [zeroed, n_kv) of sequence seq's region in the group's layers' K and V."""
        lo = g.zeroed[seq]
        if n_kv <= lo:
            return
        base = g.base(seq)
        for il in g.layers:
            for t in (self.k[il], self.v[il]):
                row = t.nb[1]
                t.buffer.memset_tensor(t, 0, (base + lo) * row, (n_kv - lo) * row)
        g.zeroed[seq] = n_kv

    def n_kv_for(self, n_filled: int) -> int:
        """Visible slots of the full-context layers for a batch ending at `n_filled` tokens of a
        sequence: rounded up to KV_PAD, at most n_ctx_seq."""
        if n_filled > self.n_ctx_seq:
            raise GGXShapeError(f"KV cache: {n_filled} tokens do not fit in a context of {self.n_ctx_seq}")
        return self.full.n_kv_for(n_filled)

    def plan(self, n_tokens: int, seq: int = 0) -> CacheBatch:
        """The inputs of sequence `seq`'s next `n_tokens` tokens (appended after its last);
        `commit` records them."""
        self._check_seq(seq)
        if not self.in_use[seq]:
            raise GGXStateError(f"KV cache: sequence {seq} is not in use (seq_add gives one)")
        start = self._past[seq]
        if n_tokens <= 0:
            raise GGXShapeError(f"KV cache: a batch needs at least one token, got {n_tokens}")
        if start + n_tokens > self.n_ctx_seq:
            raise GGXShapeError(f"KV cache: {start} + {n_tokens} tokens do not fit in a context of {self.n_ctx_seq}")
        if self.swa is not None and self.swa.size < self.n_ctx_seq and n_tokens + self.swa.window - 1 > self.swa.size:
            raise GGXShapeError(f"KV cache: a batch of {n_tokens} tokens is more than the sliding-window ring "
                                f"of {self.swa.size} slots holds with a window of {self.swa.window} "
                                f"(at most {self.n_batch} tokens per batch)")
        pos = np.arange(start, start + n_tokens, dtype=np.int32)
        groups = [self._group_batch(g, seq, pos) for g in self.groups]
        return CacheBatch(start, pos, groups[0], groups[1] if len(groups) > 1 else None, seq)

    def _group_batch(self, g: SlotGroup, seq: int, pos: np.ndarray) -> GroupBatch:
        n_kv = g.n_kv_for(int(pos[-1]) + 1)
        self._zero_slots(g, seq, n_kv)
        base = g.base(seq)
        local = pos.astype(np.int64) % g.size
        cell_pos = g.cell_pos[base: base + g.size].copy()
        cell_pos[local] = pos
        held = cell_pos[:n_kv][None, :]
        q = pos[:, None].astype(np.int64)
        visible = (held >= 0) & (held <= q)
        if g.window:
            visible &= q - held < g.window
        mask = np.where(visible, 0.0, -np.inf).astype(np.float16)
        return GroupBatch(n_kv, local + base, mask, cell_pos, base)

    def commit(self, batch: CacheBatch, n_tokens: int | None = None) -> None:
        """Record that `batch` was written (its graph ran). With `n_tokens`, only its first
        n_tokens tokens count: the rest were padding (a prompt evaluated as a longer batch, see
        `Model`), whose slots are left empty, masked for every later token and written again by
        the tokens that take those positions."""
        seq = batch.seq
        if batch.start != self._past[seq]:
            raise GGXStateError(f"KV cache: a batch planned at position {batch.start} committed at {self._past[seq]}")
        n = batch.n_tokens if n_tokens is None else n_tokens
        if not 0 < n <= batch.n_tokens:
            raise GGXShapeError(f"KV cache: cannot commit {n} tokens of a batch of {batch.n_tokens}")
        for g, gb in ((self.full, batch.full), (self.swa, batch.swa)):
            if g is None or gb is None:
                continue
            cell_pos = gb.cell_pos
            if n < batch.n_tokens:
                cell_pos = cell_pos.copy()
                cell_pos[gb.kv_idx[n:] - gb.base] = -1
            if cell_pos.size == g.cell_pos.size:  # one sequence: the batch's array becomes the group's
                g.cell_pos = cell_pos
            else:
                g.cell_pos[gb.base: gb.base + g.size] = cell_pos
        self._past[seq] += n
