"""What extra buffer types' matmul kernels share: expert_columns (MUL_MAT_ID's columns grouped by
expert) and matmul_problem (the checks of a node around its weight)."""
from __future__ import annotations

import numpy as np
import pytest

from ggx.errors import GGXShapeError
from ggx_cpu.extension import expert_columns


@pytest.mark.parametrize("b_ne1", [1, 2])
def test_columns_by_expert(b_ne1):
    ids = np.array([[3, 0], [1, 1], [0, 3]])  # [n_tokens, n_used]; expert 2 unused, 1 twice in token 1
    cols = expert_columns(ids, 4, b_ne1)
    assert cols.used.tolist() == [0, 1, 3] and cols.cstart.tolist() == [0, 2, 4, 6]
    # within an expert, slots keep their order (s = t * n_used + e)
    assert cols.slot.tolist() == [1, 4, 2, 3, 0, 5]
    for g, e in enumerate(cols.used):
        for c in range(cols.cstart[g], cols.cstart[g + 1]):
            t, j = divmod(int(cols.slot[c]), 2)
            assert ids[t, j] == e and cols.ycol[c] == t * b_ne1 + j % b_ne1


def test_bad_ids_are_named():
    with pytest.raises(GGXShapeError, match=r"ids\[1, 2\] = -1 is not an expert \(0..3\)"):
        expert_columns(np.array([[0, 1], [2, 3], [0, -1]]), 4, 1)


def test_matmul_problem():
    from ggx import registry
    from ggx.alloc import alloc_tensors
    from ggx.graph import Context
    from ggx.types import GType
    from ggx_cpu.extension import matmul_problem

    buft = registry.get_device("CPU").buffer_type()
    ctx = Context()
    w, w3 = ctx.tensor(GType.Q4_0, (64, 32), "w"), ctx.tensor(GType.Q4_0, (64, 32, 4), "w3")
    x = ctx.tensor(GType.F32, (64, 5), "x")
    assert "is not in CPU" in matmul_problem(ctx.mul_mat(w, x), buft)
    alloc_tensors(buft, [w, w3])
    assert matmul_problem(ctx.mul_mat(w, x), buft) is None
    ids = ctx.tensor(GType.I32, (2, 5), "ids")
    assert matmul_problem(ctx.mul_mat_id(w3, ctx.tensor(GType.F32, (64, 1, 5)), ids), buft) is None
    assert "not a matmul" in matmul_problem(ctx.get_rows(w, ctx.tensor(GType.I32, (2,))), buft)
    assert "is not 2-D" in matmul_problem(ctx.mul_mat(w3, ctx.tensor(GType.F32, (64, 5, 4))), buft)
