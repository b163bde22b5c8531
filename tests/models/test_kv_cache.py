"""The multi-sequence KV cache: sequence ids, one region each, masks that see one's own cells only."""
from __future__ import annotations

import numpy as np
import pytest

from ggx import registry
from ggx.errors import GGXShapeError, GGXStateError
from ggx.models.kv_cache import KV_PAD, KVCache


def _cache(n_seq: int, n_ctx: int = 1024, **kw) -> KVCache:
    buft = registry.get_device("ref").buffer_type()
    return KVCache(2, 8, n_ctx, buft, n_seq=n_seq, **kw)


def test_one_sequence_cache_holds_sequence_0():
    c = _cache(1)
    assert c.in_use == [True] and c.n_ctx_seq == 1024
    b = c.plan(5)
    assert b.seq == 0 and b.full.base == 0 and b.full.kv_idx.tolist() == [0, 1, 2, 3, 4]
    c.commit(b)
    assert c.n_past == 5
    with pytest.raises(GGXStateError, match="all 1 sequences"):
        c.seq_add()


def test_sequences_are_added_removed_and_cleared_independently():
    c = _cache(3, n_ctx=3 * 512)
    assert c.n_ctx_seq == 512 and c.in_use == [False] * 3
    with pytest.raises(GGXStateError, match="not in use"):
        c.plan(1, 0)
    a, b = c.seq_add(), c.seq_add()
    assert (a, b) == (0, 1)
    c.commit(c.plan(4, a))
    pb = c.plan(3, b)
    assert pb.full.base == 512 and pb.full.kv_idx.tolist() == [512, 513, 514]
    c.commit(pb)
    assert c.seq_pos(a) == 4 and c.seq_pos(b) == 3
    # each sequence's mask covers its own region: it sees its own earlier tokens only
    nxt = c.plan(1, a)
    assert nxt.full.n_kv == KV_PAD and nxt.full.mask.shape == (1, KV_PAD)
    assert np.isfinite(nxt.full.mask[0, :5]).all() and np.isinf(nxt.full.mask[0, 5:]).all()
    c.seq_clear(b)
    assert c.seq_pos(b) == 0 and c.seq_pos(a) == 4 and (c.full.cell_pos[512:1024] == -1).all()
    c.seq_rm(a)
    assert c.in_use == [False, True, False] and c.seq_add() == 0 and c.seq_pos(0) == 0
    with pytest.raises(GGXShapeError, match="outside 0..2"):
        c.seq_pos(3)
    with pytest.raises(GGXShapeError, match="do not fit in a context of 512"):
        c.plan(513, 1)


def test_a_commit_touches_its_own_region_only():
    c = _cache(2, n_ctx=512)
    s0, s1 = c.seq_add(), c.seq_add()
    c.commit(c.plan(10, s0))
    before = c.full.cell_pos[256:].copy()
    c.commit(c.plan(8, s0), 3)  # padding: only 3 tokens count
    assert np.array_equal(c.full.cell_pos[256:], before) and c.seq_pos(s0) == 13
    assert c.full.cell_pos[:256].max() == 12 and (c.full.cell_pos[13:256] == -1).all()
    assert c.seq_pos(s1) == 0


def test_each_sequence_has_its_own_sliding_window_ring():
    c = _cache(2, n_ctx=2048, swa_layers=[True, False], n_swa=6, n_batch=16)
    assert c.n_ctx_swa == KV_PAD and c.k[0].ne[1] == 2 * KV_PAD and c.k[1].ne[1] == 2048
    s0, s1 = c.seq_add(), c.seq_add()
    for _ in range(19):
        c.commit(c.plan(16, s1))
    b = c.plan(2, s1)  # positions 304, 305 wrap around the ring of sequence 1
    assert b.swa.kv_idx.tolist() == [KV_PAD + 304 % KV_PAD, KV_PAD + 305 % KV_PAD]
    assert b.full.kv_idx.tolist() == [1024 + 304, 1024 + 305]
    assert (np.isfinite(b.swa.mask).sum(axis=1) == [6, 6]).all()  # the window only
    assert c.seq_pos(s0) == 0 and (c.swa.cell_pos[:KV_PAD] == -1).all()


def test_seq_keep_forgets_the_tail_of_one_sequence():
    c = _cache(2, n_ctx=2 * 512)
    a, b = c.seq_add(), c.seq_add()
    c.commit(c.plan(10, a))
    c.commit(c.plan(6, b))
    assert c.seq_keep(a, 4)
    assert c.seq_pos(a) == 4 and c.seq_pos(b) == 6
    region = c.full.cell_pos[:512]
    assert region[:4].tolist() == [0, 1, 2, 3] and (region[4:] == -1).all()
    assert c.full.cell_pos[512:518].tolist() == list(range(6))  # the other sequence is untouched
    nxt = c.plan(1, a)  # the next token takes position 4 and sees 0..4 only
    assert nxt.pos.tolist() == [4] and np.isfinite(nxt.full.mask[0, :5].astype(np.float32)).all()
    assert np.isinf(nxt.full.mask[0, 5:].astype(np.float32)).all()
    with pytest.raises(GGXShapeError, match="cannot keep 7 tokens of a sequence of 4"):
        c.seq_keep(a, 7)


def test_seq_keep_refuses_a_window_the_ring_overwrote():
    # sliding layer 0 (window 4) in a ring of KV_PAD slots, full-context layer 1
    c = KVCache(2, 8, 1024, registry.get_device("ref").buffer_type(), swa_layers=(True, False), n_swa=4, n_batch=8)
    assert c.swa.size == KV_PAD
    for _ in range(300 // 4):
        c.commit(c.plan(4))
    assert c.n_past == 300
    assert not c.seq_keep(0, 40)  # positions 37..39 were overwritten by 293..295
    assert c.n_past == 300  # refused: nothing changed
    assert c.seq_keep(0, 290)  # 287..289 are still in the ring
    assert c.n_past == 290 and (c.swa.cell_pos < 290).all() and c.swa.cell_pos.max() == 289
