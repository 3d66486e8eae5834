"""Load a model (weights, architecture, tokenizer) from a GGUF file or an HF directory."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine.config import ModelArchConfig, ModelConfig, resolve_dtype
from engine.cpu_features import has_avx512_vnni
from engine.embedded_model import embedded_model_path
from engine.errors import ModelLoadError
from engine.heap import release_free_heap
from engine.loader.load import ModelFiles, load_model_files, load_weights, materialize
from engine.models import create_model
from engine.models.int8_linear import (
    CALIBRATION_CHAT,
    ActivationRanges,
    int8_rows_available,
    record_activation_ranges,
)
from engine.models.onednn_linear import onednn_serves_bf16
from engine.models.packed_linear import (
    PACKABLE_GGML_TYPES,
    PackableWeight,
    float32_small_batch_kernels,
    recover_packable,
)
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    arch: ModelArchConfig
    model: nn.Module
    tokenizer: Tokenizer
    dtype: torch.dtype
    source: Path
    name: str  # what /v1/models calls it
    max_model_len: int
    # Per-channel activation maxima for int8 activations (ModelConfig.quantize_activations); None: off.
    activation_ranges: ActivationRanges | None = None


def _capture_packable(
    weights: Iterator[tuple[str, torch.Tensor]], weight_types: dict[str, str], into: dict[str, PackableWeight]
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        packed = recover_packable(tensor, weight_types.get(name, ""))
        if packed is not None:
            into[name] = packed
        yield name, tensor


def load_model(config: ModelConfig, device: str = "cpu") -> LoadedModel:
    """`device`: where the model will run ("cpu", or "cuda" for the cuda worker, which moves it there).
    On a GPU `auto` means bfloat16 and no packed 4/8-bit copies are made: their kernels are CPU ones."""
    started = time.perf_counter()
    on_cpu = device == "cpu"
    if not on_cpu and config.quantize_activations != "off":
        raise ModelLoadError("int8 activations run on the zentorch worker (a CPU): a GPU has none")
    if config.model is None:
        path = embedded_model_path()
        log.info("no model named: serving the embedded SmolLM2-135M-Instruct from %s", path)
    else:
        path = Path(config.model).expanduser()
        if not path.exists():
            raise ModelLoadError(f"model path {path} does not exist")
    files = load_model_files(path)
    tokenizer = Tokenizer.from_gguf(files.gguf_reader) if files.gguf_reader is not None else Tokenizer.from_hf_dir(path)
    arch, file_kind = files.arch, files.kind
    dtype = resolve_dtype(config.dtype, device)
    max_model_len = arch.max_position_embeddings
    if config.max_model_len is not None:
        if config.max_model_len > max_model_len:  # positions past its training are not this model's
            raise ModelLoadError(
                f"max_model_len {config.max_model_len} is longer than the model's context of {max_model_len} tokens"
            )
        max_model_len = config.max_model_len
    packs = bool(on_cpu and config.small_batch_kernels == "auto" and files.weight_types and (
        dtype == torch.bfloat16 or (dtype == torch.float32 and float32_small_batch_kernels())))
    # A bf16 model's compact weights need oneDNN's AMX GEMM (the weight written out into its layout per call).
    compact = packs and config.compact_weights and (dtype == torch.float32 or (
        dtype == torch.bfloat16 and onednn_serves_bf16()))
    if config.compact_weights and not compact:
        log.warning("compact weights need packed 4/8-bit weights on zenserve's CPU kernels (a float32 model, or a "
                    "bf16 one on AMX); not here (%s on %s): dense copies kept", str(dtype).removeprefix("torch."), device)
    if config.quantize_activations == "int8":  # refused before the load, not after
        if dtype == torch.bfloat16 and not has_avx512_vnni():
            # zentorch's int8 GEMM would stop the process with an illegal instruction at the first call.
            raise ModelLoadError("int8 activations of a bfloat16 model run on zentorch's int8 GEMM, which needs a CPU "
                                 "with AVX512-VNNI; this one has none (--dtype float32 runs them on oneDNN's)")
        if dtype == torch.float32 and not int8_rows_available():
            raise ModelLoadError("int8 activations of a float32 model run on oneDNN's int8 GEMM, which this torch lacks")
        if dtype not in (torch.bfloat16, torch.float32):
            raise ModelLoadError(f"int8 activations need bfloat16 or float32 compute, not {str(dtype).removeprefix('torch.')}")
        if compact:
            raise ModelLoadError("int8 activations quantize the dense weights, which --compact-weights does not keep")
    model = _build_model(files, arch, max_model_len, dtype, packs, compact, hold_packed_on_meta=compact)
    if compact and any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        # A 4/8-bit weight that found no packed place (fused with another kind, an architecture without
        # compact weights): its dense values are needed after all.
        log.warning("compact weights: some 4/8-bit weights run dense here; loading again with their dense copies")
        model = _build_model(files, arch, max_model_len, dtype, packs, compact, hold_packed_on_meta=False)
    model.eval()
    activation_ranges = None
    if config.quantize_activations == "int8":
        activation_ranges = _calibrate(model, tokenizer, arch, dtype)
    # The GGUF reader's parsed metadata (158 MB for SmolLM2's), the 4-bit values recovered for
    # packing and the packing's temporaries. (Dropping the reader before fusing left 170 MB more
    # resident after the trim: what fusing allocated then lay among the freed pages.)
    del files
    release_free_heap()
    name = config.served_model_name or (path.stem if file_kind == "gguf" else path.name)
    log.info(
        "loaded %s (%s, %s, %d layers) in %.1f s",
        path.name, arch.architecture, str(dtype).removeprefix("torch."), arch.num_hidden_layers,
        time.perf_counter() - started,
    )
    return LoadedModel(arch, model, tokenizer, dtype, path, name, max_model_len, activation_ranges)


def _build_model(files: ModelFiles, arch: ModelArchConfig, max_model_len: int, dtype: torch.dtype, packs: bool,
                 compact: bool, hold_packed_on_meta: bool) -> nn.Module:
    """The model with its weights loaded, projections fused, packed copies installed (`packs`) and, with
    `compact`, the dense float32 copies of packed weights dropped. `hold_packed_on_meta`: the weights
    stored in 4 or 8 bits get no dense storage at all (compact weights' load then never holds the whole
    dense model: 1.40 -> 0.93 GB peak for SmolLM2-135M); where one turns out to need it, a meta tensor
    is left in the model."""
    # Built on the meta device, then given storage in the compute dtype: no float32 copy with random
    # initial values is made first (about 520 MB more at SmolLM2-135M's load, and the time to fill it).
    with torch.device("meta"):
        model = create_model(arch, max_model_len)
    held = {name for name, kind in files.weight_types.items() if kind in PACKABLE_GGML_TYPES} if hold_packed_on_meta else set()
    materialize(model, dtype, keep_on_meta=held)
    model.reset_rope()  # rotary tables stay float32 whatever the compute dtype
    packable: dict[str, PackableWeight] = {}
    if packs:
        # Read float32 (the exact dequantized values) so 4-bit tensors can be recovered bit-exactly.
        load_weights(model, _capture_packable(files.iter_weights(torch.float32), files.weight_types, packable))
    else:
        load_weights(model, files.iter_weights(dtype))
    release_free_heap()  # each tensor's float32 dequantization, before the copies below raise the peak
    model.fuse_projections()
    if packable:
        count = model.install_small_batch_kernels(packable)
        log.info("small-batch int4/int8 kernels on %d layers", count)
        if compact and hasattr(model, "compact_weights"):
            dropped = model.compact_weights()
            log.info("compact weights: %d float32 weights kept packed only", dropped)
    return model


def _calibrate(model: nn.Module, tokenizer: Tokenizer, arch: ModelArchConfig, dtype: torch.dtype) -> ActivationRanges:
    """Each projection's input maxima over one prefill of the calibration chat, through the eager path."""
    from engine.attention import build_attention_metadata

    try:
        text = tokenizer.apply_chat_template(CALIBRATION_CHAT, add_generation_prompt=False)
    except Exception:  # noqa: BLE001 - no usable chat template: the messages as plain text
        text = "\n\n".join(m["content"] for m in CALIBRATION_CHAT)
    ids = tokenizer.encode(text, add_special_tokens=False)
    block_size = 16
    num_blocks = -(-len(ids) // block_size)
    shape = (num_blocks * block_size, arch.num_key_value_heads, arch.head_dim)
    kv_caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(arch.num_hidden_layers)]
    meta, positions = build_attention_metadata(
        [], [(list(range(num_blocks)), 0, len(ids))], block_size, arch.sliding_window, torch.device("cpu")
    )

    def prefill() -> None:
        with torch.inference_mode():
            model(torch.tensor(ids), positions, kv_caches, meta)

    started = time.perf_counter()
    ranges = record_activation_ranges(model, prefill)
    log.info("int8 activations: calibrated on %d tokens in %.2f s", len(ids), time.perf_counter() - started)
    return ranges
