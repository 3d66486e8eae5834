from pathlib import Path
from typing import Any

import gguf
import pytest
import tokenizers

from engine.chat_template import ChatTemplate
from engine.errors import InvalidRequestError, ModelLoadError
from engine.tokenizer import Tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! 🙂"},
        {"role": "user", "content": "日本語で"},
    ],
]

# Iterates message content, so it expects OpenAI-style lists of parts.
PARTS_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}:"
    "{% for p in m['content'] %}[{{ p.type }}={{ p.text }}]{% endfor %};{% endfor %}"
)


@pytest.fixture(scope="module")
def smollm(embedded_gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf.GGUFReader(str(embedded_gguf_path)))


@pytest.fixture(scope="module")
def hf_tokenizer(embedded_gguf_path: Path) -> Any:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(embedded_gguf_path.parent, gguf_file=embedded_gguf_path.name)


# ---- parity with transformers on the embedded model's template ------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm_template_matches_transformers(
    smollm: Tokenizer, hf_tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool
):
    ours = smollm.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs


@pytest.mark.slow
@pytest.mark.parametrize("reply", ["Hello! 🙂", "Once upon a time ", "  Sure:\n"])
def test_continue_final_message_matches_transformers(smollm: Tokenizer, hf_tokenizer: Any, reply: str):
    messages = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": reply}]
    ours = smollm.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    theirs = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert ours == theirs and ours.rstrip().endswith(reply.strip()) and "<|im_end|>" not in ours[-20:]


def test_continue_final_message_refuses_what_it_cannot_continue():
    template = ChatTemplate("{% for m in messages %}<{{ m.content | upper }}>{% endfor %}")
    with pytest.raises(InvalidRequestError, match="does not write"):  # the template changed the text
        template.render([{"role": "assistant", "content": "abc"}], add_generation_prompt=False, continue_final_message=True)
    plain = ChatTemplate("{% for m in messages %}<{{ m.content }}>{% endfor %}")
    with pytest.raises(InvalidRequestError, match="text to continue"):
        plain.render([{"role": "assistant", "content": " "}], add_generation_prompt=False, continue_final_message=True)
    with pytest.raises(InvalidRequestError, match="cannot both"):
        plain.render([{"role": "assistant", "content": "abc"}], add_generation_prompt=True, continue_final_message=True)
    assert plain.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": "abc"}],
                        add_generation_prompt=False, continue_final_message=True) == "<x><abc"


@pytest.mark.slow
def test_smollm_template_adds_default_system_prompt(smollm: Tokenizer):
    rendered = smollm.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert rendered == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.slow
def test_smollm_template_flattens_text_parts(smollm: Tokenizer):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    assert smollm.apply_chat_template(parts) == smollm.apply_chat_template([{"role": "user", "content": "Hi\nthere"}])


# ---- ChatTemplate on its own -----------------------------------------------------------------


def test_raise_exception_becomes_invalid_request():
    template = ChatTemplate(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
    )
    with pytest.raises(InvalidRequestError, match="first must be user"):
        template.render([{"role": "assistant", "content": "x"}])


def test_type_error_in_template_becomes_invalid_request():
    with pytest.raises(InvalidRequestError, match="chat template error"):
        ChatTemplate("{{ messages[0]['content'] + 1 }}").render([{"role": "user", "content": "x"}])


def test_syntax_error_is_a_model_load_error():
    with pytest.raises(ModelLoadError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")


def test_sandbox_blocks_attribute_escape():
    with pytest.raises(InvalidRequestError):
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([])


def test_tojson_keeps_html_and_unicode_unescaped():
    template = ChatTemplate("{{ tools | tojson }}")
    assert template.render([], tools=[{"d": "<a> & 日本"}]) == '[{"d": "<a> & 日本"}]'


def test_strftime_now_is_available():
    assert len(ChatTemplate("{{ strftime_now('%Y') }}").render([])) == 4


def test_special_tokens_and_extra_variables_reach_the_template():
    template = ChatTemplate(
        "{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}{% if enable_thinking %}T{% endif %}",
        special_tokens={"bos_token": "<s>", "eos_token": "</s>"},
    )
    assert template.render([{"role": "user", "content": "x"}], enable_thinking=True) == "<s>x</s>T"


def test_trim_and_lstrip_blocks_like_hf():
    template = ChatTemplate(
        "{% for m in messages %}\n    {% if m.role %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}"
    )
    assert template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "a\nb\n"


def test_add_generation_prompt_is_passed():
    template = ChatTemplate("{% if add_generation_prompt %}GEN{% endif %}")
    assert template.render([], add_generation_prompt=True) == "GEN"
    assert template.render([], add_generation_prompt=False) == ""


def test_null_fields_are_dropped():
    # OpenAI sends content=None beside tool_calls; the template must see the key as absent.
    template = ChatTemplate("{% for m in messages %}{{ 'content' in m }}{% endfor %}")
    assert template.render([{"role": "assistant", "content": None, "tool_calls": []}]) == "False"


def test_generation_tag_renders_its_body():
    template = ChatTemplate("{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}")
    assert template.render([{"role": "assistant", "content": "ok"}]) == "ok"


def test_loop_controls_are_enabled():
    template = ChatTemplate(
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}"
    )
    assert template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "a"


def test_string_template_gets_text_parts_joined():
    template = ChatTemplate("{{ messages[0]['content'] }}")
    assert template.content_format == "string"
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    assert template.render([{"role": "user", "content": parts}]) == "one\ntwo"


def test_string_template_rejects_image_parts():
    template = ChatTemplate("{{ messages[0]['content'] }}")
    parts = [{"type": "image_url", "image_url": {"url": "data:,"}}]
    with pytest.raises(InvalidRequestError, match="image_url"):
        template.render([{"role": "user", "content": parts}])


def test_parts_template_gets_lists_of_parts():
    template = ChatTemplate(PARTS_TEMPLATE)
    assert template.content_format == "openai"
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert template.render(messages) == "user:[text=a][text=b];"


def test_parts_template_also_rejects_image_parts():
    parts = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    with pytest.raises(InvalidRequestError, match="image_url"):
        ChatTemplate(PARTS_TEMPLATE).render([{"role": "user", "content": parts}])


@pytest.mark.parametrize(
    "source, expected",
    [
        (
            "{% for m in messages %}{% for p in m.content | selectattr('type', 'equalto', 'text') %}"
            "{% endfor %}{% endfor %}",
            "openai",
        ),
        ("{% for m in messages %}{% set c = m['content'] %}{% for p in c %}{% endfor %}{% endfor %}", "openai"),
        ("{% for m in messages %}{% for line in m.content.split('\\n') %}{{ line }}{% endfor %}{% endfor %}", "string"),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", "string"),
    ],
)
def test_content_format_detection(source: str, expected: str):
    assert ChatTemplate(source).content_format == expected


@pytest.mark.parametrize(
    "source, token",
    [
        ("{{ '<|im_start|>' + m + '<|im_end|>' }}", "<|im_end|>"),
        ("<|start_header_id|>{{ x }}<|eot_id|>", "<|eot_id|>"),
        ("<start_of_turn>{{ x }}<end_of_turn>", "<end_of_turn>"),
        ("{{ x }}", None),
    ],
)
def test_end_of_turn_token(source: str, token: str | None):
    assert ChatTemplate(source).end_of_turn_token == token


def test_tokenizer_without_template_refuses_chat():
    backend = tokenizers.Tokenizer(tokenizers.models.BPE({"a": 0}, []))
    tok = Tokenizer(backend, bos_token_id=None, eos_token_ids=(), add_bos=False, chat_template=None)
    with pytest.raises(InvalidRequestError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "a"}])
