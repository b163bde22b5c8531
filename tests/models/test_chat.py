"""Chat templates: the file's Jinja template rendered in a sandbox, and the hand-written fallbacks
agreeing with the templates of the shipped models."""
from __future__ import annotations

from pathlib import Path

import pytest

from ggx.errors import GGXFormatError, GGXValueError
from ggx.models.chat import FORMATS, ChatTemplate
from ggx.models.gguf_file import GGUFFile
from ggx.models.tokenizer import Tokenizer

DATA = Path(__file__).resolve().parent.parent / "data"
CHATML, GEMMA = FORMATS

CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be kind.\n"}, {"role": "user", "content": "  What is 2+2? "},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?\n"}],
    [{"role": "user", "content": "Tell me {a} joke"}, {"role": "assistant", "content": " Why? "},
     {"role": "user", "content": "Because."}],
]


def _template(path: Path) -> ChatTemplate:
    f = GGUFFile(str(path))
    return ChatTemplate.from_gguf(f, Tokenizer.from_gguf(f))


@pytest.fixture(scope="module")
def smollm2_template(smollm2_path) -> ChatTemplate:
    return _template(smollm2_path)


@pytest.fixture(scope="module")
def gemma3_template(gemma3_path) -> ChatTemplate:
    return _template(gemma3_path)


@pytest.mark.parametrize("messages", CONVERSATIONS[:2])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chatml_fallback_agrees_with_smollm2s_template(smollm2_template, messages, add_generation_prompt):
    assert smollm2_template.name == "jinja"
    rendered = smollm2_template.render(messages, add_generation_prompt)
    assert rendered == CHATML.render(messages, add_generation_prompt)
    assert rendered.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_smollm2s_template_adds_its_default_system_message(smollm2_template):
    out = smollm2_template.render([{"role": "user", "content": "Hi"}])
    assert out == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                   "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_gemma_fallback_agrees_with_gemma3s_template(gemma3_template, messages, add_generation_prompt):
    # the shipped Gemma 3 file has no template: the fallback renders it, and must equal what
    # Gemma 3's own template (the instruction-tuned model's, kept as test data) renders
    assert gemma3_template.name == "gemma" and gemma3_template.add_bos
    official = ChatTemplate((DATA / "gemma3_chat_template.jinja").read_text(encoding="utf-8"), None,
                            gemma3_template.bos_token, gemma3_template.eos_token, add_bos=True)
    expected = official.render(messages, add_generation_prompt)
    assert not expected.startswith("<bos>")  # the tokenizer adds BOS: the template's is dropped
    assert gemma3_template.render(messages, add_generation_prompt) == expected


def test_gemma_template_refuses_roles_out_of_turn(gemma3_template):
    official = ChatTemplate((DATA / "gemma3_chat_template.jinja").read_text(encoding="utf-8"), None, "<bos>")
    with pytest.raises(GGXValueError, match="alternate"):
        official.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert official.render([{"role": "user", "content": "a"}]).startswith("<bos><start_of_turn>user\na")


def test_bos_written_by_the_template_is_kept_unless_the_tokenizer_adds_one():
    src = "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{{ eos_token }}"
    msgs = [{"role": "user", "content": "x"}]
    assert ChatTemplate(src, None, "<s>", "</s>", add_bos=False).render(msgs) == "<s>[user]x</s>"
    assert ChatTemplate(src, None, "<s>", "</s>", add_bos=True).render(msgs) == "[user]x</s>"


def test_text_parts_are_joined():
    src = "{% for m in messages %}{{ m.content }}{% endfor %}"
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert ChatTemplate(src, None).render([{"role": "user", "content": parts}]) == "ab"


@pytest.mark.parametrize("src", [
    "{{ messages.__class__.__mro__[1].__subclasses__() }}",  # the sandbox refuses private attributes
    "{{ messages.append(1) }}",  # and mutation (immutable sandbox)
    "{{ undefined_function() }}",
    "{% for m in messages %}{{ m.content + 1 }}{% endfor %}",
])
def test_unsafe_or_failing_templates_are_format_errors(src):
    with pytest.raises(GGXFormatError, match="tokenizer.chat_template"):
        ChatTemplate(src, None).render([{"role": "user", "content": "x"}])


def test_a_template_that_does_not_compile_names_the_key():
    with pytest.raises(GGXFormatError, match="not a valid Jinja template"):
        ChatTemplate("{% for m in messages %}", None).render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("messages, what", [
    ("hello", "list"),
    ([{"role": "robot", "content": "x"}], "role 'robot'"),
    ([{"role": "user", "content": 3}], "content must be text"),
    ([("user", "x")], "mapping"),
    ([{"role": "user", "content": [{"type": "image"}]}], "content parts"),
])
def test_malformed_messages_are_value_errors(messages, what):
    with pytest.raises(GGXValueError, match=what):
        ChatTemplate("{{ messages }}", None).render(messages)


def test_a_file_without_template_nor_known_format_says_so():
    with pytest.raises(GGXFormatError, match="no chat template"):
        ChatTemplate(None, None).render([{"role": "user", "content": "x"}])
