"""Continuous batching: several sequences over one Model, in one multi-sequence KV cache.

A `Batcher` holds up to `n_seq` sequences (the server's parallel slots), each in its own region
of one KVCache (ggx.models.kv_cache), and advances them with `step()`:
- at most one chunk of one prompt (`n_chunk` tokens, the oldest waiting prompt first), evaluated
  as a batch of that sequence alone, so a long prompt never stalls the others for more than a
  chunk;
- then one decode graph over every sequence that is generating: one row per sequence, the
  weights read once for all of them.
A sequence joins at the next step (`add`) and leaves without stopping the others (`remove`, or
when it finishes).

Batch invariance: a sequence's tokens do not depend on which others share its steps. Every op
but attention computes each row of a batch on its own; attention runs per sequence over its own
region (ggx.models.blocks), the very op a batch of that sequence alone runs. What could still
depend on the neighbours is a kernel that picks its arithmetic by the number of rows (CPU_REPACK's
matmul: a gemv for one column, gemm tiles for more; flash attention switching kernels by query
count): so prompts are
never batched together (each chunk is its own batch, cut where the prompt alone decides), and
decode batches have `decode_rows` rows whatever number of sequences is generating (the unused
rows are padding: a token written past the end of a sequence that is still reading its prompt or
of a free sequence, never committed, masked for everyone and overwritten later). With the
default `decode_rows=None` the decode batch has one row per generating sequence: cheapest alone,
exact only where the backends compute each row alike for any row count (not CPU_REPACK's: its
logits move by ~1e-5 relative, greedy tokens only where a margin is that small); `ggx serve`
passes decode_rows = its slot count.
"""
from __future__ import annotations

import codecs
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import GGXContextOverflow, GGXStateError, GGXValueError
from ..graph import Context, Graph, build_graph
from ..tensor import Tensor
from .blocks import BatchShape, ModelInputs
from .gc_pause import gc_paused
from .kv_cache import CacheBatch, KVCache
from .model import KEPT_GRAPHS, Model, prompt_bucket
from .sampling import check_sampling, sample

#: prompt tokens evaluated per step (a chunk); longer prompts take several steps
DEFAULT_CHUNK = 128


@dataclass
class Slot:
    """One sequence being served (a server's slot): its prompt, sampling settings and progress."""

    prompt: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    seed: int | None = None
    stop_at_eos: bool = True
    seq: int = -1  # its id in the cache
    n_fed: int = 0  # prompt tokens evaluated
    pending: int | None = None  # the sampled token that the next decode step feeds
    generated: list[int] = field(default_factory=list)
    #: why it ended: "eos", "max_tokens", "context_full" or "removed"; None while it runs
    finish_reason: str | None = None
    added_s: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")

    @property
    def prefilling(self) -> bool:
        return self.n_fed < len(self.prompt)


@dataclass(frozen=True)
class Event:
    """What a step did for one sequence: a new token (with its text), and/or its end."""

    sequence: Slot
    token: int | None
    text: str
    finish_reason: str | None
    #: the logits the token was sampled from (valid until the next step: copy to keep)
    logits: np.ndarray | None = None

    @property
    def logprob(self) -> float | None:
        """The token's log-probability under `logits`, computed when asked (before the next step):
        a pass over the whole vocabulary, which a step need not pay for tokens nobody reads it of."""
        return None if self.token is None or self.logits is None else _logprob(self.logits, self.token)


@dataclass
class BatchStats:
    """Counters since the Batcher was made (seconds and tokens)."""

    prompt_tokens: int = 0
    prompt_s: float = 0.0
    decode_tokens: int = 0  # real rows of decode steps
    decode_steps: int = 0
    decode_s: float = 0.0


class Batcher:
    """Serves up to `n_seq` sequences of `model` at once (see the module docstring). `n_ctx` is
    the context of all of them together (n_ctx // n_seq each; default: the model's n_ctx).

    The Batcher owns the model's runner while it steps: call it from one thread, and do not use
    the Model's own generate/eval meanwhile (its one-sequence cache is separate, its graphs too).
    """

    def __init__(self, model: Model, n_seq: int = 4, n_ctx: int | None = None, n_chunk: int = DEFAULT_CHUNK,
                 decode_rows: int | None = None):
        if n_seq < 1:
            raise GGXValueError(f"n_seq must be at least 1, got {n_seq}")
        n_ctx = n_ctx or model.n_ctx
        if n_ctx < n_seq:
            raise GGXValueError(f"a context of {n_ctx} tokens cannot be split among {n_seq} sequences")
        if n_ctx > model.hp.n_ctx_train * n_seq:
            n_ctx = model.hp.n_ctx_train * n_seq
        if not 1 <= n_chunk <= model.n_batch:
            raise GGXValueError(f"n_chunk must be in 1..{model.n_batch} (the model's n_batch), got {n_chunk}")
        if decode_rows is not None and not n_seq <= decode_rows:
            raise GGXValueError(f"decode_rows must be at least n_seq ({n_seq}), got {decode_rows}")
        self.model = model
        self.n_chunk = n_chunk
        self.decode_rows = decode_rows
        hp = model.hp
        self.cache = KVCache(hp.n_layer, hp.n_embd_kv, n_ctx, model.cache.bufts, hp.swa_layers, hp.n_swa,
                             max(n_chunk, decode_rows or 1), n_seq=n_seq)
        if self.cache.in_use[0]:  # a one-sequence cache holds sequence 0 from the start: hand it out instead
            self.cache.seq_rm(0)
        self.sequences: list[Slot] = []  # in the order they were added
        self.stats = BatchStats()
        self._graphs: dict[BatchShape, tuple[Graph, Tensor, ModelInputs]] = {}

    @property
    def n_seq(self) -> int:
        return self.cache.n_seq

    @property
    def n_ctx_seq(self) -> int:
        """The context of one sequence."""
        return self.cache.n_ctx_seq

    @property
    def n_free(self) -> int:
        return self.n_seq - len(self.sequences)

    @property
    def busy(self) -> bool:
        return bool(self.sequences)

    def warmup(self) -> None:
        """Get the first requests ready: a throwaway 8-token prompt and two decode steps (the
        prompt chunk's and decode's graphs built, planned and bound), then forgotten."""
        s = self.add([0] * min(8, self.n_ctx_seq - 2) or [0], 2, stop_at_eos=False)
        while s.finish_reason is None:
            self.step()
        self.stats = BatchStats()

    # --- sequences ------------------------------------------------------------------------------
    def add(self, prompt: Sequence[int], max_tokens: int, temperature: float = 0.0, top_k: int = 40,
            top_p: float = 0.95, seed: int | None = None, stop_at_eos: bool = True) -> Slot:
        """A new sequence, evaluated from the next step; checked before anything runs."""
        ids = self.model.encode_prompt(list(prompt))
        if len(ids) > self.n_ctx_seq:
            raise GGXContextOverflow(f"the prompt has {len(ids)} tokens, more than a sequence's context of "
                                     f"{self.n_ctx_seq}", 0, len(ids), self.n_ctx_seq)
        if max_tokens < 0:
            raise GGXValueError(f"max_tokens must be 0 or more, got {max_tokens}")
        check_sampling(temperature, top_k, top_p)
        if seed is not None and not (isinstance(seed, int) and seed >= 0):
            raise GGXValueError(f"seed must be an integer >= 0, got {seed!r}")
        if not self.n_free:
            raise GGXStateError(f"all {self.n_seq} sequences are in use")
        s = Slot(ids, max_tokens, temperature, top_k, top_p, seed, stop_at_eos)
        s.seq = self.cache.seq_add()
        self.sequences.append(s)
        return s

    def remove(self, s: Slot, reason: str = "removed") -> None:
        """End `s` now (a client that went away): its slot is free for the next step."""
        if s in self.sequences:
            self.sequences.remove(s)
            self.cache.seq_rm(s.seq)
            if s.finish_reason is None:
                s.finish_reason = reason

    # --- stepping -------------------------------------------------------------------------------
    def step(self) -> list[Event]:
        """One prompt chunk (of the oldest sequence still reading its prompt) and one decode step
        of every generating sequence. Returns the tokens made and the sequences that ended."""
        events: list[Event] = []
        with gc_paused():
            reading = next((s for s in self.sequences if s.prefilling), None)
            # sequences that were generating before this step's chunk: a prompt that ends in this
            # step gets its first token from the chunk, and its next from the following step
            decoding = [s for s in self.sequences if s.pending is not None]
            if reading is not None:
                self._prefill_chunk(reading, events)
            if decoding:
                self._decode(decoding, events)
        return events

    def _prefill_chunk(self, s: Slot, events: list[Event]) -> None:
        t0 = time.perf_counter()
        chunk = np.asarray(s.prompt[s.n_fed: s.n_fed + self.n_chunk], dtype=np.int64)
        n = int(chunk.size)
        n_pad = prompt_bucket(n)
        if n_pad > self.n_chunk or s.n_fed + n_pad > self.n_ctx_seq or not self._fits_ring(n_pad):
            n_pad = n
        tokens = chunk if n_pad == n else np.concatenate([chunk, np.zeros(n_pad - n, np.int64)])
        part = self.cache.plan(n_pad, s.seq)
        logits = self._run([part], tokens, BatchShape.of_parts([part], 1), last=n - 1)
        self.cache.commit(part, n)
        s.n_fed += n
        self.stats.prompt_tokens += n
        self.stats.prompt_s += time.perf_counter() - t0
        if not s.prefilling:
            self._sampled(s, logits.reshape(-1, self.model.n_vocab)[0], events)

    def _decode(self, seqs: list[Slot], events: list[Event]) -> None:
        t0 = time.perf_counter()
        full = [s for s in seqs if self.cache.seq_pos(s.seq) >= self.n_ctx_seq]
        for s in full:
            self._finish(s, "context_full", events)
        seqs = sorted((s for s in seqs if s not in full), key=lambda s: s.seq)
        if not seqs:
            return
        parts = [self.cache.plan(1, s.seq) for s in seqs]
        tokens = [s.pending for s in seqs]
        pads = self._padding_parts(seqs)
        rows = parts + pads
        order = sorted(range(len(rows)), key=lambda i: rows[i].seq)
        rows = [rows[i] for i in order]
        tokens = np.asarray([(tokens + [0] * len(pads))[i] for i in order], dtype=np.int64)
        logits = self._run(rows, tokens, BatchShape.of_parts(rows, len(rows)))
        logits = logits.reshape(len(rows), self.model.n_vocab)
        by_seq = {p.seq: i for i, p in enumerate(rows)}
        for part in parts:
            self.cache.commit(part)
        self.stats.decode_tokens += len(seqs)
        self.stats.decode_steps += 1
        self.stats.decode_s += time.perf_counter() - t0
        for s in seqs:
            s.pending = None
            self._sampled(s, logits[by_seq[s.seq]], events)

    def _padding_parts(self, seqs: list[Slot]) -> list[CacheBatch]:
        """Rows that fill a decode batch up to `decode_rows`: one token per other sequence id
        (written at its next position, never committed; see the module docstring)."""
        if self.decode_rows is None:
            return []
        used = {s.seq for s in seqs}
        pads = []
        for seq in range(self.n_seq):
            if seq in used:
                continue
            if not self.cache.in_use[seq]:
                self.cache.in_use[seq] = True  # planned only, never committed: the id stays free
                try:
                    pads.append(self.cache.plan(1, seq))
                finally:
                    self.cache.in_use[seq] = False
            elif self.cache.seq_pos(seq) < self.n_ctx_seq:
                pads.append(self.cache.plan(1, seq))
        if len(seqs) + len(pads) != self.decode_rows:
            raise GGXStateError(f"cannot pad a decode batch of {len(seqs)} rows to {self.decode_rows}")
        return pads

    def _sampled(self, s: Slot, logits: np.ndarray, events: list[Event]) -> None:
        """Choose the next token of `s` from its logits (Model.generate's rules)."""
        if s.max_tokens == 0:
            self._finish(s, "max_tokens", events)
            return
        tok = sample(logits, s.temperature, s.top_k, s.top_p, s.rng)
        if s.stop_at_eos and tok in self.model.eog_ids:
            self._finish(s, "eos", events)
            return
        if s.first_token_s is None:
            s.first_token_s = time.perf_counter()
        s.generated.append(tok)
        text = s.decoder.decode(self.model.tokenizer.token_bytes(tok))
        if len(s.generated) >= s.max_tokens:
            self.remove(s, "max_tokens")
            events.append(Event(s, tok, text, "max_tokens", logits))
            return
        s.pending = tok
        events.append(Event(s, tok, text, None, logits))

    def _finish(self, s: Slot, reason: str, events: list[Event]) -> None:
        self.remove(s, reason)
        events.append(Event(s, None, s.decoder.decode(b"", final=True), reason))

    def _fits_ring(self, n_tokens: int) -> bool:
        swa = self.cache.swa
        return swa is None or swa.size >= self.n_ctx_seq or n_tokens + swa.window - 1 <= swa.size

    def _run(self, parts: list[CacheBatch], tokens: np.ndarray, shape: BatchShape,
             last: int | None = None) -> np.ndarray:
        graph, logits, inp = self._graph(shape)
        (result,) = self.model.runner.run(graph, [logits], inp.data(tokens, parts, last))
        return result.astype(np.float32, copy=False)

    def _graph(self, shape: BatchShape) -> tuple[Graph, Tensor, ModelInputs]:
        """Graphs kept per shape (the last KEPT_GRAPHS), as Model keeps its own."""
        hit = self._graphs.pop(shape, None)
        if hit is None:
            m = self.model
            logits, inp = m.arch.build(Context(), m.hp, m.weights, self.cache, shape, m.flash_attn)
            hit = (build_graph([logits]), logits, inp)
            if len(self._graphs) >= KEPT_GRAPHS:
                del self._graphs[next(iter(self._graphs))]
        self._graphs[shape] = hit
        return hit


def _logprob(logits: np.ndarray, tok: int) -> float:
    x = logits.astype(np.float64)
    m = x.max()
    return float(x[tok] - m - np.log(np.exp(x - m).sum()))
