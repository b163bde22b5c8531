"""Chat prompts: a conversation rendered in the model's chat format.

The format is the file's own `tokenizer.chat_template`, a Jinja template, rendered with jinja2 in
a sandboxed environment (as transformers and llama-cpp-python do: a template is untrusted input
and must not reach Python objects beyond its messages) with `messages`, `add_generation_prompt`,
`bos_token` and `eos_token`. As llama.cpp does, a BOS the template writes first is dropped from
the text when the tokenizer adds BOS itself (no doubled BOS).

Files without a template fall back to a hand-written format recognized by the special tokens of
their vocabulary (llama.cpp's llm_chat_detect_template markers): ChatML (SmolLM2, Qwen:
<|im_start|>role ... <|im_end|>) and Gemma's (<start_of_turn>user ... <end_of_turn>, the
assistant's role called "model", a system message folded into the first user turn, contents
trimmed), each rendering what the shipped models' templates render.

The public entry point is `ChatTemplate` (`Model.chat_template`): `render(messages,
add_generation_prompt=True)` for a whole conversation.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ..errors import GGXError, GGXFormatError, GGXValueError

ROLES = ("system", "user", "assistant", "tool")
TEMPLATE_KEY = "tokenizer.chat_template"


@dataclass(frozen=True)
class ChatFormat:
    """A hand-written chat format, the fallback for files without a template."""

    name: str
    marker: str  # a special token only this format uses
    turn: str  # one message: {role}, {content}
    assistant_role: str
    system_in_user: bool = False  # no system role: the system text opens the first user turn
    trim: bool = False  # contents are stripped of surrounding white space

    def render(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation's text, ending where the assistant's answer begins when
        `add_generation_prompt`."""
        msgs, prefix = list(messages), ""
        if self.system_in_user and msgs and msgs[0]["role"] == "system":
            prefix = msgs.pop(0)["content"] + "\n\n"  # opens the next turn (Gemma's template)
        parts = []
        for i, m in enumerate(msgs):
            role = self.assistant_role if m["role"] == "assistant" else m["role"]
            content = (prefix if i == 0 else "") + self._text(m["content"])
            parts.append(self.turn.format(role=role, content=content))
        if add_generation_prompt:
            parts.append(self.turn.split("{content}")[0].format(role=self.assistant_role))
        return "".join(parts)

    def _text(self, s: str) -> str:
        return s.strip() if self.trim else s

    def prompt(self, user: str, system: str | None = None) -> str:
        """One user turn (after an optional system message), ending where the answer begins."""
        return self.render(([{"role": "system", "content": system}] if system else [])
                           + [{"role": "user", "content": user}])


FORMATS = (
    ChatFormat("chatml", "<|im_start|>", "<|im_start|>{role}\n{content}<|im_end|>\n", "assistant"),
    ChatFormat("gemma", "<start_of_turn>", "<start_of_turn>{role}\n{content}<end_of_turn>\n", "model",
               system_in_user=True, trim=True),
)


def detect_chat_format(template: str | None, vocab: Sequence[str]) -> ChatFormat:
    """The hand-written chat format of a model from its chat template text, else from its vocabulary."""
    for fmt in FORMATS:
        if template and fmt.marker in template:
            return fmt
    tokens = set(vocab)
    for fmt in FORMATS:
        if fmt.marker in tokens:
            return fmt
    raise GGXFormatError(f"no chat template in the file and no known chat format for this model (ggx knows "
                         f"{', '.join(f.name for f in FORMATS)}); give the whole prompt with its special "
                         "tokens instead")


def check_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """Messages as {"role", "content"} dicts, checked: a known role, text content (a list of
    {"type": "text", "text": ...} parts, as OpenAI's API sends, is joined)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise GGXValueError(f"messages must be a list of {{'role', 'content'}} mappings, got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise GGXValueError(f"message {i} must be a mapping with 'role' and 'content', got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise GGXValueError(f"message {i}: role {role!r} is not one of {', '.join(ROLES)}")
        if isinstance(content, list):
            if not all(isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise GGXValueError(f"message {i}: content parts must be {{'type': 'text', 'text': str}}")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise GGXValueError(f"message {i}: content must be text, got {type(content).__name__}")
        out.append({"role": role, "content": content})
    return out


def _raise_exception(message: str) -> None:
    raise GGXValueError(f"the chat template refuses these messages: {message}")


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    # transformers' tojson: no ASCII escaping, keys in their order (templates print tool schemas)
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@dataclass
class ChatTemplate:
    """A model's chat format: the file's Jinja template (`source`), else `fallback`.

    `bos_token` / `eos_token` are the texts of the tokenizer's BOS and EOS (templates write them);
    `add_bos`: the tokenizer adds BOS itself, so a rendered text starting with BOS loses it.
    """

    source: str | None
    fallback: ChatFormat | None
    bos_token: str = ""
    eos_token: str = ""
    add_bos: bool = False
    _compiled: Any = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def from_gguf(cls, f: Any, tokenizer: Any) -> ChatTemplate:
        """The chat template of a GGUFFile and its Tokenizer. A template that is not text is a
        GGXFormatError naming the key; a file without one falls back to a known format (or, when
        none fits, renders nothing and says so when asked to)."""
        source = f.get(TEMPLATE_KEY, str, None)
        fallback = None
        if source is None:
            try:
                fallback = detect_chat_format(None, tokenizer.vocab)
            except GGXFormatError:
                fallback = None
        vocab = tokenizer.vocab

        def text(tid: int | None) -> str:
            return vocab[tid] if tid is not None and 0 <= tid < len(vocab) else ""

        return cls(source, fallback, text(tokenizer.bos_id), text(tokenizer.eos_id), bool(tokenizer.add_bos))

    @property
    def name(self) -> str:
        """"jinja" for the file's template, else the fallback format's name."""
        return "jinja" if self.source is not None else (self.fallback.name if self.fallback else "none")

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        """The conversation as prompt text (special tokens as text: the tokenizer parses them),
        ending where the assistant's answer begins when `add_generation_prompt`.

        GGXValueError for malformed messages or ones the template refuses (raise_exception),
        GGXFormatError for a template that does not compile or fails to render."""
        msgs = check_messages(messages)
        if self.source is None:
            if self.fallback is None:
                detect_chat_format(None, ())  # raises: no template, no known format
            return self.fallback.render(msgs, add_generation_prompt)
        try:
            out = self._template().render(messages=msgs, add_generation_prompt=add_generation_prompt,
                                          bos_token=self.bos_token, eos_token=self.eos_token)
        except GGXError:
            raise
        except Exception as e:  # the template's own errors (undefined names, bad operands, the sandbox)
            raise GGXFormatError(f"{TEMPLATE_KEY} failed to render: {type(e).__name__}: {e}") from None
        if self.add_bos and self.bos_token and out.startswith(self.bos_token):
            out = out[len(self.bos_token):]
        return out

    def _template(self) -> Any:
        if self._compiled is None:
            import jinja2
            import jinja2.ext
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            try:
                self._compiled = env.from_string(self.source)
            except jinja2.TemplateError as e:
                raise GGXFormatError(f"{TEMPLATE_KEY} is not a valid Jinja template: {e}") from None
        return self._compiled
