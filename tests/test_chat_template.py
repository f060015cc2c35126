"""Chat templates and tokenization match transformers exactly.

Reference: transformers' AutoTokenizer.apply_chat_template (and encode/decode) on the same files.
Templates: the tiny models' ChatML, the real SmolLM2-135M-Instruct template (a literal copy, so
the test needs nothing outside the repository), and one that exercises the Jinja environment
(trim/lstrip blocks, loop controls, namespace, tojson, {% generation %}, raise_exception).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jinja2
import pytest
import tokenizers
from tokenizers import processors
from transformers import AutoTokenizer

from llmserve.errors import InvalidArgument
from llmserve.preprocessing.chat_template import ChatTemplate
from llmserve.preprocessing.tokenizer import ModelTokenizer
from llmserve.sampling import ChatMessage
from llmserve.tools.tiny_model import CHATML_TEMPLATE, build_tokenizer

# Copied verbatim from SmolLM2-135M-Instruct's tokenizer_config.json ("chat_template").
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Written with indentation and newlines so that trim_blocks/lstrip_blocks matter.
FEATURE_TEMPLATE = """\
{%- set ns = namespace(turns=0) -%}
{{ bos_token }}
{% for message in messages %}
    {% if message['role'] == 'system' %}
        {% if not loop.first %}
            {{ raise_exception('System message must come first, found it at position ' ~ loop.index0) }}
        {% endif %}
<<SYS>>{{ message['content'] | trim }}<</SYS>>
        {% continue %}
    {% endif %}
    {% set ns.turns = ns.turns + 1 %}
    {% generation %}[{{ ns.turns }}] {{ message['role'] }}: {{ message['content'] }}{% endgeneration %}

    {{ {'role': message['role'], 'content': message['content'], 'turn': ns.turns} | tojson }}
    {% if loop.index >= 6 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}
[{{ ns.turns + 1 }}] assistant:
{% else %}
{{ eos_token }}
{% endif %}
"""

TEMPLATES = {"chatml": CHATML_TEMPLATE, "smollm2": SMOLLM2_TEMPLATE, "features": FEATURE_TEMPLATE}

CONVERSATIONS = {
    "system_first": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"},
    ],
    "no_system": [{"role": "user", "content": "Hello there"}],
    "multi_turn": [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Capital of Italy?"},
        {"role": "assistant", "content": "Rome."},
        {"role": "user", "content": "And of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "Welcome."},
        {"role": "user", "content": "Bye"},
    ],
    "unicode": [
        {"role": "user", "content": "Héllo wörld — naïve café, 東京 and 北京 🙂🚀\n  indented line\t<b>&'\"</b>"},
        {"role": "assistant", "content": "  leading and trailing spaces  "},
        {"role": "user", "content": "ok"},
    ],
    "tool_and_empty": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": '{"temp_c": 21}'},
    ],
    "special_tokens_in_content": [{"role": "user", "content": "a<|im_end|>b<|im_start|>system\nc"}],
}


def _tokenizer_config(template: str, **extra) -> dict:
    # The special tokens of SmolLM2's own tokenizer_config.json, on the tiny tokenizer.
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "chat_template": template,
        "model_max_length": 256,
        "clean_up_tokenization_spaces": False,
        **extra,
    }


@pytest.fixture(scope="module")
def base_tokenizer_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path)
    return path


def _tokenizer_dir(base: Path, path: Path, config: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    shutil.copy(base / "tokenizer.json", path / "tokenizer.json")
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def tokenizer_dirs(base_tokenizer_dir, tmp_path_factory) -> dict[str, Path]:
    """One tokenizer directory per template: "chatml" is the factory's own config."""
    root = tmp_path_factory.mktemp("templates")
    dirs = {"chatml": base_tokenizer_dir}
    for name in ("smollm2", "features"):
        dirs[name] = _tokenizer_dir(base_tokenizer_dir, root / name, _tokenizer_config(TEMPLATES[name]))
    return dirs


@pytest.fixture(scope="module")
def hf_tokenizers(tokenizer_dirs):
    return {name: AutoTokenizer.from_pretrained(path) for name, path in tokenizer_dirs.items()}


@pytest.fixture(scope="module")
def ours(tokenizer_dirs):
    """(ModelTokenizer, ChatTemplate) per template, loaded the way the service loads them."""
    loaded = {}
    for name, path in tokenizer_dirs.items():
        tokenizer = ModelTokenizer.load(path)
        loaded[name] = (tokenizer, ChatTemplate(TEMPLATES[name], tokenizer.special_tokens))
    return loaded


def _messages(conversation: list[dict]) -> list[ChatMessage]:
    return [ChatMessage(m["role"], m["content"]) for m in conversation]


def _hf_chat_ids(hf, conversation, add_generation_prompt) -> list[int]:
    out = hf.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation_name", list(CONVERSATIONS))
@pytest.mark.parametrize("template_name", list(TEMPLATES))
def test_rendering_and_ids_match_transformers(
    template_name, conversation_name, add_generation_prompt, hf_tokenizers, ours
):
    conversation = CONVERSATIONS[conversation_name]
    hf = hf_tokenizers[template_name]
    tokenizer, template = ours[template_name]
    expected_text = hf.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=False)

    rendered = template.render(_messages(conversation), add_generation_prompt=add_generation_prompt)

    assert rendered == expected_text
    # A rendered chat holds its special tokens as text: encoded without adding any.
    assert tokenizer.encode(rendered, add_special_tokens=False) == _hf_chat_ids(
        hf, conversation, add_generation_prompt
    )


def test_smollm2_template_renders_the_expected_text(ours):
    _, template = ours["smollm2"]
    rendered = template.render([ChatMessage("user", "Hi")], add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_template_variables_include_named_special_tokens(ours):
    tokenizer, template = ours["features"]
    assert tokenizer.special_tokens == {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|im_end|>",
    }
    rendered = template.render([ChatMessage("user", "x")], add_generation_prompt=False)
    assert rendered.startswith("<|im_start|>\n")
    assert rendered.endswith("<|im_end|>\n")


def test_raise_exception_becomes_invalid_argument_with_the_template_message(hf_tokenizers, ours):
    conversation = [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]
    with pytest.raises(jinja2.TemplateError, match="found it at position 1"):
        hf_tokenizers["features"].apply_chat_template(conversation, tokenize=False)
    _, template = ours["features"]

    with pytest.raises(InvalidArgument) as caught:
        template.render(_messages(conversation), add_generation_prompt=True)

    assert caught.value.field == "chat"
    assert caught.value.message == (
        "chat: the model's chat template rejected the conversation: "
        "System message must come first, found it at position 1"
    )


def test_sandbox_refuses_to_mutate_the_messages():
    template = ChatTemplate("{% set _ = messages.append(1) %}{{ messages | length }}", {})
    with pytest.raises(InvalidArgument) as caught:
        template.render([ChatMessage("user", "hi")], add_generation_prompt=True)
    assert caught.value.message.startswith("chat: the model's chat template rejected the conversation: ")
    assert "append" in caught.value.message


def test_namespace_refuses_underscore_names():
    template = ChatTemplate("{% set ns = namespace(_secret=1) %}x", {})
    with pytest.raises(InvalidArgument, match="underscore-prefixed attributes on a namespace, got '_secret'"):
        template.render([ChatMessage("user", "hi")], add_generation_prompt=True)


def test_tojson_does_not_escape_html_or_unicode():
    template = ChatTemplate("{{ messages[0] | tojson }}", {})
    rendered = template.render([ChatMessage("user", "<b>&'東京")], add_generation_prompt=True)
    assert rendered == '{"role": "user", "content": "<b>&\'東京"}'


def test_strftime_now_is_available():
    template = ChatTemplate("{{ strftime_now('%Y') | length }}", {})
    assert template.render([ChatMessage("user", "hi")], add_generation_prompt=True) == "4"


def test_a_template_that_does_not_compile_fails_at_construction():
    with pytest.raises(jinja2.TemplateSyntaxError):
        ChatTemplate("{% for m in messages %}no endfor", {})


# --- Plain-text tokenization parity (chat ids above depend on it too) -------------------------

TEXTS = [
    "The capital of France is Paris.",
    "  leading spaces and\nnewlines\n\n",
    "Héllo wörld — naïve café, 東京 🙂🚀",
    "<|im_start|>user\nspecial tokens in text<|im_end|>",
    "",
]


@pytest.fixture(scope="module")
def bos_dir(base_tokenizer_dir, tmp_path_factory) -> Path:
    """Like Llama checkpoints: tokenizer.json's post-processor adds BOS to plain text, and
    tokenizer_config.json also says add_bos_token (transformers' generic backend follows
    tokenizer.json). clean_up_tokenization_spaces is set but transformers skips it for BPE."""
    backend = tokenizers.Tokenizer.from_file(str(base_tokenizer_dir / "tokenizer.json"))
    bos_id = backend.token_to_id("<|im_start|>")
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", pair="<|im_start|> $A <|im_start|> $B", special_tokens=[("<|im_start|>", bos_id)]
    )
    path = tmp_path_factory.mktemp("bos")
    backend.save(str(path / "tokenizer.json"))
    config = _tokenizer_config(SMOLLM2_TEMPLATE, add_bos_token=True, clean_up_tokenization_spaces=True)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("add_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("which", ["chatml", "bos"])
def test_encode_and_decode_match_transformers(which, text, add_special_tokens, tokenizer_dirs, bos_dir):
    path = bos_dir if which == "bos" else tokenizer_dirs[which]
    hf = AutoTokenizer.from_pretrained(path)
    tokenizer = ModelTokenizer.load(path)

    token_ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)

    assert token_ids == hf.encode(text, add_special_tokens=add_special_tokens)
    assert tokenizer.token_strings(token_ids) == hf.convert_ids_to_tokens(token_ids)
    for skip in (True, False):
        assert tokenizer.decode(token_ids, skip_special_tokens=skip) == hf.decode(token_ids, skip_special_tokens=skip)


def test_bos_goes_on_plain_text_but_not_twice_on_a_rendered_chat(bos_dir):
    hf = AutoTokenizer.from_pretrained(bos_dir)
    tokenizer = ModelTokenizer.load(bos_dir)
    bos_id = tokenizer.encode("<|im_start|>", add_special_tokens=False)[0]

    assert tokenizer.encode("Paris", add_special_tokens=True)[0] == bos_id
    template = ChatTemplate(SMOLLM2_TEMPLATE, tokenizer.special_tokens)
    conversation = CONVERSATIONS["system_first"]
    rendered = template.render(_messages(conversation), add_generation_prompt=True)
    chat_ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert chat_ids == _hf_chat_ids(hf, conversation, True)
    assert chat_ids[:2] != [bos_id, bos_id]
