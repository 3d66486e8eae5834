"""Text <-> token ids for one model, built from a GGUF file or a Hugging Face model dir.

Wraps a `tokenizers.Tokenizer` (Rust, thread-safe: encode/decode may run on executor
threads) plus what serving needs beside it: BOS/EOS ids, the chat template, and the raw
bytes of every token for UTF-8-safe streaming. Only byte-level BPE vocabularies are
supported; anything else is an UnsupportedModelError.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, pre_tokenizers, processors

from engine.chat_template import ChatTemplate
from engine.errors import InvalidRequestError, ModelLoadError, UnsupportedModelError


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level vocabularies are spelled in."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(shifted)}}


_CHAR_OF_BYTE = _bytes_to_unicode()
_BYTE_OF_CHAR = {c: b for b, c in _CHAR_OF_BYTE.items()}

# GGUF `tokenizer.ggml.pre` -> how text is split before BPE, as the model's own
# tokenizer.json does it. NOTE: 'smollm'/'starcoder' isolate every digit first (HF:
# Digits(individual_digits=True); llama.cpp: a leading \p{N} split). transformers' GGUF
# converter misses this and differs on whitespace before a digit ("a  1").
_GGUF_PRE_TOKENIZERS = {
    "default": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "gpt2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "smollm": lambda: pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    ),
    "starcoder": lambda: pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    ),
}
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4  # llama.cpp token types


class Tokenizer:
    """One model's tokenizer. Immutable after construction; safe to share across threads."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Iterable[int],
        add_bos: bool,
        chat_template: ChatTemplate | None,
    ) -> None:
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = frozenset(eos_token_ids)
        self.add_bos = add_bos
        added = backend.get_added_tokens_decoder()
        self.all_special_ids = frozenset(i for i, t in added.items() if t.special)
        # What each id stands for in bytes, spelled as the ByteLevel decoder reads it (added
        # tokens too), so streamed bytes match `decode` exactly.
        self._token_bytes = tuple(
            _spelled_bytes(backend.id_to_token(i) or "") for i in range(backend.get_vocab_size(with_added_tokens=True))
        )
        self._chat_template = chat_template

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, reader: Any) -> Tokenizer:
        """Build from a `gguf.GGUFReader`'s `tokenizer.*` metadata (llama.cpp's key names)."""
        meta = _GgufFields(reader)
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise UnsupportedModelError(f"GGUF tokenizer model {model!r} is not supported (only 'gpt2' byte-level BPE)")
        pre = meta.get("tokenizer.ggml.pre") or "default"
        if pre not in _GGUF_PRE_TOKENIZERS:
            raise UnsupportedModelError(
                f"GGUF pre-tokenizer {pre!r} is not supported (supported: {sorted(_GGUF_PRE_TOKENIZERS)})"
            )
        if meta.get("tokenizer.ggml.add_space_prefix"):
            raise UnsupportedModelError("GGUF byte-level tokenizer with add_space_prefix=True is not supported")
        tokens: list[str] = meta.require("tokenizer.ggml.tokens")
        merges: list[str] = meta.require("tokenizer.ggml.merges")
        types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if len(types) != len(tokens):
            raise ModelLoadError(f"GGUF token_type has {len(types)} entries for {len(tokens)} tokens")

        # Control/user-defined tokens keep their text (matched whole in input); normal
        # tokens must be in the byte alphabet, so respell any that a converter stored raw.
        vocab = {
            t if types[i] in (_GGUF_CONTROL, _GGUF_USER_DEFINED) or set(t) <= _BYTE_OF_CHAR.keys() else _spell(t): i
            for i, t in enumerate(tokens)
        }
        try:
            pairs = [tuple(m.split(" ")) for m in merges]
            bpe = tokenizers.models.BPE(vocab=vocab, merges=pairs)
        except Exception as e:  # NOTE: the Rust side raises plain Exception for bad merges
            raise ModelLoadError(f"GGUF tokenizer merges are invalid: {e}") from e
        backend = tokenizers.Tokenizer(bpe)
        backend.pre_tokenizer = _GGUF_PRE_TOKENIZERS[pre]()
        backend.decoder = decoders.ByteLevel()
        specials = [t for t, k in zip(tokens, types) if k == _GGUF_CONTROL]
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        user = [t for t, k in zip(tokens, types) if k == _GGUF_USER_DEFINED]
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

        bos_id = meta.get("tokenizer.ggml.bos_token_id")
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos_id is not None
        if add_bos:
            _set_bos_post_processor(backend, (tokens[bos_id], bos_id))
        eos_id = meta.get("tokenizer.ggml.eos_token_id")
        template = _chat_template(backend, meta.get("tokenizer.chat_template"), bos_id, eos_id)
        eos_ids = {eos_id, meta.get("tokenizer.ggml.eot_token_id"), _end_of_turn_id(backend, template)}
        # NOTE: gpt2-style families also end documents with <|endoftext|>, and small chat
        # models emit it in place of the end-of-turn token; treat it as an end token too.
        eos_ids.add(backend.token_to_id("<|endoftext|>"))
        return cls(
            backend, bos_token_id=bos_id, eos_token_ids=eos_ids - {None}, add_bos=add_bos, chat_template=template
        )

    @classmethod
    def from_hf_dir(cls, path: Path) -> Tokenizer:
        """Build from tokenizer.json (+ tokenizer_config.json, generation_config.json, config.json)."""
        path = Path(path)
        tokenizer_json = path / "tokenizer.json"
        if not tokenizer_json.is_file():
            raise ModelLoadError(f"{tokenizer_json}: missing (a tokenizer.json is required)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_json))
        except Exception as e:  # NOTE: the Rust side raises plain Exception on parse errors
            raise ModelLoadError(f"{tokenizer_json}: not a valid tokenizer.json: {e}") from e
        decoder = json.loads(backend.decoder.__getstate__()) if backend.decoder is not None else None
        if "ByteLevel" not in json.dumps(decoder):
            raise UnsupportedModelError(f"{tokenizer_json}: only byte-level BPE tokenizers are supported")
        tok_config = _read_json(path / "tokenizer_config.json")
        gen_config = _read_json(path / "generation_config.json")
        model_config = _read_json(path / "config.json")

        def token_id(name: str) -> int | None:
            value = tok_config.get(name)
            content = value.get("content") if isinstance(value, Mapping) else value
            return backend.token_to_id(content) if isinstance(content, str) else None

        bos_id = token_id("bos_token")
        if bos_id is None:
            bos_id = gen_config.get("bos_token_id", model_config.get("bos_token_id"))
        # config.json is the fallback: generation_config.json is what generate() obeys.
        eos_ids = _as_id_set(gen_config.get("eos_token_id", model_config.get("eos_token_id")))
        eos_id = token_id("eos_token")
        template = _chat_template(backend, _hf_chat_template(path, tok_config), bos_id, eos_id)
        eos_ids |= {eos_id, _end_of_turn_id(backend, template)} - {None}

        adds_bos = bos_id is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos_id]
        add_bos = bool(tok_config.get("add_bos_token", adds_bos)) and bos_id is not None
        if add_bos != adds_bos:
            # NOTE: an explicit add_bos_token wins over tokenizer.json's post-processor.
            _set_bos_post_processor(backend, (backend.id_to_token(bos_id), bos_id) if add_bos else None)
        return cls(backend, bos_token_id=bos_id, eos_token_ids=eos_ids, add_bos=add_bos, chat_template=template)

    # ---- the API the engine uses ------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._token_bytes)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template.source if self._chat_template else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token strings inside it become their ids, as in HF."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self._backend.id_to_token(i) for i in ids]

    def to_json(self) -> str:
        """The tokenizer as the `tokenizers` library serializes it (what llguidance builds its own from)."""
        return self._backend.to_str()

    def is_special(self, token_id: int) -> bool:
        return token_id in self.all_special_ids

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes `token_id` stands for (may be part of one UTF-8 character)."""
        return self._token_bytes[token_id]

    @property
    def chat_template_takes_tools(self) -> bool:
        return self._chat_template is not None and self._chat_template.takes_tools

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        **extra: Any,
    ) -> str:
        if self._chat_template is None:
            raise InvalidRequestError("this model has no chat template; use the completions API")
        return self._chat_template.render(
            messages, add_generation_prompt=add_generation_prompt, tools=tools,
            continue_final_message=continue_final_message, **extra,
        )


class _GgufFields:
    """Typed access to a GGUFReader's metadata fields."""

    def __init__(self, reader: Any) -> None:
        self._fields = reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"GGUF file has no {key!r}")
        return value


def _spell(token: str) -> str:
    return "".join(_CHAR_OF_BYTE[b] for b in token.encode("utf-8"))


def _spelled_bytes(token: str) -> bytes:
    # NOTE: a character outside the byte alphabet (only in added tokens) passes through as
    # UTF-8, exactly as tokenizers' ByteLevel decoder treats it.
    return b"".join(bytes([_BYTE_OF_CHAR[c]]) if c in _BYTE_OF_CHAR else c.encode("utf-8") for c in token)


def _set_bos_post_processor(backend: tokenizers.Tokenizer, bos: tuple[str, int] | None) -> None:
    """Make `encode(add_special_tokens=True)` prepend `bos` (token, id), or nothing when None."""
    if bos is None:
        backend.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1")
        return
    token = bos[0]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{token} $A", pair=f"{token} $A {token} $B:1", special_tokens=[bos]
    )


def _chat_template(
    backend: tokenizers.Tokenizer, source: str | None, bos_id: int | None, eos_id: int | None
) -> ChatTemplate | None:
    if not source:
        return None
    ids = {"bos_token": bos_id, "eos_token": eos_id}
    return ChatTemplate(source, special_tokens={k: backend.id_to_token(i) for k, i in ids.items() if i is not None})


def _end_of_turn_id(backend: tokenizers.Tokenizer, template: ChatTemplate | None) -> int | None:
    token = template.end_of_turn_token if template else None
    return backend.token_to_id(token) if token else None


def _as_id_set(value: Any) -> set[int]:
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int)}
    return set()


def _read_json(path: Path) -> dict[str, Any]:
    """An optional JSON config: {} when absent, ModelLoadError naming it when corrupt."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot read JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _hf_chat_template(path: Path, tok_config: Mapping[str, Any]) -> str | None:
    """chat_template.jinja (newer transformers) wins over tokenizer_config's chat_template."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{jinja_file}: cannot read: {e}") from e
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None
