"""Grammar-constrained decoding on llguidance: JSON schemas, regexes, choices and Lark grammars.

A request's StructuredOutputSpec is compiled once into an llguidance grammar (cached by the spec, so a
server that sees a schema twice compiles it once; the async engine compiles off the event loop); each of
its samples gets a GrammarMatcher. Each step the sampler asks the matchers of its constrained rows for
their token bitmask and sets the logits of every other token to -inf; the core feeds each sampled token
back. A completed grammar allows only the end-of-sequence tokens, so the request stops as any other does.

llguidance over xgrammar (vLLM's default): it needs nothing else (xgrammar's wheel asks for triton and
transformers) and compiles faster; xgrammar fills its masks faster (BENCHMARKS.md, issue 59, has both).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import llguidance
import torch

from engine.errors import InvalidRequestError

SpecKind = Literal["json", "json_object", "regex", "choice", "grammar"]

# A schema, regex or grammar's text beyond this is refused, before any compile.
MAX_SOURCE_BYTES = 256 * 1024
# JSON's whitespace between tokens unless a request names its own: bounded, since a small model given any run of
# whitespace can spend its whole max_tokens on newlines; long enough for indented output a few levels deep.
DEFAULT_JSON_WHITESPACE = r"[ \t\n\r]{0,24}"
# Compiled grammars kept (the cache is by spec: the same schema twice compiles once).
MAX_CACHED_GRAMMARS = 256
# The parser's work limits: a grammar past them fails to compile (a clear 400) rather than stall a step.
_LIMITS = dict(max_grammar_size=200_000, initial_lexer_fuel=2_000_000, step_lexer_fuel=400_000, max_lexer_states=100_000)


class StructuredOutputError(InvalidRequestError):
    """A constraint that cannot be compiled; `param` names the request field it came from."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StructuredOutputSpec:
    """What a request's output must match. `source`: the JSON schema (canonical JSON text), the regex, the choices
    (a JSON list of strings) or the Lark grammar; for json_object, "". `param`: the request field it came from."""

    kind: SpecKind
    source: str
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    param: str | None = None

    @staticmethod
    def json_schema(schema: dict | bool, **options) -> StructuredOutputSpec:
        return StructuredOutputSpec("json", json.dumps(schema, sort_keys=True, separators=(",", ":")), **options)

    @staticmethod
    def choice(options: Iterable[str], **kwargs) -> StructuredOutputSpec:
        return StructuredOutputSpec("choice", json.dumps(list(options)), **kwargs)

    def cache_key(self) -> tuple:
        return (self.kind, self.source, self.whitespace_pattern, self.disable_any_whitespace,
                self.disable_additional_properties)


def to_grammar(spec: StructuredOutputSpec) -> str:
    """The llguidance grammar of a spec (not yet checked against the tokenizer)."""
    if len(spec.source.encode()) > MAX_SOURCE_BYTES:
        raise StructuredOutputError(f"the constraint is {len(spec.source.encode())} bytes; at most {MAX_SOURCE_BYTES} "
                                    "are accepted", spec.param)
    options: dict = {}
    if spec.disable_any_whitespace:
        options["whitespace_flexible"] = False
    else:
        options["whitespace_pattern"] = spec.whitespace_pattern or DEFAULT_JSON_WHITESPACE
    try:
        if spec.kind in ("json", "json_object"):
            schema = json.loads(spec.source) if spec.kind == "json" else {"type": "object"}
            if spec.disable_additional_properties:
                schema = _no_additional_properties(schema)
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options or None)
        if spec.kind == "regex":
            # \d as [0-9], as JSON Schema's patterns and xgrammar read it (llguidance's own default is Unicode's digits).
            return llguidance.LLMatcher.grammar_from_lark(f"start: /{llguidance.regex_to_lark(spec.source, 'd')}/")
        if spec.kind == "choice":
            choices = json.loads(spec.source)
            if not choices or not all(isinstance(c, str) for c in choices):
                raise StructuredOutputError("the choices must be a non-empty list of strings", spec.param)
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        return llguidance.grammar_from("grammar", spec.source)  # Lark, or GBNF/EBNF turned into Lark
    except (ValueError, TypeError) as e:
        if isinstance(e, StructuredOutputError):
            raise
        raise StructuredOutputError(f"invalid {spec.kind} constraint: {e}", spec.param) from e


def _no_additional_properties(schema):
    """vLLM's disable_additional_properties: every object schema without its own additionalProperties gets false."""
    if isinstance(schema, list):
        return [_no_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _no_additional_properties(v) for k, v in schema.items()}
    if out.get("type") == "object" or "properties" in out:
        out.setdefault("additionalProperties", False)
    return out


class GrammarCompiler:
    """Compiles specs against one tokenizer, with a bounded cache. Thread-safe: the async engine compiles on an
    executor thread while the engine's steps match on theirs."""

    def __init__(self, tokenizer_json: str, eos_token_ids: Iterable[int], vocab_size: int):
        self._tokenizer_json = tokenizer_json
        self._eos = sorted(eos_token_ids)
        self.vocab_size = vocab_size
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiles = 0

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use (a quarter of a second on a 49k vocabulary), not at every start."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                                         eos_token=self._eos)
            return self._tokenizer

    def compile(self, spec: StructuredOutputSpec) -> CompiledGrammar:
        """The checked grammar of `spec` (cached), with a matcher at its start that each sample's copies. Raises
        StructuredOutputError naming what is wrong."""
        key = spec.cache_key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        grammar = to_grammar(spec)
        tokenizer = self.tokenizer
        limits = llguidance.LLParserLimits(**_LIMITS)
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer, limits=limits)
        if error and not error.startswith("WARNING"):
            raise StructuredOutputError(f"invalid {_NAMES[spec.kind]}: {error.strip()}", spec.param)
        # Samples copy this matcher: building one for a large grammar costs far more (BENCHMARKS.md, issue 59).
        compiled = CompiledGrammar(grammar, llguidance.LLMatcher(tokenizer, grammar, limits=limits))
        with self._lock:
            self.num_compiles += 1
            self._cache[key] = compiled
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, compiled: CompiledGrammar) -> GrammarMatcher:
        return GrammarMatcher(compiled.start.deep_copy(), self._eos)


@dataclass(frozen=True)
class CompiledGrammar:
    grammar: str
    start: llguidance.LLMatcher  # never advanced: samples take copies


_NAMES = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex", "choice": "choice",
          "grammar": "grammar"}


class GrammarMatcher:
    """One sample's place in its grammar. The sampler fills its mask (the worker's thread); the core feeds it the
    sampled token (the next step starts only after)."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids: list[int]):
        self._matcher = matcher
        self._eos = eos_token_ids

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of an int32 [B, ceil(V / 32)] bitmask: the tokens the grammar allows next. A matcher in
        error (a dead end: no token continues the grammar) allows the end-of-sequence tokens only, so that its
        request ends cleanly."""
        if not self._matcher.is_error():
            # NOTE: not llguidance.torch's helper: importing that module runs torch.compile (torch._dynamo).
            words = bitmask[row]
            self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())
            if not self._matcher.is_error():
                return
        bitmask[row] = 0
        for token in self._eos:
            bitmask[row, token // 32] |= _bit(token % 32)

    def accept(self, token_id: int) -> None:
        """The sampled token; a token the mask did not allow (an ignored EOS) leaves the matcher in error."""
        if not self._matcher.is_stopped():
            self._matcher.consume_token(token_id)


def _bit(index: int) -> int:
    """Bit `index` of an int32 word as a Python int that fits int32 (bit 31 is negative)."""
    return -(1 << 31) if index == 31 else 1 << index


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


_BITS = torch.arange(32, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [B, V] float32 with every token whose bit is clear in `bitmask` [B, W] set to -inf (a new tensor)."""
    vocab = logits.shape[1]
    allowed = ((bitmask.unsqueeze(-1) >> _BITS) & 1).view(bitmask.shape[0], -1)[:, :vocab].bool()
    return logits.masked_fill(~allowed, float("-inf"))
