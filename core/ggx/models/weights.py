"""Loading a model's weights from the GGUF memory map into device buffers, placed per weight.

Each weight gets the first buffer type of the model's list (accelerator, its host type, extra
buffer types such as repack/AMX, plain CPU) whose device supports a representative op reading
the weight from it (ggml's select_buft): mul_mat for matrices, get_rows for the token
embedding, mul for norms, mul_mat_id for expert stacks.

Weights a device's own plain host buffer type takes are mapped, not copied (ggml's CPU_Mapped,
`use_mmap`): the device wraps the file's memory map with `buffer_from_host_ptr`, and each such
weight is a view of its bytes in the file, read from the page cache on demand. The others
(transformed by an extra buffer type, fused from several tensors, on a device with memory of its
own, or everything with `use_mmap=False`) share one buffer per buffer type and are copied from the
map with set_tensor (whole tensors at offset 0: buffer types that transform weights see them
whole); the file's pages they were copied from are let go of (`GGUFFile.release`), so a weight
does not count twice in the process's resident memory.

A model split over several devices (`placement.layer_split`) gives each weight its own list:
`split_bufts` maps a weight to its layer by the `blk.{il}.` of its name, so a layer's weights
try its device's buffer types, then the host CPU's; the token embedding stays in host memory
and output_norm / output.weight go with the output layer.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..backend import Buffer, BufferType, BufferUsage, Device
from ..graph import Context
from ..placement import COPY_MARGIN, MARGIN, BuftChooser, LayerSplit, PlacementReport, alloc_weights
from ..tensor import Tensor, TensorFlag
from ..types import GType
from .gguf_file import GGUFFile
from .hparams import HParams

#: rows of the dummy activation in the representative op (ggml uses a large batch too, so
#: extra buffer types that only speed up batched products still qualify)
_REPR_TOKENS = 512


def representative_op(w: Tensor, name: str, hp: HParams) -> Tensor:
    """The op that will read `w` in the model graph, over a dummy activation (not computed)."""
    ctx = Context()
    if name.endswith("norm.weight"):
        return ctx.mul(ctx.tensor(GType.F32, [w.ne[0], _REPR_TOKENS]), w)
    if name.endswith(".bias"):
        return ctx.add(ctx.tensor(GType.F32, [w.ne[0], _REPR_TOKENS]), w)
    if name.endswith(ROPE_FREQS):  # the frequency factors of the RoPE of Q (and K)
        return ctx.rope(ctx.tensor(GType.F32, [hp.head_dim, hp.n_head, _REPR_TOKENS]),
                        ctx.tensor(GType.I32, [_REPR_TOKENS]), hp.n_rot, hp.rope_mode, freq_factors=w)
    if name == "token_embd.weight":  # read by get_rows (and, when tied, by the output mul_mat too)
        return ctx.get_rows(w, ctx.tensor(GType.I32, [_REPR_TOKENS]))
    if name == OUTPUT:  # a prompt computes its last token's logits only: one row, as a decode step
        return ctx.mul_mat(w, ctx.tensor(GType.F32, [w.ne[0], 1]))
    if name.endswith("_exps.weight"):
        n_used = max(hp.n_expert_used, 1)
        return ctx.mul_mat_id(w, ctx.tensor(GType.F32, [w.ne[0], n_used, _REPR_TOKENS]),
                              ctx.tensor(GType.I32, [n_used, _REPR_TOKENS]))
    return ctx.mul_mat(w, ctx.tensor(GType.F32, [w.ne[0], _REPR_TOKENS]))


EMBD, OUTPUT = "token_embd.weight", "output.weight"
#: Llama 3.1+'s RoPE frequency factors: one tensor in the file, read by every layer
ROPE_FREQS = "rope_freqs.weight"
#: file tensors every layer reads, loaded once per layer as "blk.{il}.{name}" in the layer's
#: buffer type (llama.cpp's TENSOR_DUPLICATED): a layer's ops then read only its own device's
#: memory (the scheduler does not move a ROPE to where its factors are, as ggml's does not)
DUPLICATED = (ROPE_FREQS,)

#: fused weight -> the file's tensors stacked along ne1 (rows), in this order
FUSIONS = {"attn_qkv.weight": ("attn_q.weight", "attn_k.weight", "attn_v.weight"),
           "ffn_gate_up.weight": ("ffn_gate.weight", "ffn_up.weight")}


def fused_sources(f: GGUFFile, hp: HParams) -> dict[str, tuple[str, ...]]:
    """Per layer, which fused weights can be made: the parts share one type (rows just stack)."""
    out: dict[str, tuple[str, ...]] = {}
    for il in range(hp.n_layer):
        for fused, parts in FUSIONS.items():
            names = tuple(f"blk.{il}.{p}" for p in parts)
            if all(n in f.tensors for n in names) and len({f.tensor(n).type for n in names}) == 1:
                out[f"blk.{il}.{fused}"] = names
    return out


_LAYER = re.compile(r"blk\.(\d+)\.")

#: per weight name, the buffer types it may go to, best first
BuftsOf = Callable[[str], Sequence[BufferType]]


def tensor_layer(name: str) -> int | None:
    """The layer index of a per-layer weight ("blk.{il}.attn_q.weight" -> il), else None."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def split_bufts(split: LayerSplit, host: Device, bufts_of: Callable[[Device], Sequence[BufferType]]) -> BuftsOf:
    """The buffer types of each weight under a layer split: `bufts_of(device)` of the device of
    its layer (`blk.{il}.`), of the host for the token embedding (one get_rows row per token:
    llama.cpp keeps it on the CPU too), and of the output device for the rest (output_norm,
    output.weight)."""
    def of(name: str) -> Sequence[BufferType]:
        il = tensor_layer(name)
        if il is not None:
            return bufts_of(split.layers[il])
        return bufts_of(host if name == EMBD else split.output)
    return of


#: file offsets of mapped weights must be multiples of this (ggml's TENSOR_ALIGNMENT; GGUF's
#: default alignment): a view at an odd offset would give kernels misaligned elements
MAPPED_ALIGNMENT = 32


@dataclass
class Weights:
    """A model's weights in device buffers, and where they went."""

    tensors: dict[str, Tensor]  # name -> leaf; a tied output is the embedding's tensor or its copy
    buffers: list[Buffer]  # one WEIGHTS buffer per buffer type used, and one per device mapping the file
    placement: PlacementReport
    #: bytes of weights that are views of the file's memory map (not copied)
    mapped_nbytes: int = 0


def mappable(buft: BufferType) -> bool:
    """Can weights placed in `buft` be views of the file's map? Its device's own plain host
    buffer type, on a device that wraps host memory (ggml: is_default_buft and
    buffer_from_host_ptr supported)."""
    dev = buft.device
    return buft.is_host and dev.caps.buffer_from_host_ptr and buft is dev.buffer_type()


def load_weights(f: GGUFFile, hp: HParams, expected: dict[str, tuple[int, ...]],
                 bufts: Sequence[BufferType] | BuftsOf, host_buft: BufferType,
                 progress: bool = False, host_experts: bool = False, fuse: bool = True,
                 candidates: Sequence[BufferType] | None = None, use_mmap: bool = True,
                 chooser: BuftChooser | None = None) -> Weights:
    """Every tensor the graph reads (`expected`: name -> ne, the architecture's list), as
    leaves in device buffers.

    Each weight goes to the buffer type `chooser` picks among `bufts` (`ggx.placement.buft_list`)
    for its representative op (default: the first that supports it; see `BuftChooser` for
    overrides and measured profiles); `bufts` may instead be a function of the weight's name giving its own
    list (`split_bufts`: a layer split), and `candidates` then lists every buffer type for the
    placement report (default: those lists' buffer types in order of first use). `host_buft`
    is the host memory that `host_experts` keeps expert stacks in.

    `fuse` stacks Q, K, V (and gate, up) of a layer into one weight, so one mul_mat replaces
    three (two): each output row is the same dot product of the same quantized activations, so
    results are bit-identical, and a decode step launches 90 fewer kernels.
    A tied output matrix (no output.weight in the file) is the embedding tensor itself, held
    once, unless it is placed in another buffer type than the embedding: it then gets its own
    copy of token_embd (llama.cpp's TENSOR_DUPLICATED), e.g. repacked for the output, plain for
    get_rows. With a measured profile the embedding's buffer type is its priority choice, left
    only for one faster by `COPY_MARGIN`; without one the priority order decides.
    `host_experts` keeps MoE expert stacks in host memory (llama.cpp's --cpu-moe): a MUL_MAT_ID
    offloaded to an accelerator then gets only the experts it uses, through the copy callback.
    `use_mmap` maps the weights a plain host buffer type takes (see the module docstring); the
    file must then stay unchanged while the weights are used (`GGUFFile.check_unchanged`).
    """
    fused = fused_sources(f, hp) if fuse else {}
    replaced = {n for parts in fused.values() for n in parts}
    shapes = {n: ne for n, ne in expected.items() if n not in replaced}
    sources: dict[str, tuple[str, ...]] = {n: (n,) for n in shapes}
    for name, parts in fused.items():
        shapes[name] = (expected[parts[0]][0], sum(expected[p][1] for p in parts))
        sources[name] = parts
    if hp.tied_output:  # a candidate copy of token_embd for the output mul_mat, kept only if placed apart
        shapes[OUTPUT] = shapes[EMBD]
        sources[OUTPUT] = (EMBD,)
    for name in DUPLICATED:
        if name in shapes:
            ne = shapes.pop(name)
            del sources[name]
            for il in range(hp.n_layer):
                shapes[f"blk.{il}.{name}"], sources[f"blk.{il}.{name}"] = ne, (name,)
    weights: dict[str, Tensor] = {}
    placed: list[tuple[Tensor, BufferType]] = []
    placed_in: dict[str, BufferType] = {}
    refusals: dict[BufferType, str] = {}
    if callable(bufts):
        bufts_of: BuftsOf = bufts
    else:
        every = list(bufts)

        def bufts_of(name: str) -> Sequence[BufferType]:
            return every

        candidates = every if candidates is None else candidates
    chooser = chooser or BuftChooser()
    seen: list[BufferType] = []  # the candidates met, in order (the report's default)
    for name, ne in shapes.items():
        t = Tensor(f.tensor(sources[name][0]).type, ne, name=name)
        t.flags |= TensorFlag.PARAM
        if host_experts and name.endswith("_exps.weight"):
            buft = host_buft
        else:
            mine = bufts_of(name)
            seen.extend(b for b in mine if not any(b is s for s in seen))
            margin, embd = MARGIN, placed_in.get(EMBD)
            if name == OUTPUT and hp.tied_output and chooser.costs is not None and any(b is embd for b in mine):
                mine, margin = [embd] + [b for b in mine if b is not embd], COPY_MARGIN
            buft = chooser.select(t, representative_op(t, name, hp), mine, refusals, margin)
        if name == OUTPUT and hp.tied_output and buft is placed_in[EMBD]:
            weights[OUTPUT] = weights[EMBD]  # same buffer type as the embedding: no copy
            continue
        weights[name] = t
        placed_in[name] = buft
        placed.append((t, buft))
    mapped = [(t, b) for t, b in placed if use_mmap and _maps(f, sources[t.name], b)]
    copied = [(t, b) for t, b in placed if not any(t is m for m, _ in mapped)]
    buffers = _map_weights(f, mapped, sources) + alloc_weights(copied)
    loads = {id(t): (t.name, t) for t, _ in copied}.values()  # a shared tensor loads once
    with _progress(progress, sum(t.nbytes for _, t in loads), f"loading {len(loads)} tensors") as advance:
        for name, t in loads:
            infos = [f.tensor(p) for p in sources[name]]
            parts = [i.data for i in infos]
            # whole tensors at offset 0 (repacking buffer types transform what they receive)
            t.buffer.set_tensor(t, parts[0] if len(parts) == 1 else np.concatenate(parts), 0)
            for i in infos:
                f.release(i.offset, i.nbytes)
            advance(t.nbytes)
    return Weights(weights, buffers, PlacementReport.of(placed, seen if candidates is None else candidates, refusals,
                                                        chooser),
                   sum(t.nbytes for t, _ in mapped))


def _maps(f: GGUFFile, parts: tuple[str, ...], buft: BufferType) -> bool:
    """Is the weight made of `parts` (file tensors) a view of the file in `buft`? One part
    (a fused weight is a copy), at an aligned offset, in a mappable buffer type."""
    return len(parts) == 1 and f.tensor(parts[0]).offset % MAPPED_ALIGNMENT == 0 and mappable(buft)


def _map_weights(f: GGUFFile, mapped: Sequence[tuple[Tensor, BufferType]],
                 sources: dict[str, tuple[str, ...]]) -> list[Buffer]:
    """Per device, one buffer wrapping the whole file map (`buffer_from_host_ptr`); each weight
    placed at its bytes' offset in the file."""
    buffers: dict[int, Buffer] = {}
    for t, buft in mapped:
        buf = buffers.get(id(buft))
        if buf is None:
            largest = max(u.nbytes for u, b in mapped if b is buft)
            buf = buffers[id(buft)] = buft.device.buffer_from_host_ptr(f.memory, largest)
            buf.usage = BufferUsage.WEIGHTS
        t.buffer, t.offset = buf, f.tensor(sources[t.name][0]).offset
        buf.init_tensor(t)
    return list(buffers.values())


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
