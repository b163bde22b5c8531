"""The request bodies `ggx serve` accepts: OpenAI's chat and completion requests, checked by pydantic.

Strict: a field of the wrong JSON type is refused, not coerced ("5" is not a number), and a field
the server does not know is refused (a typo must not be silently ignored). Fields OpenAI defines
that ggx does not implement are accepted only with the value that means "off" (n = 1, penalties
0, ...), so a client sending its defaults works and one asking for more is told what is missing.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

#: most stop sequences per request (OpenAI's limit)
MAX_STOP = 4
MAX_STOP_CHARS = 256
MAX_MESSAGES = 4096
MAX_TOP_LOGPROBS = 20


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | Annotated[list[TextPart], Field(max_length=MAX_MESSAGES)]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


Stop = str | Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]],
                       Field(max_length=MAX_STOP)] | None


class _Sampling(_Strict):
    """What chat and completion requests share."""

    model: str | None = None  # any name: the server serves the model it loaded
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0  # llama-server's extension; 0 keeps every token
    seed: int | None = None
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    presence_penalty: Literal[0, 0.0] = 0
    frequency_penalty: Literal[0, 0.0] = 0
    user: str | None = None

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s]


class ChatRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[int, Field(ge=0)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    @model_validator(mode="after")
    def _one_limit(self) -> ChatRequest:
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens disagree")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=0)] | None = 16  # OpenAI's default for completions
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: Literal[False] = False
    best_of: Literal[1] | None = None
    suffix: None = None

    def limit(self) -> int | None:
        return self.max_tokens
