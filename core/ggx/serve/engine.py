"""The server's engine: one thread stepping a Batcher, requests handed to it and tokens handed back.

Requests come from the event loop (`submit`), wait in a queue of at most `max_queue` until a
slot is free (then `QueueFull`: the server answers 503 with Retry-After), join the Batcher at the
next step and send each token back to their own asyncio queue (`loop.call_soon_threadsafe`). A
request cancelled by its client (`cancel`) leaves at the next step: its slot is free for the one
waiting. Only this thread touches the Batcher and the model.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..errors import GGXStateError
from ..models.batched import Batcher, Event, Slot


class QueueFull(GGXStateError):
    """Every slot is busy and the queue holds `max_queue` requests already."""


@dataclass
class Job:
    """One request's generation: what to generate and where its tokens go."""

    prompt: list[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    logprobs: bool = False  # whether the response reports the tokens' log-probabilities
    top_logprobs: int = 0  # alternatives to report per token (0: the chosen token's logprob only)
    loop: asyncio.AbstractEventLoop | None = None
    queue: asyncio.Queue | None = None  # receives Token items, then one Done
    slot: Slot | None = None
    cancelled: bool = False
    submitted_s: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class Token:
    id: int
    text: str
    logprob: float | None
    top: list[tuple[int, float]]  # (token id, logprob), likeliest first


@dataclass(frozen=True)
class Done:
    finish_reason: str  # "eos", "max_tokens", "context_full", "removed" or "error"
    n_generated: int
    error: str | None = None


@dataclass
class Counters:
    """What /metrics reports, since start."""

    requests: int = 0
    requests_rejected: int = 0  # queue full
    requests_cancelled: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0


class Engine:
    def __init__(self, batcher: Batcher, max_queue: int = 16):
        self.batcher = batcher
        self.max_queue = max_queue
        self.counters = Counters()
        self._cv = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._cancelled: list[Job] = []
        self._jobs: dict[int, Job] = {}  # id(slot) -> job, engine thread only
        self._busy = 0  # slots in use, as last seen by the engine thread
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="ggx-serve-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=30)

    # --- from the event loop ----------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Queue `job` (its tokens arrive on job.queue); QueueFull when the queue is full."""
        with self._cv:
            # waiting requests take the free slots first; past those, max_queue more may wait
            if len(self._waiting) >= self.max_queue + self.batcher.n_seq - self._busy:
                self.counters.requests_rejected += 1
                raise QueueFull(f"all {self.batcher.n_seq} slots are busy and {len(self._waiting)} requests "
                                "are waiting; retry later")
            self.counters.requests += 1
            self._waiting.append(job)
            self._cv.notify()

    def cancel(self, job: Job, client_gone: bool = True) -> None:
        """End `job` early: it leaves at the next step (or never starts). `client_gone`: its
        client went away (counted in requests_cancelled), not a stop sequence met."""
        with self._cv:
            if job.cancelled:
                return
            job.cancelled = True
            self.counters.requests_cancelled += client_gone
            if job in self._waiting:
                self._waiting.remove(job)
            else:
                self._cancelled.append(job)
            self._cv.notify()

    @property
    def slots_busy(self) -> int:
        return self._busy

    @property
    def queued(self) -> int:
        return len(self._waiting)

    # --- the engine thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        b = self.batcher
        while True:
            with self._cv:
                while not (self._stop or self._waiting or self._cancelled or b.busy):
                    self._cv.wait()
                if self._stop:
                    break
                cancelled, self._cancelled = self._cancelled, []
                joining = []
                while self._waiting and b.n_free - len(joining) > 0:
                    joining.append(self._waiting.popleft())
                self._busy += len(joining)  # claimed now, so submit counts them as busy, not waiting
            for job in cancelled:
                if job.slot is not None and job.slot.finish_reason is None:
                    b.remove(job.slot)
                    self._jobs.pop(id(job.slot), None)
            for job in joining:
                try:
                    job.slot = b.add(job.prompt, job.max_tokens, job.temperature, job.top_k, job.top_p, job.seed)
                except Exception as e:  # noqa: BLE001 - checked before submit: a bug if it happens
                    self._send(job, Done("error", 0, f"{type(e).__name__}: {e}"))
                    continue
                self._jobs[id(job.slot)] = job
                self.counters.prompt_tokens += len(job.prompt)
            try:
                events = b.step()
            except Exception as e:  # noqa: BLE001 - a failed step ends its requests, not the server
                for job in list(self._jobs.values()):
                    b.remove(job.slot, "error")
                    self._send(job, Done("error", len(job.slot.generated), f"{type(e).__name__}: {e}"))
                self._jobs.clear()
                continue
            for e in events:
                self._deliver(e)
            with self._cv:
                self._busy = b.n_seq - b.n_free

    def _deliver(self, e: Event) -> None:
        job = self._jobs.get(id(e.sequence))
        if job is None:
            return
        if e.token is not None:
            self.counters.generated_tokens += 1
            top = _top(e.logits, job.top_logprobs) if job.logprobs and job.top_logprobs and e.logits is not None else []
            self._send(job, Token(e.token, e.text, e.logprob if job.logprobs else None, top))
        if e.finish_reason is not None:
            self._jobs.pop(id(e.sequence), None)
            self._send(job, Done(e.finish_reason, len(e.sequence.generated)))

    @staticmethod
    def _send(job: Job, item: Token | Done) -> None:
        if job.loop is not None and job.queue is not None and not job.cancelled:
            try:
                job.loop.call_soon_threadsafe(job.queue.put_nowait, item)
            except RuntimeError:  # the event loop has closed (the server is stopping)
                pass


def _top(logits: np.ndarray, k: int) -> list[tuple[int, float]]:
    x = logits.astype(np.float64)
    m = x.max()
    lse = m + np.log(np.exp(x - m).sum())
    idx = np.argpartition(-x, k - 1)[:k]
    idx = idx[np.argsort(-x[idx], kind="stable")]
    return [(int(i), float(x[i] - lse)) for i in idx]
