"""Chat prompts: one user turn in the model's chat format, detected from the file.

llama.cpp detects the format from the file's `tokenizer.chat_template` (a Jinja template) by the
markers it contains (llm_chat_detect_template); files without a template (this Gemma 3 file has
none) are recognized by the special tokens of their vocabulary. Two formats are known: ChatML
(SmolLM2, Qwen: <|im_start|>role ... <|im_end|>) and Gemma's (<start_of_turn>user ...
<end_of_turn>, the assistant's role called "model", a system message folded into the first
user turn).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import GGXFormatError


@dataclass(frozen=True)
class ChatFormat:
    name: str
    marker: str  # a special token only this format uses
    turn: str  # one message: {role}, {content}
    assistant_role: str
    system_in_user: bool = False  # no system role: the system text opens the first user turn

    def prompt(self, user: str, system: str | None = None) -> str:
        """The text of one user turn (after an optional system message), ending where the
        assistant's answer begins."""
        parts = []
        if system and self.system_in_user:
            user = f"{system}\n\n{user}"
        elif system:
            parts.append(self.turn.format(role="system", content=system))
        parts.append(self.turn.format(role="user", content=user))
        head = self.turn.split("{content}")[0].format(role=self.assistant_role)
        return "".join(parts) + head


FORMATS = (
    ChatFormat("chatml", "<|im_start|>", "<|im_start|>{role}\n{content}<|im_end|>\n", "assistant"),
    ChatFormat("gemma", "<start_of_turn>", "<start_of_turn>{role}\n{content}<end_of_turn>\n", "model",
               system_in_user=True),
)


def detect_chat_format(template: str | None, vocab: Sequence[str]) -> ChatFormat:
    """The chat format of a model from its chat template text, else from its vocabulary."""
    for fmt in FORMATS:
        if template and fmt.marker in template:
            return fmt
    tokens = set(vocab)
    for fmt in FORMATS:
        if fmt.marker in tokens:
            return fmt
    raise GGXFormatError(f"no known chat format for this model (ggx knows {', '.join(f.name for f in FORMATS)}); "
                         "give the whole prompt with its special tokens instead")
