"""Small frozen configs, one per concern, built once and passed to constructors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

from engine.cpu_features import has_native_bf16
from engine.errors import InvalidRequestError
from engine.kv_quant import KV_CACHE_DTYPES
from engine.multimodal.config import MultiModalConfig

if TYPE_CHECKING:
    from kvtier.config import OffloadingConfig

DType = Literal["auto", "float32", "bfloat16"]
WorkerKind = Literal["auto", "eager", "zentorch", "cuda"]


@dataclass(frozen=True)
class RopeScaling:
    """rope_scaling as Hugging Face configs state it; rope_type 'default' means none."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int | None = None


@dataclass(frozen=True)
class ModelArchConfig:
    """The architecture facts a decoder-only model needs; read from GGUF metadata or config.json.

    Weights are named as in Hugging Face checkpoints (`model.layers.{i}.self_attn.q_proj.weight`,
    `model.embed_tokens.weight`, `model.norm.weight`, `lm_head.weight`); every loader maps to them.
    """

    architecture: str  # "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    # "LlavaForConditionalGeneration" (the other fields then describe its text model)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm on each head of q and k (Qwen3)
    sliding_window: int | None = None  # Mistral-style window; None: full attention
    multimodal: MultiModalConfig | None = None  # vision-language models (LLaVA): the image path; None: text only


@dataclass(frozen=True)
class ModelConfig:
    """Which model to load and in what precision."""

    model: str | None = None  # path to a .gguf file or an HF directory; None: the embedded SmolLM2
    dtype: DType = "auto"
    max_model_len: int | None = None  # None: the model's own context length
    served_model_name: str | None = None
    # "auto": weights the checkpoint stores in 4/8 bits (GGUF Q4_0, Q4_1, Q8_0) also keep a packed
    # copy that bf16 batches of a few rows run on (engine/models/packed_linear.py); "off": dense only.
    small_batch_kernels: Literal["auto", "off"] = "auto"
    # "int8": prefill and batched decode run the projections as int8 x int8 GEMMs, activations quantized
    # per token (SmoothQuant-calibrated at load; zentorch worker, bf16 only; engine/models/int8_linear.py).
    # Faster, not exact: "off" keeps bf16.
    quantize_activations: Literal["off", "int8"] = "off"
    # The 4/8-bit weights keep no dense copy: the projections' larger calls write their weight out from the
    # 4-bit groups per call, the Q8_0 lm_head runs every call on its groups, a tied embedding is looked up
    # from them, and loading gives those weights no dense storage (engine/models/packed_linear.py). A float32
    # model on zenserve's group kernels (e.g. a Zen 3): 620 MB less for SmolLM2-135M, prefill 1.1-1.2x slower
    # (torch's GEMM, not zentorch's prepacked one). A bf16 model on AMX (engine/models/onednn_linear.py): 310
    # MB less, oneDNN's GEMM on the weight written out into its layout. Elsewhere no effect (a warning).
    compact_weights: bool = False

    def __post_init__(self) -> None:
        if self.max_model_len is not None and self.max_model_len < 1:
            raise InvalidRequestError(f"max_model_len must be at least 1, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_bytes: int = 512 * 1024 * 1024
    enable_prefix_caching: bool = True
    hash_algo: Literal["sha256", "sha256_cbor"] = "sha256"
    # "model": the model's dtype. "float16": a float32 model's rows stored in float16, half the bytes
    # (llama.cpp's default cache type; next-token KL from float32 ~1e-6); CPU workers only. "auto":
    # float16 for a float32 model on the CPU workers, else the model's dtype. "int8": rows of int8
    # values with a float32 scale each (engine/kv_quant.py): about twice the tokens in the same memory,
    # and faster decode attention, at a small cost in accuracy; CPU workers only. "fp8" (alias "fp8_e4m3"):
    # a bf16 model's rows as float8 e4m3fn, twice the tokens of bf16, not exact; CPU workers with AVX-512.
    kv_cache_dtype: Literal["auto", "model", "float16", "int8", "fp8", "fp8_e4m3"] = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequestError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise InvalidRequestError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_memory_bytes <= 0:
            raise InvalidRequestError("kv_cache_memory_bytes must be positive")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_waiting: int = 1024  # admission bound: add_request beyond it raises
    # Prefill tokens per step while some request decodes (0: no cap beyond the step budget).
    # A step lasts as long as its prefill, and every decode in it waits for that. Steps with no
    # decode still take the whole budget (a lone prompt is not chunked). 1,024 against 512 on 2
    # Xeon cores, served W2 / W2x32 in five alternated rounds (BENCHMARKS.md): 1.07x / 1.05x the
    # throughput, TTFT p90 0.86x / 0.89x and ITL p90 far lower (fewer mixed steps), TTFT p50 1.38x.
    max_prefill_tokens_while_decoding: int = 1024

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise InvalidRequestError("max_num_seqs must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise InvalidRequestError("max_num_batched_tokens must be at least 1")
        if self.max_prefill_tokens_while_decoding < 0:
            raise InvalidRequestError("max_prefill_tokens_while_decoding must be 0 (no cap) or positive")
        if self.max_waiting < 0:  # 0: every new request is refused (a drained server)
            raise InvalidRequestError("max_waiting must be 0 or more")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    worker: WorkerKind = "auto"
    num_threads: int | None = None  # torch intra-op threads; None: torch's default
    # The cuda worker replays decode-only steps from CUDA graphs (engine/worker/decode_graphs.py); False:
    # every step runs eagerly (vLLM's --enforce-eager).
    cuda_graphs: bool = True
    enable_kv_events: bool = False  # record block stored/removed events (the KV-event stream)
    # Greedy output independent of what else is in the batch (vLLM's VLLM_BATCH_INVARIANT): every row runs the
    # paths a prompt takes, decodes included (the dense weights, prefill attention), and the blocks of generated
    # tokens join the prefix cache. CPU workers only; slower decodes (BENCHMARKS.md).
    batch_invariant: bool = False
    offload: OffloadingConfig | None = None  # KV offloading tiers; None: off


def resolve_dtype(dtype: DType, device: str = "cpu") -> torch.dtype:
    """`auto`: bfloat16 where the hardware computes it natively, float32 otherwise."""
    if dtype == "float32":
        return torch.float32
    if dtype == "bfloat16":
        return torch.bfloat16
    if device.startswith("cuda"):
        return torch.bfloat16
    return torch.bfloat16 if has_native_bf16() else torch.float32
