"""ggx: a tensor backend framework for Python, built the way ggml's backend layer is built.

Three faces:

- users: this package (`Context` builds graphs, `compute` runs them, `devices` lists devices)
  and `ggx.models`;
- plugin authors: `ggx.plugin`, the plugin API (the modules `backend`, `hookspecs`, `host`,
  `errors`, `types`, `tensor`, plus `Graph`, `Op` and `Launch`): all a plugin builds against;
- the engine behind both, which plugins do not call: `registry`, `sched`, `alloc`,
  `placement`, `eager`, `conformance`, `commands`.
"""
from ._version import __version__
from .eager import compute
from .errors import GGXError, GGXFormatError, GGXOutOfMemory, GGXPluginError, GGXShapeError, GGXUnsupported
from .graph import Context, Graph, build_graph
from .ops import Op
from .tensor import Tensor, TensorFlag
from .types import GType

__all__ = [
    "Context", "GGXError", "GGXFormatError", "GGXOutOfMemory", "GGXPluginError", "GGXShapeError",
    "GGXUnsupported", "GType", "Graph", "Op", "Tensor", "TensorFlag", "__version__", "build_graph",
    "compute", "dequantize", "devices", "quantize",
]


def quantize(array, gtype, name: str = "tensor"):
    """Block bytes (uint8) of `array` in `gtype`, bit-exact with GGUF."""
    from .quants import quantize as q

    return q(array, GType.parse(gtype), name=name)


def dequantize(data, gtype, n: int):
    """float32 values of the first `n` values stored in `data` (uint8 block bytes)."""
    from .quants import dequantize as d

    return d(data, GType.parse(gtype), n)


def devices():
    """Every device of every loaded plugin, accelerators first (loads plugins on first use)."""
    from . import registry

    return registry.devices()
