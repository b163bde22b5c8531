"""Graphviz DOT of a scheduled graph: where each node runs, the splits, and the copies between them.

Nodes are filled with their backend's color and carry the scheduler's explanation as tooltip;
each split is a box (cluster) labelled with its backend; a split input that had to be copied is
drawn as a dashed "copy" node inside the split, fed from the original tensor. Leafs (weights,
inputs) are small boxes colored by the backend that owns their memory.
"""
from __future__ import annotations

from .graph import Graph
from .sched import Scheduler
from .tensor import Tensor

__all__ = ["to_dot"]

PALETTE = ("#8ecae6", "#ffb703", "#90be6d", "#f28482", "#cdb4db", "#f6bd60", "#84a59d", "#e9c46a")
HOST_COLOR = "#dddddd"


def _q(s: str) -> str:
    return '"' + s.replace('"', '\\"') + '"'


def _label(t: Tensor) -> str:
    name = t.name or t.op.name.lower()
    ne = "x".join(str(x) for x in t.ne[: max(t.ndim, 1)])
    return f"{name}\\n{t.op.name} {t.type.name} [{ne}]"


def to_dot(sched: Scheduler, graph: Graph, title: str = "ggx graph") -> str:
    """The DOT text of `graph` as `sched` planned it (plan it first: `sched.alloc_graph(graph)`)."""
    colors = {}
    for i, be in enumerate(sched.backends):
        last = i == len(sched.backends) - 1
        colors[id(be)] = HOST_COLOR if last else PALETTE[i % len(PALETTE)]
    ids: dict[int, str] = {}

    def nid(t: Tensor) -> str:
        if id(t) not in ids:
            ids[id(t)] = f"t{len(ids)}"
        return ids[id(t)]

    def color_of(t: Tensor) -> str:
        be = sched.backend_of(t)
        return colors.get(id(be), "white") if be is not None else "white"

    lines = [f"digraph {_q(title)} {{", "  rankdir=TB;", '  node [shape=box, style="rounded,filled", fontsize=10];',
             f"  label={_q(title + ' — ' + ', '.join(b.name for b in sched.backends))};"]
    copy_ids: dict[tuple[int, int], str] = {}
    for k, sp in enumerate(sched.splits):
        be = sp.backend
        lines.append(f"  subgraph cluster_{k} {{")
        lines.append(f"    label={_q(f'split {k}: {be.name}')}; style=rounded; color=\"#555555\";")
        for inp in sp.inputs:
            cid = f"c{k}_{nid(inp)}"
            copy_ids[(id(inp), id(be))] = cid
            lines.append(f"    {cid} [label={_q('copy of ' + (inp.name or inp.op.name.lower()) + ' → ' + be.name)}, "
                         f"style=\"dashed,filled\", fillcolor={_q(colors[id(be)])}, shape=note];")
        for n in sp.nodes:
            lines.append(f"    {nid(n)} [label={_q(_label(n))}, fillcolor={_q(color_of(n))}, "
                         f"tooltip={_q(sched.explain(n))}{', shape=ellipse' if n.op.is_view else ''}];")
        lines.append("  }")
    for leaf in graph.leafs:
        lines.append(f"  {nid(leaf)} [label={_q(_label(leaf))}, shape=box, style=filled, fontsize=8, "
                     f"fillcolor={_q(color_of(leaf))}, tooltip={_q(sched.explain(leaf))}];")
    for sp in sched.splits:
        for inp in sp.inputs:
            cid = copy_ids[(id(inp), id(sp.backend))]
            lines.append(f"  {nid(inp)} -> {cid} [style=dashed, color=red, penwidth=2];")
    for n in graph.nodes:
        be = sched.backend_of(n)
        for s in n.src:
            cid = copy_ids.get((id(s), id(be)))
            if cid is not None and sched.backend_of(s) is not be:
                lines.append(f"  {cid} -> {nid(n)};")
            else:
                lines.append(f"  {nid(s)} -> {nid(n)};")
    lines.append("}")
    return "\n".join(lines) + "\n"
