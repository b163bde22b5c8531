"""When to run a graph as a CUDA graph: ggml-cuda's rule as a small state machine (no CUDA here).

ggml-cuda captures a graph's kernels into a CUDA graph and relaunches it while nothing that is
baked into the captured launches changes: per node its op, type, shape, strides, parameters and
the addresses of the node and its sources (ggml_graph_node_properties). Capture costs more than
running eagerly once, so a graph is captured only after it was seen twice in a row with
identical properties (a warm-up), and a graph is never captured when one of its nodes needs
something a capture cannot hold (the caller names it: "node 12 MUL_MAT uses cuBLAS").

Per graph key (`CudaGraphCache.decide`):

    new key, or properties changed  -> EAGER  ("warming up (1 of 2)" / "properties changed");
                                       any stored graph is dropped and the warm-up restarts
    blocker given                   -> EAGER  (the blocker)
    a failed capture (`fail`)       -> EAGER  ("capture failed: ...") for as long as the key lives
    unchanged, a graph stored       -> LAUNCH (the stored graph)
    unchanged, warm-up done         -> CAPTURE (the caller captures, then `store`s the graph)
    disabled (GGX_CUDA_DISABLE_GRAPHS, or `set_enabled(False)`: the "set_graphs" capability)
                                    -> EAGER for every call

At most `max_keys` keys are kept (least recently decided goes first, with its graph).
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

from ggx.tensor import Tensor

EAGER, CAPTURE, LAUNCH = "eager", "capture", "launch"
WARMUP = 2
MAX_KEYS = 32
DISABLED = "disabled (GGX_CUDA_DISABLE_GRAPHS or set_graphs)"


def node_properties(graph_nodes: Iterable[Tensor], ptr: Callable[[Tensor], int]) -> tuple:
    """What a captured graph bakes in, per non-view node: op, type, ne, nb, params, the node's
    address and, per source, its address, type, ne and nb (a launch depends on its sources'
    shapes as well; ggml compares only their addresses but also tracks every leaf)."""
    return tuple((n.op, n.type, n.ne, n.nb, n.params, ptr(n),
                  tuple((ptr(s), s.type, s.ne, s.nb) for s in n.src))
                 for n in graph_nodes if not n.op.is_view)


@dataclass(frozen=True)
class Decision:
    """What to do with one call: `action` EAGER / CAPTURE / LAUNCH, why, and for LAUNCH the graph."""

    action: str
    reason: str
    key: Hashable
    graph: Any = None

    def __str__(self) -> str:
        return self.action if self.action != EAGER else f"{EAGER}: {self.reason}"


class _Entry:
    __slots__ = ("properties", "calls", "graph", "failed")

    def __init__(self, properties: tuple):
        self.properties = properties
        self.calls = 1  # consecutive calls with these properties, this one included
        self.graph: Any = None
        self.failed: str | None = None


class CudaGraphCache:
    def __init__(self, enabled: bool = True, max_keys: int = MAX_KEYS, warmup: int = WARMUP,
                 on_drop: Callable[[Any], None] | None = None):
        """`on_drop(graph)` is called for every stored graph that is dropped (changed, evicted,
        cleared): a driver may release it there; by default it is simply forgotten."""
        if max_keys < 1 or warmup < 1:
            raise ValueError(f"max_keys {max_keys} and warmup {warmup} must be at least 1")
        self.enabled, self.max_keys, self.warmup, self._on_drop = enabled, max_keys, warmup, on_drop
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._counts: Counter[str] = Counter()
        self._last: dict[Hashable, Decision] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def _drop_graph(self, entry: _Entry) -> None:
        if entry.graph is not None and self._on_drop is not None:
            self._on_drop(entry.graph)
        entry.graph = None

    def _decide(self, key: Hashable, properties: tuple, blocker: str | None) -> Decision:
        if not self.enabled:
            return Decision(EAGER, DISABLED, key)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(properties)
            while len(self._entries) > self.max_keys:
                old_key, old = self._entries.popitem(last=False)
                self._drop_graph(old)
                self._last.pop(old_key, None)
            changed = f"warming up (1 of {self.warmup})"
        else:
            self._entries.move_to_end(key)
            if entry.properties != properties:
                self._drop_graph(entry)
                entry.properties, entry.calls = properties, 1
                changed = "properties changed"
            else:
                entry.calls += 1
                changed = None
        if blocker:
            self._drop_graph(entry)
            return Decision(EAGER, blocker, key)
        if entry.failed is not None:
            return Decision(EAGER, f"capture failed: {entry.failed}", key)
        if entry.graph is not None:
            return Decision(LAUNCH, "properties unchanged", key, entry.graph)
        if entry.calls >= self.warmup:
            return Decision(CAPTURE, f"unchanged for {entry.calls} calls", key)
        return Decision(EAGER, changed or f"warming up ({entry.calls} of {self.warmup})", key)

    def decide(self, key: Hashable, properties: tuple, blocker: str | None = None) -> Decision:
        """The decision for one call of the graph `key` whose nodes have these properties."""
        d = self._decide(key, properties, blocker)
        self._counts[str(d)] += 1
        if self.enabled:  # disabled: no per-key state at all
            self._last[key] = d
        return d

    def set_enabled(self, enabled: bool) -> None:
        """Turn capture on or off from the next call; turning it off drops every stored graph."""
        if not enabled:
            self.clear()
        self.enabled = enabled

    def store(self, key: Hashable, graph: Any) -> None:
        """Keep the graph captured after a CAPTURE decision for `key`; KeyError for an unknown key."""
        entry = self._entries[key]
        if entry.graph is not graph:
            self._drop_graph(entry)
        entry.graph = graph

    def fail(self, key: Hashable, reason: str) -> None:
        """A capture of `key` failed: run it eagerly from now on (ggml's
        disable_due_to_failed_graph_capture), for as long as the key is kept."""
        entry = self._entries[key]
        self._drop_graph(entry)
        entry.failed = reason

    def invalidate(self, key: Hashable) -> None:
        """Forget one key (its graph and warm-up)."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._drop_graph(entry)
        self._last.pop(key, None)

    def clear(self) -> None:
        """Forget every key: e.g. when memory a captured graph uses (the scratch) moved."""
        for entry in self._entries.values():
            self._drop_graph(entry)
        self._entries.clear()
        self._last.clear()

    def last(self, key: Hashable) -> Decision | None:
        return self._last.get(key)

    def reasons(self) -> dict[str, int]:
        """How many calls got each decision, for reporting: {"launch": 40, "capture": 1,
        "eager: warming up (1 of 2)": 1, "eager: node 3 MUL_MAT uses cuBLAS": 2, ...}."""
        return dict(self._counts)
