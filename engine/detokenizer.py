"""Token ids -> text, one step at a time, never splitting a UTF-8 character.

Byte-level tokens can end in the middle of a multi-byte character (an emoji is often
2-3 tokens). Working on the tokens' raw bytes, each step emits only the longest prefix
that decodes; an incomplete tail waits for the next token. Invalid bytes (which no later
token can fix) become U+FFFD right away, exactly as a whole-sequence decode would.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Protocol


class TokenBytesSource(Protocol):
    """What the detokenizer needs from a tokenizer (engine.tokenizer.Tokenizer has it)."""

    def token_bytes(self, token_id: int) -> bytes: ...

    def is_special(self, token_id: int) -> bool: ...


class IncrementalDetokenizer:
    """One request's output stream. `step` per batch of new ids, `flush` once at the end.

    NOTE: decoded from bytes alone, so a vocabulary whose decoder rewrites text (e.g. strips
    a sentencepiece leading space) would differ; Tokenizer only builds byte-level ones.
    """

    def __init__(self, tokenizer: TokenBytesSource, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # The stdlib incremental decoder holds back exactly an incomplete trailing sequence.
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Text completed by `new_token_ids` (may be '' while a character is incomplete)."""
        tok = self._tokenizer
        data = b"".join(
            tok.token_bytes(i) for i in new_token_ids if not (self._skip_special_tokens and tok.is_special(i))
        )
        return self._decoder.decode(data, final=False)

    def flush(self) -> str:
        """Whatever bytes are still held, with an unfinished character as U+FFFD."""
        return self._decoder.decode(b"", final=True)
