"""The scheduler: runs one graph over several backends, as ggml_backend_sched does.

By job: `assign` gives every tensor a backend (passes 1-4), `split` cuts the graph into splits
with copies of their inputs and fixes the allocation order (pass 5; `ggx.alloc` then places the
tensors), `execute` runs the splits (copies, events, errors), and `scheduler` holds the
`Scheduler` that plans, reuses plans, places graphs and owns the compute buffers.
"""
from ..errors import SchedComputeError
from .execute import SchedStats, is_host_weight, tensor_copy
from .scheduler import Scheduler, SplitInfo

__all__ = ["SchedComputeError", "SchedStats", "Scheduler", "SplitInfo", "is_host_weight", "tensor_copy"]
