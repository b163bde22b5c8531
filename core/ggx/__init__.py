"""ggx: a tensor backend framework for Python, built the way ggml's backend layer is built."""
from .errors import GGXError, GGXFormatError, GGXOutOfMemory, GGXPluginError, GGXShapeError, GGXUnsupported
from .graph import Context, Graph, build_graph
from .ops import Op
from .tensor import Tensor, TensorFlag
from .types import GType

__version__ = "0.1.0"

__all__ = [
    "Context", "GGXError", "GGXFormatError", "GGXOutOfMemory", "GGXPluginError", "GGXShapeError",
    "GGXUnsupported", "GType", "Graph", "Op", "Tensor", "TensorFlag", "build_graph", "__version__",
]
