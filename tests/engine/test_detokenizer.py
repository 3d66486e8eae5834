from pathlib import Path

import gguf
import pytest

from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import Tokenizer

# Emoji, CJK, accents and a flag: byte-level BPE splits several of these mid-character.
STREAMED_TEXTS = [
    "naïve café 日本語 🙂 done",
    "深度学习模型🚀🔥 and 🇯🇵 flags",
    "mixed: Ωμέγα → ∑ x² ≤ 𝔽 🙂🙂🙂",
]


class FakeTokens:
    """Byte tokens without a model: id i stands for VOCAB[i]; id 9 is special."""

    VOCAB = {0: b"a", 1: "€".encode()[:1], 2: "€".encode()[1:2], 3: "€".encode()[2:], 4: b"\xff", 9: b"<s>"}

    def token_bytes(self, token_id: int) -> bytes:
        return self.VOCAB[token_id]

    def is_special(self, token_id: int) -> bool:
        return token_id == 9


@pytest.fixture(scope="module")
def tokenizer(embedded_gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf.GGUFReader(str(embedded_gguf_path)))


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.step([i]) for i in ids] + [detok.flush()]


def test_split_character_is_held_until_complete():
    detok = IncrementalDetokenizer(FakeTokens())
    assert [detok.step([i]) for i in [0, 1, 2, 3, 0]] == ["a", "", "", "€", "a"]


def test_step_accepts_several_ids_at_once():
    detok = IncrementalDetokenizer(FakeTokens())
    assert detok.step([1, 2]) == ""
    assert detok.step([3, 0]) == "€a"


def test_flush_replaces_an_unfinished_character():
    detok = IncrementalDetokenizer(FakeTokens())
    assert detok.step([0, 1, 2]) == "a"
    assert detok.flush() == "\ufffd"


def test_invalid_byte_is_replaced_without_waiting():
    detok = IncrementalDetokenizer(FakeTokens())
    assert detok.step([4]) == "\ufffd"


def test_special_tokens_skipped_or_kept():
    assert IncrementalDetokenizer(FakeTokens()).step([9, 0]) == "a"
    assert IncrementalDetokenizer(FakeTokens(), skip_special_tokens=False).step([9, 0]) == "<s>a"


@pytest.mark.parametrize("text", STREAMED_TEXTS)
def test_streaming_never_emits_a_broken_character(tokenizer: Tokenizer, text: str):
    ids = tokenizer.encode(text)
    # The test only means something if some token really is a partial character.
    assert any(_is_partial_utf8(tokenizer.token_bytes(i)) for i in ids)
    deltas = stream(IncrementalDetokenizer(tokenizer), ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == text


def test_streaming_matches_decode_with_and_without_specials(tokenizer: Tokenizer):
    ids = tokenizer.encode("<|im_start|>assistant\n日本語 🙂<|im_end|>")
    assert "".join(stream(IncrementalDetokenizer(tokenizer), ids)) == tokenizer.decode(ids)
    kept = "".join(stream(IncrementalDetokenizer(tokenizer, skip_special_tokens=False), ids))
    assert kept == tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>assistant\n日本語 🙂<|im_end|>"


def test_truncated_character_at_end_matches_lossy_decode(tokenizer: Tokenizer):
    ids = tokenizer.encode("ok 🚀")
    ids = ids[:-1]  # cut the rocket's last byte-level token: b"\x80"
    deltas = stream(IncrementalDetokenizer(tokenizer), ids)
    assert all("\ufffd" not in d for d in deltas[:-1])
    assert deltas[-1] == "\ufffd"
    assert "".join(deltas) == tokenizer.decode(ids) == "ok \ufffd"


def _is_partial_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False
