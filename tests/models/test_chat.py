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


# --- conversations in one KV cache ------------------------------------------------------------
# a template in the tiny vocabulary's words: turns are plain text, each message closed by </s>
TINY_TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}{{ eos_token }}{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory):
    from gguf_synth import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("gguf") / "tiny-chat.gguf", chat_template=TINY_TEMPLATE)


def test_generation_reuses_the_cached_prefix_and_matches_a_fresh_one(tiny_chat):
    from ggx.models import load_model

    m = load_model(tiny_chat, devices=["ref"], warmup=False)
    first = m.encode_prompt(m.chat_template.render([{"role": "user", "content": "the cat"}]))
    out1 = [t.id for t in m.generate(first, 6, stop_at_eos=False)]
    assert m.stats.prompt_cached == 0 and m.stats.prompt_tokens == len(first)
    # the conversation goes on: the cache holds `first` and all but the last generated token
    second = first + out1 + m.tokenize(" on the mat")
    out2 = [t.id for t in m.generate(second, 6, stop_at_eos=False, reuse_prefix=True)]
    assert m.stats.prompt_cached == len(first) + len(out1) - 1
    assert m.stats.prompt_tokens == len(second) - m.stats.prompt_cached
    fresh = [t.id for t in m.generate(second, 6, stop_at_eos=False)]
    assert m.stats.prompt_cached == 0 and out2 == fresh
    # a prompt that leaves the cached sequence early keeps only the common part
    third = first[:3] + m.tokenize(" in the sun")
    out3 = [t.id for t in m.generate(third, 4, stop_at_eos=False, reuse_prefix=True)]
    assert m.stats.prompt_cached == 3
    assert out3 == [t.id for t in m.generate(third, 4, stop_at_eos=False)]
    # the same prompt again: every token but the last comes from the cache
    again = [t.id for t in m.generate(third, 4, stop_at_eos=False, reuse_prefix=True)]
    assert m.stats.prompt_cached == len(third) - 1 and again == out3


def test_ggx_chat_holds_the_conversation_in_one_cache(tiny_chat, monkeypatch, capsys):
    import io

    from ggx.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO("the cat\n\nthe mat\n/exit\nnever read\n"))
    assert main(["chat", str(tiny_chat), "--device", "ref", "-n", "4", "--system", "be brief"]) == 0
    err = capsys.readouterr().err
    assert "[turn 1: " in err and ", 0 from the cache" in err.split("[turn 2")[0]
    turn2 = err.split("[turn 2: ")[1]
    assert int(turn2.split(" from the cache")[0].split(", ")[1]) > 10  # the first turn was not evaluated again
    assert "2 turns;" in err


def test_ggx_run_system_implies_chat(tiny_chat, capsys):
    from ggx.cli import main
    from ggx.models import load_model

    assert main(["run", str(tiny_chat), "--device", "ref", "-n", "2", "-p", "the cat", "--system", "be brief"]) == 0
    n_prompt = int(capsys.readouterr().err.split("prompt:")[1].split("tokens")[0])
    m = load_model(tiny_chat, devices=["ref"], warmup=False)
    text = m.chat_template.render([{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat"}])
    assert text.startswith("system: be brief</s>user: the cat</s>assistant:")
    assert n_prompt == len(m.tokenize(text)) > len(m.tokenize("the cat"))


def test_ggx_run_interactive_is_ggx_chat(tiny_chat, monkeypatch, capsys):
    import io

    from ggx.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO("the cat\nthe mat\n"))
    assert main(["run", str(tiny_chat), "--device", "ref", "-i", "-n", "3"]) == 0
    out = capsys.readouterr()
    assert "2 turns;" in out.err and "[turn 2: " in out.err
    assert out.out.count("\n") == 2  # one answer line per turn
