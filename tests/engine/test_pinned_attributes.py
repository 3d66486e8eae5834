"""pin_attributes: registered children, parameters and buffers found as plain attributes, and kept
correct when submodules or parameters are swapped afterwards."""

from __future__ import annotations

import torch
from torch import nn

from engine.kv_cache_spec import make_kv_cache_layout
from engine.models.pinned_attributes import pin_attributes, unpin_attributes
from engine.worker.cpu import CPUWorker


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4, bias=False)
        self.register_buffer("offset", torch.ones(4))

    def forward(self, x):
        return self.proj.forward(x) + self.offset


def test_pinned_attributes_are_the_registered_objects():
    block = Block()
    assert pin_attributes(block) == 3  # proj, proj.weight, offset
    assert vars(block)["proj"] is block._modules["proj"]
    assert vars(block)["offset"] is block._buffers["offset"]
    assert vars(block.proj)["weight"] is block.proj._parameters["weight"]
    with torch.no_grad():  # in-place updates show through the copy: it is the same tensor
        block.proj.weight.zero_()
    assert torch.equal(block(torch.randn(2, 4)), torch.ones(2, 4))


def test_swapping_a_pinned_submodule_or_parameter_takes_effect():
    block = Block()
    pin_attributes(block)
    doubler = nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        doubler.weight.copy_(2 * torch.eye(4))
    block.proj = doubler
    x = torch.randn(3, 4)
    assert block.proj is doubler and torch.allclose(block(x), 2 * x + 1)
    block.proj.weight = nn.Parameter(3 * torch.eye(4))
    assert torch.allclose(block(x), 3 * x + 1)
    assert block.proj.weight is block.proj._parameters["weight"]


def test_unpin_removes_the_copies():
    block = Block()
    pin_attributes(block)
    unpin_attributes(block)
    assert "proj" not in vars(block) and "offset" not in vars(block)
    assert block.proj is block._modules["proj"]  # through Module.__getattr__ again


def test_the_cpu_worker_pins_its_model(smollm_fp32):
    layout = make_kv_cache_layout(smollm_fp32.arch, 16, smollm_fp32.dtype, 4 * 1024 * 1024)
    CPUWorker(smollm_fp32.model, layout, smollm_fp32.dtype)
    layer = smollm_fp32.model.model.layers[0]
    assert vars(layer)["self_attn"] is layer._modules["self_attn"]
    assert vars(layer.self_attn)["qkv_proj"] is layer.self_attn._modules["qkv_proj"]
