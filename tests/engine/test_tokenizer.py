import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import gguf
import pytest

from engine.errors import ModelLoadError, UnsupportedModelError
from engine.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

PARITY_TEXTS = [
    "Hello, world!",
    "12345",
    "pi is 3.14159 and 1e-9",
    "naïve café 日本語 🙂",
    "a  b   c    d",
    "line one\nline two\n\n\nline five\r\n",
    "\t\tindented\ttabs  ",
    "   leading spaces",
    "def f(x):\n    return x**2  # square\n",
    "It's they're we'll I'd",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<repo_name>x",
    "",
]


@pytest.fixture(scope="module")
def tokenizer(embedded_gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf.GGUFReader(str(embedded_gguf_path)))


@pytest.fixture(scope="module")
def hf_tokenizer(embedded_gguf_path: Path) -> Any:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(embedded_gguf_path.parent, gguf_file=embedded_gguf_path.name)


@pytest.fixture(scope="module")
def hf_dir_base(hf_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face tokenizer dir as save_pretrained writes it, plus a generation_config.json."""
    path = tmp_path_factory.mktemp("hf_tokenizer")
    hf_tokenizer.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    return path


@pytest.fixture
def hf_dir(hf_dir_base: Path, tmp_path: Path) -> Path:
    """A private copy of `hf_dir_base` that a test may change."""
    return Path(shutil.copytree(hf_dir_base, tmp_path / "model"))


# ---- GGUF --------------------------------------------------------------------------------


@pytest.mark.parametrize("text", PARITY_TEXTS)
def test_gguf_ids_match_transformers(tokenizer: Tokenizer, hf_tokenizer: Any, text: str):
    assert tokenizer.encode(text) == hf_tokenizer.encode(text)


def test_smollm_isolates_digits_like_its_tokenizer_json(tokenizer: Tokenizer, hf_tokenizer: Any):
    # NOTE: transformers' GGUF converter ignores pre='smollm' and gives [81, 216, 216, 33] for "a  1".
    # SmolLM2's tokenizer.json (and llama.cpp) split digits off first: "a", "  " -> "ĠĠ" (256), "1".
    from tokenizers import Tokenizer as Backend
    from tokenizers import pre_tokenizers

    reference = Backend.from_str(hf_tokenizer.backend_tokenizer.to_str())
    reference.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    assert tokenizer.encode("a  1") == [81, 256, 33]
    for text in ["a  1", "x\n\n42", "v1.2.3  4", "total:   100 items", *PARITY_TEXTS]:
        assert tokenizer.encode(text) == reference.encode(text).ids, text


@pytest.mark.parametrize("text", PARITY_TEXTS)
def test_decode_round_trips(tokenizer: Tokenizer, text: str):
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text


def test_decode_skips_special_tokens_by_default(tokenizer: Tokenizer):
    ids = tokenizer.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tokenizer.decode(ids) == "user\nHi"


def test_special_token_ids_come_from_metadata(tokenizer: Tokenizer):
    assert tokenizer.vocab_size == 49152
    assert tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_ids == frozenset({0, 2})  # <|im_end|> and <|endoftext|>
    assert tokenizer.add_bos is False
    assert tokenizer.all_special_ids == frozenset(range(17))  # the control tokens
    assert tokenizer.is_special(2) and not tokenizer.is_special(33)
    assert tokenizer.convert_ids_to_tokens([1, 216, 33]) == ["<|im_start|>", "Ġ", "1"]


def test_no_bos_added_when_metadata_says_so(tokenizer: Tokenizer):
    assert tokenizer.encode("Hi", add_special_tokens=True) == tokenizer.encode("Hi", add_special_tokens=False)


def test_token_bytes_agree_with_decode_for_every_token(tokenizer: Tokenizer):
    for token_id in range(tokenizer.vocab_size):
        raw = tokenizer.token_bytes(token_id)
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        assert raw.decode("utf-8", errors="replace") == text, token_id


def test_encode_is_thread_safe(tokenizer: Tokenizer):
    texts = [f"request {i}: naïve 日本語 {i * 7919}" for i in range(64)]
    expected = [tokenizer.encode(t) for t in texts]
    with ThreadPoolExecutor(max_workers=4) as pool:
        assert list(pool.map(tokenizer.encode, texts)) == expected


class FakeField:
    def __init__(self, value: Any) -> None:
        self.value = value

    def contents(self) -> Any:
        return self.value


class FakeReader:
    """Just the `fields` mapping Tokenizer.from_gguf reads."""

    def __init__(self, **metadata: Any) -> None:
        self.fields = {"tokenizer.ggml." + k: FakeField(v) for k, v in metadata.items()}


def tiny_gguf(**overrides: Any) -> FakeReader:
    metadata: dict[str, Any] = dict(
        model="gpt2", pre="gpt2", tokens=["<s>", "</s>", "a", "b", "ab"], token_type=[3, 3, 1, 1, 1],
        merges=["a b"], bos_token_id=0, eos_token_id=1, add_bos_token=True,
    )
    return FakeReader(**{**metadata, **overrides})


def test_gguf_add_bos_prepends_bos():
    tok = Tokenizer.from_gguf(tiny_gguf())
    assert tok.add_bos and tok.encode("ab") == [0, 4]
    assert tok.encode("ab", add_special_tokens=False) == [4]
    assert tok.eos_token_ids == frozenset({1}) and tok.chat_template is None


def test_gguf_user_defined_tokens_stay_whole_but_are_not_special():
    tok = Tokenizer.from_gguf(tiny_gguf(tokens=["<s>", "</s>", "a", "b", "<t>"], token_type=[3, 3, 1, 1, 4], merges=[]))
    assert tok.encode("a<t>b", add_special_tokens=False) == [2, 4, 3]
    assert not tok.is_special(4)
    assert tok.decode([2, 4, 3]) == "a<t>b"


@pytest.mark.parametrize("model", ["llama", "bert", None])
def test_gguf_unsupported_tokenizer_model_raises(model: str | None):
    with pytest.raises(UnsupportedModelError, match="tokenizer model"):
        Tokenizer.from_gguf(tiny_gguf(model=model))


def test_gguf_unknown_pre_tokenizer_raises():
    with pytest.raises(UnsupportedModelError, match="pre-tokenizer 'qwen9'"):
        Tokenizer.from_gguf(tiny_gguf(pre="qwen9"))


def test_gguf_without_merges_raises():
    reader = tiny_gguf()
    del reader.fields["tokenizer.ggml.merges"]
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.merges"):
        Tokenizer.from_gguf(reader)


# ---- Hugging Face dir ----------------------------------------------------------------------


def test_hf_dir_reads_eos_list_and_template(hf_dir: Path, tokenizer: Tokenizer, hf_tokenizer: Any):
    tok = Tokenizer.from_hf_dir(hf_dir)
    assert tok.eos_token_ids == frozenset({2, 5})  # generation_config list + eos_token <|im_end|>
    assert tok.bos_token_id == 1
    assert tok.add_bos is False
    assert tok.chat_template == tokenizer.chat_template
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}]) == hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    for text in PARITY_TEXTS:
        assert tok.encode(text) == hf_tokenizer.encode(text), text


def test_hf_dir_falls_back_to_config_json_eos(hf_dir: Path):
    (hf_dir / "generation_config.json").unlink()
    (hf_dir / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert Tokenizer.from_hf_dir(hf_dir).eos_token_ids == frozenset({2, 7})


def test_hf_dir_template_from_tokenizer_config(hf_dir: Path):
    (hf_dir / "chat_template.jinja").unlink()
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "{{ messages[0]['content'] }}<|im_end|>"}]
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_hf_dir(hf_dir)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "x<|im_end|>"


def test_hf_dir_add_bos_token_flag_is_honoured(hf_dir: Path):
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    tok = Tokenizer.from_hf_dir(hf_dir)
    assert tok.add_bos
    assert tok.encode("Hi") == [1, *tok.encode("Hi", add_special_tokens=False)]


def test_hf_dir_missing_tokenizer_json_raises(hf_dir: Path):
    (hf_dir / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(hf_dir)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "generation_config.json"])
def test_hf_dir_corrupt_file_raises_naming_it(hf_dir: Path, name: str):
    (hf_dir / name).write_text("{not json")
    with pytest.raises(ModelLoadError, match=name):
        Tokenizer.from_hf_dir(hf_dir)
