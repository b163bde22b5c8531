"""MoE weights in host memory: the scheduler copy callback that uploads only the experts a batch uses."""
from __future__ import annotations

import numpy as np

from ..backend import Backend
from ..errors import GGXShapeError
from ..graph import Graph
from ..ops import Op
from ..tensor import Tensor

__all__ = ["MoeExpertUpload"]


class MoeExpertUpload:
    """A copy callback uploading only the experts a MUL_MAT_ID uses (llama.cpp's sched_copy_experts).

    It acts when the split's first node is a MUL_MAT_ID whose expert tensor is `dst`: it reads the
    ids (already copied: weights are copied last), marks the used experts, and uploads each run of
    consecutive used experts with one `set_tensor_async`, plus up to 512 bytes of the next expert
    (kernels that read whole tiles must not meet uninitialized padding). The used set is cached per
    ids tensor and reset at every graph.
    """

    PADDING = 512

    def __init__(self) -> None:
        self.bytes_uploaded = 0
        self.runs: list[tuple[int, int]] = []  # (first, last) expert of each upload, last graph
        self._ids: Tensor | None = None
        self._used: np.ndarray | None = None

    def reset(self) -> None:
        self._ids = None
        self._used = None
        self.runs = []
        self.bytes_uploaded = 0

    def __call__(self, backend: Backend, src: Tensor, dst: Tensor, graph: Graph) -> bool:
        node = next((n for n in graph.nodes if not n.op.is_view), None)
        if node is None or node.op is not Op.MUL_MAT_ID or node.src[0] is not dst:
            return False
        ids = node.src[2]
        if ids.nelements == 0:
            return True
        n_expert = src.ne[2]
        expert_size = src.nb[2]
        if ids is not self._ids or self._used is None or len(self._used) != n_expert:
            raw = backend.get_tensor_async(ids, 0, ids.nbytes)
            backend.synchronize()
            vals = np.ndarray((ids.ne[1], ids.ne[0]), np.int32, raw, 0, (ids.nb[1], ids.nb[0]))
            if vals.size and (vals.min() < 0 or vals.max() >= n_expert):
                raise GGXShapeError(f"MUL_MAT_ID ids {ids.describe()} hold an expert outside 0..{n_expert - 1}")
            used = np.zeros(n_expert, dtype=bool)
            used[vals.reshape(-1)] = True
            self._ids, self._used = ids, used
        used = self._used
        first = 0
        while first < n_expert:
            if not used[first]:
                first += 1
                continue
            last = first
            while last + 1 < n_expert and used[last + 1]:
                last += 1
            offset = first * expert_size
            padding = min(expert_size, self.PADDING) if last < n_expert - 1 else 0
            size = (last + 1 - first) * expert_size + padding
            backend.set_tensor_async(dst, src.data_buffer.get_tensor(src, offset, size), offset)
            self.runs.append((first, last))
            self.bytes_uploaded += size
            first = last + 1
        return True
