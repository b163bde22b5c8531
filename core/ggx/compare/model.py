"""`compare_model`: one model's graphs on two backends, node by node and by their logits.

Both runs load the same GGUF file (a prompt, then `n_decode` steps, each step's token the argmax
of A's logits: teacher forcing by A, so B never follows a token of its own). Every node that
computes is seen on both sides (each backend runs the whole graph, eagerly, a node at a time):

- *accumulated*: B's node against A's, each fed by its own run; errors add up along the graph,
  so this says where the runs part, not which kernel is wrong;
- *isolated*: the node recomputed on B's backends from A's exact input bytes (B's own weights),
  against A's result: one kernel's error alone, judged by the op's conformance tolerance.

The logits are judged by the project's model criteria (`criteria`). With `graphs=True` B is also
compared with itself, CUDA graphs (or the device's own graph capture, "set_graphs") on vs off:
those logits must be bit-identical. The verdict: no isolated node beyond its tolerance, every
logits row within the criteria, and (when asked) graphs bit-identical. The tolerances are the
conformance suite's bounds against the float64 reference: compare against `ref` (the default A)
for a verdict; between two other backends each side's own error adds.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..backend import Backend, Device
from ..conformance.case import Tolerance, tolerance
from ..conformance.harness import compare
from ..errors import GGXUnsupported
from ..ops import Op
from ..tensor import Tensor
from .backends import BackendSpec
from .criteria import LogitsRow, logits_rows
from .gguf_cut import cut_layers
from .nodes import Recompute, Recorder, Seen, graph_order, is_weight

DEFAULT_PROMPT = "The capital of France is"
DEFAULT_DECODE = 4
#: a small context: the KV cache (copied per attention node when isolating) stays small
DEFAULT_N_CTX = 256

Progress = Callable[[str], None]


# --- describing a node ---------------------------------------------------------------------------
def _layout(t: Tensor) -> dict:
    d = {"name": t.name, "type": t.type.name, "ne": list(t.ne), "nb": list(t.nb)}
    if t.view_src is not None:
        d["view"] = {"of": t.view_src.describe(), "offset": t.view_offs}
    return d


def _role(t: Tensor) -> str:
    if is_weight(t):
        return "weight"
    return "leaf" if t.op is Op.NONE and t.root.op is Op.NONE else "node"


def _label(t: Tensor) -> str:
    """The op as the conformance suite prints it where the kind matters (GELU_ERF, SWIGLU)."""
    if t.op not in (Op.GELU, Op.GLU):
        return ""
    name = getattr(getattr(t.params, "kind", t.params), "name", None)
    if not isinstance(name, str):
        return ""
    return f"GELU_{name}" if t.op is Op.GELU else name


def node_tolerance(t: Tensor) -> Tolerance:
    """The conformance bound for this node: its op and characteristic type (a product's weight
    type, a copy's destination type, attention's K type)."""
    if t.op in (Op.MUL_MAT, Op.MUL_MAT_ID):
        gtype = t.src[0].type
    elif t.op is Op.FLASH_ATTN_EXT:
        gtype = t.src[1].type
    else:
        gtype = t.type
    return tolerance(t.op, gtype, _label(t))


def describe(t: Tensor) -> dict:
    """op, type, shape, strides, view and each source's (with its role: weight, leaf or node)."""
    return _layout(t) | {"op": _label(t) or t.op.name,
                         "src": [_layout(s) | {"role": _role(s)} for s in t.src]}


def one_line(desc: dict) -> str:
    def part(d: dict) -> str:
        role = "weight " if d.get("role") == "weight" else ""
        text = f"{role}{d['name'] + ' ' if d['name'] else ''}{d['type']}{d['ne']} nb{d['nb']}"
        if "view" in d:
            text += f" view of {d['view']['of']} +{d['view']['offset']}"
        return text
    return f"{desc['op']} -> {part(desc)} <- " + ", ".join(part(s) for s in desc["src"])


# --- results -------------------------------------------------------------------------------------
@dataclass
class NodeResult:
    """One node of one step, A against B."""

    step: int
    index: int  # among the graph's computing nodes, in graph order
    node: dict  # `describe`
    tolerance: float
    reason: str  # the tolerance's reason
    accumulated: float | None  # NMSE, B's run against A's (None: not an NMSE comparison)
    accumulated_ok: bool
    isolated: float | None  # NMSE of the isolated recomputation against A
    isolated_ok: bool | None  # None: not recomputed (see note)
    note: str = ""  # where the isolated recomputation ran, or why not, or what failed
    inputs: list[float | None] = field(default_factory=list)  # per source: NMSE B vs A (None: weight)

    @property
    def op(self) -> str:
        return self.node["op"]

    def line(self) -> str:
        def f(x):
            return "-" if x is None else f"{x:.3g}"
        ins = ", ".join(f(x) for x in self.inputs)
        return (f"step {self.step} node {self.index}: {one_line(self.node)}\n"
                f"    tolerance {self.tolerance:g} ({self.reason}); accumulated NMSE {f(self.accumulated)}, "
                f"isolated {f(self.isolated)}{' (' + self.note + ')' if self.note else ''}; inputs' NMSE [{ins}]")

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("step", "index", "node", "tolerance", "reason", "accumulated",
                                              "accumulated_ok", "isolated", "isolated_ok", "note", "inputs")}


@dataclass
class GraphsCheck:
    """B with graph capture on against off: the logits of every step."""

    backend: str
    identical: bool
    max_abs: float
    steps: int

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class CompareReport:
    model: str
    a: str
    b: str
    tokens: list[int]  # the prompt, then the forced tokens
    n_prompt: int
    nodes: list[NodeResult] = field(default_factory=list)
    logits: list[LogitsRow] = field(default_factory=list)
    graphs: GraphsCheck | None = None
    isolated: bool = True
    weights: dict[str, str] = field(default_factory=dict)  # "a"/"b" -> where that run's weights went

    @property
    def first_isolated(self) -> NodeResult | None:
        """The first node beyond its op's tolerance, recomputed on B from A's inputs."""
        return next((n for n in self.nodes if n.isolated_ok is False), None)

    @property
    def first_accumulated(self) -> NodeResult | None:
        """The first node where B's own run is beyond the op's tolerance: where the runs part."""
        return next((n for n in self.nodes if not n.accumulated_ok), None)

    @property
    def bad_logits(self) -> list[LogitsRow]:
        return [r for r in self.logits if not r.ok]

    @property
    def ok(self) -> bool:
        graphs_ok = self.graphs is None or self.graphs.identical
        return self.first_isolated is None and not self.bad_logits and graphs_ok

    def summary(self) -> list[str]:
        """The lines `ggx compare` prints."""
        out = [f"{self.model}: {self.b} against {self.a}, {self.n_prompt} prompt tokens + "
               f"{len(self.tokens) - self.n_prompt} forced"]
        out += [f"weights of {getattr(self, side)}: {where}" for side, where in self.weights.items()]
        steps = sorted({n.step for n in self.nodes})
        for s in steps:
            ns = [n for n in self.nodes if n.step == s]
            iso = [n for n in ns if n.isolated is not None]
            worst = max(iso, key=lambda n: n.isolated / max(n.tolerance, 1e-30), default=None)
            w = f", worst isolated {worst.op} {worst.isolated:.3g} (tolerance {worst.tolerance:g})" if worst else ""
            bad = sum(n.isolated_ok is False for n in ns)
            out.append(f"step {s}: {len(ns)} nodes, {bad} isolated beyond tolerance{w}")
        first = self.first_isolated
        if first is not None:
            out += ["first node beyond its tolerance (isolated):", "  " + first.line()]
        elif self.isolated:
            out.append("no node beyond its tolerance (isolated)")
        acc = self.first_accumulated
        if acc is not None:
            out += ["first node beyond its tolerance in B's own run (accumulated: where the runs part):",
                    "  " + acc.line()]
        for r in self.logits:
            mark = "ok" if r.ok else "FAIL " + r.problem()
            out.append(f"logits step {r.step} pos {r.position}: max |diff| {r.max_abs:.3g}, mean {r.mean_abs:.3g}, "
                       f"argmax {r.argmax_a}/{r.argmax_b} (margin {r.margin_a:.3g}): {mark}")
        if self.graphs is not None:
            g = self.graphs
            out.append(f"graphs on vs off ({g.backend}, {g.steps} steps): "
                       + ("bit-identical" if g.identical else f"DIFFER (max |diff| {g.max_abs:.3g})"))
        out.append("agree" if self.ok else "DISAGREE")
        return out

    def to_dict(self) -> dict:
        first, acc = self.first_isolated, self.first_accumulated
        return {"model": self.model, "a": self.a, "b": self.b, "tokens": self.tokens, "n_prompt": self.n_prompt,
                "ok": self.ok, "weights": self.weights, "first_isolated": first.to_dict() if first else None,
                "first_accumulated": acc.to_dict() if acc else None,
                "logits": [r.to_dict() for r in self.logits],
                "graphs": self.graphs.to_dict() if self.graphs else None,
                "nodes": [n.to_dict() for n in self.nodes]}


# --- running -------------------------------------------------------------------------------------
def backend_device(backend: str | Device) -> tuple[str, Device]:
    """(its label, the device to load a model on) for `DEVICE[:BUFT]` or a Device (as it is)."""
    if isinstance(backend, Device):
        return backend.name, backend
    spec = BackendSpec.parse(backend)
    return str(spec), spec.resolve()


def _load(path: str, device: Device, n_ctx: int, warmup: bool = False):
    from ..models import load_model

    return load_model(path, devices=[device], n_ctx=n_ctx, warmup=warmup)


def _nmse_of(a: np.ndarray | None, b: np.ndarray | None) -> float | None:
    if a is None or b is None or a.shape != b.shape:
        return None
    ok, err, _ = compare(b, a, Tolerance(float("inf"), ""))
    return err


def _judge(step: int, index: int, t: Tensor, sa: Seen, sb: Seen, recompute: Recompute | None,
           backend: Backend | None) -> NodeResult:
    tol = node_tolerance(t)
    acc_ok, acc, _ = compare(sb.values, sa.values, tol)
    iso, iso_ok, note = None, None, ""
    if recompute is not None:
        try:
            values, note = recompute.run(t, sa.snapshot, backend)
        except Exception as e:  # noqa: BLE001 - a kernel that raises is a finding, not a crash
            values, note, iso_ok = None, f"raised {type(e).__name__}: {e}", False
        if values is not None:
            iso_ok, iso, msg = compare(values, sa.values, tol)
            if not iso_ok and msg:
                note = f"{note}: {msg}"
    inputs = [_nmse_of(x, y) for x, y in zip(sa.inputs, sb.inputs)]
    return NodeResult(step, index, describe(t), tol.max_nmse, tol.reason, acc, acc_ok, iso, iso_ok, note, inputs)


def _step_nodes(step: int, ra: Recorder, rb: Recorder, recompute: Recompute | None,
                where: dict[int, Backend], say: Progress, what: str) -> list[NodeResult]:
    """A's and B's nodes of one step, in graph order, each isolated on the backend B ran it on."""
    order_a, order_b = graph_order(ra.order), graph_order(rb.order)
    if [(t.op, t.ne) for t in order_a] != [(t.op, t.ne) for t in order_b]:
        raise GGXUnsupported(f"step {step}: the two models built different graphs "
                             f"({len(order_a)} and {len(order_b)} computing nodes)")
    out = []
    for i, (ta, tb) in enumerate(zip(order_a, order_b)):
        if id(ta) in ra.seen and id(tb) in rb.seen:
            if recompute is not None:
                say(f"{what}: isolated node {i + 1}/{len(order_a)}")
            out.append(_judge(step, i, ta, ra.seen[id(ta)], rb.seen[id(tb)], recompute, where.get(id(tb))))
    return out


def model_file(model: str | os.PathLike | None, layers: int | None) -> str:
    """The GGUF file to compare: a path or known name (default: the default model), cut to its
    first `layers` layers when given."""
    from ..models.catalog import resolve_model

    path = resolve_model(model)
    return str(cut_layers(path, layers) if layers else path)


def compare_model(model: str | os.PathLike | None = None, a: str | Device = "ref", b: str | Device = "CPU",
                  prompt: str | Sequence[int] = DEFAULT_PROMPT, n_decode: int = DEFAULT_DECODE,
                  layers: int | None = None, n_ctx: int = DEFAULT_N_CTX, isolated: bool = True,
                  graphs: bool = False, progress: Progress | None = None) -> CompareReport:
    """Run `model` (a GGUF path or known name; default the default model, cut to `layers`) on
    backends `a` and `b` (`DEVICE[:BUFT]`: `ref`, `CPU`, `CPU:CPU_REPACK`, `CUDA0`, ..., or a Device) and
    compare them node by node and by their logits (see the module docstring). `a == b` with
    `graphs=True` only checks graph capture on vs off."""
    say = progress or (lambda _text: None)
    (spec_a, dev_a), (spec_b, dev_b) = backend_device(a), backend_device(b)
    path = model_file(model, layers)
    say(f"loading {os.path.basename(path)} on {spec_a} and {spec_b}")
    ma = _load(path, dev_a, n_ctx)
    ids = ma.encode_prompt(prompt)
    report = CompareReport(os.path.basename(path), str(spec_a), str(spec_b), list(ids), len(ids), isolated=isolated)
    report.weights["a"] = str(ma.placement)
    if spec_a != spec_b or not graphs:
        mb = _load(path, dev_b, n_ctx)
        report.weights["b"] = str(mb.placement)
        recompute = Recompute(mb.runner.backends, {t.name: t for t in mb.weights.values()}) if isolated else None
        ra, rb = Recorder(snapshots=isolated), Recorder()
        ma.runner.sched.eval_callback, mb.runner.sched.eval_callback = ra, rb
        tokens = list(ids)
        for step in range(n_decode + 1):
            what = "prompt" if step == 0 else f"decode step {step}/{n_decode}"
            ra.clear(), rb.clear()
            ra.on_node = lambda n, what=what: say(f"{what}: {spec_a} node {n}")
            rb.on_node = lambda n, what=what: say(f"{what}: {spec_b} node {n}")
            feed = tokens if step == 0 else tokens[-1:]
            la = ma.forward(feed) if step == 0 else ma.eval(feed)
            lb = mb.forward(feed) if step == 0 else mb.eval(feed)
            where = {id(n): split.backend for split in mb.runner.sched.splits for n in split.nodes}
            report.nodes += _step_nodes(step, ra, rb, recompute, where, say, what)
            first = 0 if step == 0 else len(tokens) - 1
            report.logits += logits_rows(la, lb, step, first)
            if step < n_decode:
                tokens.append(int(np.argmax(la[-1])))
        report.tokens = tokens
        ma.runner.sched.eval_callback = mb.runner.sched.eval_callback = None
    if graphs:
        say(f"graphs on vs off on {spec_b}")
        report.graphs = compare_graphs(path, b, report.tokens[:len(ids)], n_decode, n_ctx)
    return report


def set_graphs(model, enabled: bool) -> None:
    """Turn graph capture on or off on every backend of `model` that has it ("set_graphs", a
    backend registry's capability like "set_n_threads"); GGXUnsupported when none has."""
    done = False
    for be in model.runner.backends:
        reg = getattr(be.device, "reg", None)
        fn = reg.get_proc_address("set_graphs") if reg is not None else None
        if fn is not None:
            fn(be, enabled)
            done = True
    if not done:
        names = ", ".join(be.name for be in model.runner.backends)
        raise GGXUnsupported(f"no backend of {names} can turn graph capture on and off (no \"set_graphs\")")


def compare_graphs(path: str, backend: str | Device, prompt: Sequence[int], n_decode: int,
                   n_ctx: int = DEFAULT_N_CTX) -> GraphsCheck:
    """The same backend with graph capture on and off: every step's logits must be bit-identical.
    Decode repeats one graph, so from its third step on (ggml's warm-up of two calls, then the
    capture) the "on" side replays a captured graph: `n_decode` >= 3 compares a replay."""
    label, device = backend_device(backend)
    on, off = _load(path, device, n_ctx), _load(path, device, n_ctx)
    set_graphs(on, True)
    set_graphs(off, False)
    la, lb = on.forward(list(prompt)), off.forward(list(prompt))
    pairs = [(la, lb)]
    for _ in range(n_decode):
        tok = int(np.argmax(la[-1]))
        la, lb = on.eval([tok]), off.eval([tok])
        pairs.append((la, lb))
    identical = all(np.array_equal(x, y) for x, y in pairs)
    max_abs = max(float(np.max(np.abs(x.astype(np.float64) - y))) for x, y in pairs)
    return GraphsCheck(label, identical, max_abs, len(pairs))
