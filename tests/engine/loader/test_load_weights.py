"""load_weights (copy into a module, one error listing every mismatch) and load_model_files."""

import pytest
import torch
from torch import nn

from engine.errors import ModelLoadError, WeightsMismatchError
from engine.loader.load import load_model_files, load_weights, materialize


class _TinyLM(nn.Module):
    """HF-named toy model: model.embed_tokens, model.norm, lm_head (tied or not)."""

    def __init__(self, tie: bool):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(8, 4)
        self.model.norm = nn.LayerNorm(4, bias=False)
        self.lm_head = nn.Linear(4, 8, bias=False)
        if tie:
            self.lm_head.weight = self.model.embed_tokens.weight


def _checkpoint(dtype=torch.float32) -> dict[str, torch.Tensor]:
    return {
        "model.embed_tokens.weight": torch.arange(32.0).reshape(8, 4).to(dtype),
        "model.norm.weight": torch.full((4,), 2.0, dtype=dtype),
        "lm_head.weight": -torch.arange(32.0).reshape(8, 4).to(dtype),
    }


def test_copies_values_and_converts_dtype():
    module = _TinyLM(tie=False)
    load_weights(module, _checkpoint(torch.bfloat16).items())
    assert module.model.norm.weight.dtype == torch.float32  # the parameter keeps its dtype
    assert torch.equal(module.model.norm.weight, torch.full((4,), 2.0))
    assert torch.equal(module.lm_head.weight, -torch.arange(32.0).reshape(8, 4))


@pytest.mark.parametrize("tie", [True, False])
def test_a_meta_model_materializes_in_the_compute_dtype_with_its_ties_kept(tie):
    with torch.device("meta"):
        module = _TinyLM(tie=tie)
    materialize(module, torch.bfloat16)
    assert all(p.device.type == "cpu" and p.dtype == torch.bfloat16 for p in module.parameters())
    assert (module.lm_head.weight is module.model.embed_tokens.weight) == tie
    checkpoint = _checkpoint()
    if tie:
        del checkpoint["lm_head.weight"]  # a tied checkpoint stores the embedding once
    load_weights(module, checkpoint.items())
    expected_head = torch.arange(32.0) if tie else -torch.arange(32.0)
    assert torch.equal(module.lm_head.weight.float(), expected_head.reshape(8, 4))


def test_weights_kept_packed_only_stay_on_meta_with_their_ties():
    with torch.device("meta"):
        module = _TinyLM(tie=True)
    materialize(module, torch.float32, keep_on_meta={"lm_head.weight"})
    assert module.lm_head.weight.is_meta and module.lm_head.weight is module.model.embed_tokens.weight
    assert module.model.norm.weight.device.type == "cpu"
    checkpoint = _checkpoint()
    del checkpoint["lm_head.weight"]
    load_weights(module, checkpoint.items())  # loading into a held weight does nothing, and is no error
    assert module.lm_head.weight.is_meta
    assert torch.equal(module.model.norm.weight, torch.full((4,), 2.0))


def test_tied_model_needs_no_lm_head():
    module = _TinyLM(tie=True)
    weights = _checkpoint()
    del weights["lm_head.weight"]
    load_weights(module, weights.items())
    assert torch.equal(module.lm_head.weight, torch.arange(32.0).reshape(8, 4))


def test_untied_model_missing_lm_head_is_an_error():
    weights = _checkpoint()
    del weights["lm_head.weight"]
    with pytest.raises(WeightsMismatchError, match=r"1 missing: lm_head\.weight"):
        load_weights(_TinyLM(tie=False), weights.items())


def test_all_problems_are_reported_in_one_error():
    weights = _checkpoint()
    del weights["model.norm.weight"]
    weights["model.layers.0.extra.weight"] = torch.zeros(3)
    weights["lm_head.weight"] = torch.zeros(8, 5)
    with pytest.raises(WeightsMismatchError) as excinfo:
        load_weights(_TinyLM(tie=False), weights.items())
    message = str(excinfo.value)
    assert "1 missing: model.norm.weight" in message
    assert "1 unexpected: model.layers.0.extra.weight" in message
    assert "1 mis-shaped: lm_head.weight: expected [8, 4], got [8, 5]" in message
    assert "missing: lm_head" not in message  # mis-shaped is not also counted missing


def test_end_to_end_hf_directory_into_transformers_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, vocab_size=64, tie_word_embeddings=True)
    torch.manual_seed(0)
    source = transformers.LlamaForCausalLM(config)
    source.save_pretrained(tmp_path, safe_serialization=True)
    torch.manual_seed(1)
    target = transformers.LlamaForCausalLM(config)

    files = load_model_files(tmp_path)
    assert files.kind == "hf" and files.arch.tie_word_embeddings
    load_weights(target, files.iter_weights(torch.float32))
    for name, tensor in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], tensor), name


def test_load_model_files_rejects_missing_path_and_non_model_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="nowhere"):
        load_model_files(tmp_path / "nowhere")
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model_files(tmp_path)
