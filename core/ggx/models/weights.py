"""Loading a model's weights from the GGUF memory map into device buffers, placed per weight.

Each weight gets the first buffer type of the model's list (accelerator, its host type, extra
buffer types such as repack/AMX, plain CPU) whose device supports a representative op reading
the weight from it (ggml's select_buft): mul_mat for matrices, get_rows for the token
embedding, mul for norms, mul_mat_id for expert stacks. Weights of one buffer type share one
buffer. The bytes are copied from the memory map with set_tensor, so buffer types that transform
weights (repack) see the whole tensor at offset 0.
"""
from __future__ import annotations

from ..backend import Buffer, BufferType
from ..graph import Context
from ..placement import alloc_weights
from ..tensor import Tensor, TensorFlag
from ..types import GType
from .gguf_file import GGUFFile
from .hparams import LlamaHParams
from .runner import Runner

#: rows of the dummy activation in the representative op (ggml uses a large batch too, so
#: extra buffer types that only speed up batched products still qualify)
_REPR_TOKENS = 512


def representative_op(w: Tensor, name: str, hp: LlamaHParams) -> Tensor:
    """The op that will read `w` in the llama graph, over a dummy activation (not computed)."""
    ctx = Context()
    if name.endswith("norm.weight"):
        return ctx.mul(ctx.tensor(GType.F32, [w.ne[0], _REPR_TOKENS]), w)
    if name == "token_embd.weight":  # read by get_rows (and, when tied, by the output mul_mat too)
        return ctx.get_rows(w, ctx.tensor(GType.I32, [_REPR_TOKENS]))
    if name.endswith("_exps.weight"):
        n_used = max(hp.n_expert_used, 1)
        return ctx.mul_mat_id(w, ctx.tensor(GType.F32, [w.ne[0], n_used, _REPR_TOKENS]),
                              ctx.tensor(GType.I32, [n_used, _REPR_TOKENS]))
    return ctx.mul_mat(w, ctx.tensor(GType.F32, [w.ne[0], _REPR_TOKENS]))


def load_weights(f: GGUFFile, hp: LlamaHParams, runner: Runner, progress: bool = False,
                 host_experts: bool = False) -> tuple[dict[str, Tensor], list[Buffer]]:
    """Every tensor the graph reads, as leaves in device buffers: (name -> Tensor, buffers).

    `host_experts` keeps MoE expert stacks in host memory (llama.cpp's --cpu-moe): a MUL_MAT_ID
    offloaded to an accelerator then gets only the experts it uses, through the copy callback.
    """
    weights: dict[str, Tensor] = {}
    placed: list[tuple[Tensor, BufferType]] = []
    for name, ne in hp.expected_tensors().items():
        info = f.tensor(name)
        t = Tensor(info.type, ne, name=name)
        t.flags |= TensorFlag.PARAM
        weights[name] = t
        if host_experts and name.endswith("_exps.weight"):
            buft = runner.host_buffer_type()
        else:
            buft = runner.weight_buffer_type(t, representative_op(t, name, hp))
        placed.append((t, buft))
    buffers = alloc_weights(placed)
    total = sum(f.tensor(n).nbytes for n in weights)
    with _progress(progress, total, f"loading {len(weights)} tensors") as advance:
        for name, t in weights.items():
            info = f.tensor(name)
            t.buffer.set_tensor(t, info.data, 0)
            advance(info.nbytes)
    return weights, buffers


class _progress:
    """A rich progress bar over bytes when enabled (and stderr is a terminal), else nothing."""

    def __init__(self, enabled: bool, total: int, what: str):
        self.enabled, self.total, self.what = enabled, total, what
        self.bar = None

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                TimeRemainingColumn(), transient=True)
            self.bar.start()
            task = self.bar.add_task(self.what, total=self.total)
            return lambda n: self.bar.advance(task, n)
        return lambda n: None

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()
