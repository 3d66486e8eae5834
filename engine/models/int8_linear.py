"""W8A8 projections: int8 weights times activations quantized per token at run time.

Opt-in (`ModelConfig.quantize_activations = "int8"`, `--quantize-activations int8`). On the zentorch
worker, the four projections of each layer then run on zentorch's dynamic-quantization GEMM
(`zentorch_dynamic_qlinear`: it quantizes each row of the input to int8, symmetric, and multiplies on
VNNI) for calls too large for the small-batch int4 copy: prefill and batched decode. On 2 Zen 5 cores
that took 0.69x the time of bf16 for a 286-token prefill and 0.78x for a step of 16 decodes
(BENCHMARKS.md, "Int8 activations, opt-in").

A float32 model (a CPU without AVX512_BF16, such as a Zen 3) takes `Int8RowsLinear` instead: oneDNN's
int8 GEMM, which runs on AVX2, with each row quantized to 7 bits between its minimum and maximum, for
three of the four projections (the down projection stays float32).

It is not exact, so it is not the default. Quantizing activations per token costs accuracy where a
few input channels carry much larger values than the rest (the usual outlier channels of LLMs): the
row's scale follows the outlier and the other channels keep few levels. SmoothQuant moves part of that
range into the weights: per input channel k, x_k / s_k and W[:, k] * s_k, with
s_k = max|x_k|^0.5 / max|W[:, k]|^0.5, the activation maxima taken from one calibration prefill at
load (`record_activation_ranges`, run by the model loader). On SmolLM2-135M the mean KL divergence of the next-token
distribution from float32 was 0.06-0.11 without smoothing and 0.02-0.03 with it, against 0.002 for
bf16; the tests state the tolerance.

The weights are quantized per output channel from the checkpoint's values (dequantized, in the compute dtype): a
4-bit GGUF tensor is then an int8 approximation of itself, not the exact copy the small-batch kernels
keep (engine/models/packed_linear.py), which still serves calls of up to 4 rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from engine.kernels import load_int8_rows

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
SMOOTHING_ALPHA = 0.5  # SmoothQuant's migration strength: 0.35 and 0.6 gave a higher KL here (0.5 is its default)
# A channel quiet in calibration gets its activation maximum raised to this fraction of the median
# channel's: otherwise its smoothing factor would be tiny, and a request that does use the channel
# would divide by it and swamp the row's scale.
QUIET_CHANNEL_FLOOR = 0.1

# One calibration prefill: a chat of prose, code, numbers and lists, so that each channel's maximum
# reflects the kinds of text a server sees. Outlier channels are a property of the model, so a few
# hundred tokens find them (calibrating on unrelated text changed the KL by < 0.01).
CALIBRATION_CHAT = [
    {"role": "system", "content": "You are a helpful assistant. Answer clearly and briefly."},
    {"role": "user", "content": (
        "I have three questions. First, why is the sky blue? Second, what does this Python function "
        "do, and how could it be faster?\n\n"
        "def total(xs):\n    s = 0\n    for x in xs:\n        if x % 2 == 0:\n            s += x * x\n    return s\n\n"
        "Third, convert 72 degrees Fahrenheit to Celsius, and list the planets of the solar system in order."
    )},
    {"role": "assistant", "content": (
        "1. Sunlight scatters off the molecules of the air, and shorter (blue) wavelengths scatter far "
        "more than longer (red) ones, so blue light reaches your eyes from every direction of the sky.\n"
        "2. It returns the sum of the squares of the even numbers in xs. A generator is shorter and a "
        "little faster: `return sum(x * x for x in xs if x % 2 == 0)`.\n"
        "3. (72 - 32) * 5 / 9 = 22.2 °C. Mercury, Venus, Earth, Mars, Jupiter, Saturn, Uranus, Neptune."
    )},
    {"role": "user", "content": "Thanks! Now write a short, friendly email to my team about Friday's 3:30 PM meeting."},
]


@dataclass(frozen=True)
class ActivationRanges:
    """Per input channel max |x| of each projection in one calibration prefill."""

    absmax: dict[str, torch.Tensor]  # "layers.3.mlp.down_proj" -> [in_features] float32


def projection_paths(model: nn.Module) -> Iterator[tuple[str, nn.Module, str]]:
    """(path, owner, attribute) of each layer's projections: the keys of ActivationRanges.
    `model.model.layers` holds the layers of a Llama-family model and of a LLaVA model alike."""
    for i, layer in enumerate(model.model.layers):
        for owner_name in ("self_attn", "mlp"):
            owner = getattr(layer, owner_name)
            for attr in PROJECTIONS:
                if getattr(owner, attr, None) is not None:
                    yield f"layers.{i}.{owner_name}.{attr}", owner, attr


def record_activation_ranges(model: nn.Module, run: Callable[[], None]) -> ActivationRanges:
    """Calls `run` (one or more forward passes) with each projection's input maxima recorded.

    The model calls its projections through `.forward()` (no hooks run), so the recorder wraps that
    method on the instance and removes it afterwards."""
    absmax: dict[str, torch.Tensor] = {}
    wrapped: list[nn.Module] = []

    def recorder(path: str, module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        forward = module.forward

        def record(x: torch.Tensor, **kwargs) -> torch.Tensor:  # kwargs: SmallBatchLinear's `packed`
            seen = x.detach().abs().amax(dim=0).float()
            absmax[path] = torch.maximum(absmax[path], seen) if path in absmax else seen
            return forward(x, **kwargs)

        return record

    try:
        for path, owner, attr in projection_paths(model):
            module = getattr(owner, attr)
            module.forward = recorder(path, module)
            wrapped.append(module)
        run()
    finally:
        for module in wrapped:
            del module.forward
    return ActivationRanges(absmax)


class Int8DynamicLinear(nn.Module):
    """y = x W^T + b with W smoothed and quantized to int8 per output channel, and x quantized per row
    by zentorch's kernel at each call (bf16 in and out)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, act_absmax: torch.Tensor):
        from engine.worker.zentorch_ops import load_zentorch_ops

        if not load_zentorch_ops():
            raise RuntimeError("int8 activations run on zentorch's int8 GEMM: zentorch is not installed or does not load")
        super().__init__()
        self.out_features, self.in_features = weight.shape
        smooth, q, scale = smoothed_int8_weight(weight, act_absmax)
        with torch.no_grad():
            packed = torch.ops.zentorch.zentorch_weight_prepack_for_dynamic_qlinear(q, False)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer("weight_scales", scale.contiguous(), persistent=False)
        self.register_buffer("inv_smooth", (1.0 / smooth).to(torch.bfloat16), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.bfloat16), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The product is a new contiguous tensor: the kernel reads its input through the raw pointer.
        return torch.ops.zentorch.zentorch_dynamic_qlinear(
            x * self.inv_smooth, self.packed_weight, self.weight_scales, self.bias, is_weight_prepacked=True
        )

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, w8a8"


# A float32 model's projections whose inputs go to 7 bits (Int8RowsLinear). The down projection's input,
# the gated activation, is heavy-tailed: at 7 bits it alone put the mean next-token KL from float32 at
# 0.017-0.044 (SmolLM2-135M, the four parity chats), the other three together at 0.018-0.033; it stays float32.
ROW_QUANTIZED_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj")
ROW_LEVELS = 127  # 7 bits: see Int8RowsLinear


def int8_rows_available() -> bool:
    """Whether torch has oneDNN's int8 GEMM (x86 builds)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")


class Int8RowsLinear(nn.Module):
    """y = x W^T + b for a float32 model on oneDNN's u8 x s8 GEMM, which runs on AVX2 (a Zen 3) as well as
    on VNNI: W smoothed as Int8DynamicLinear's and quantized to int8 per output channel; each row of x
    mapped at each call onto 0..127 between its own minimum and maximum (the minimum's share of the product,
    min_r * sum_k W[n, k], added back after).

    7 bits, not 8: without VNNI oneDNN multiplies with vpmaddubsw, whose int16 sum of two u8 x s8 products
    saturates past 32,767. With 8-bit inputs the outputs were off by 11-13% of their range; with 7 bits they
    equal the quantized operands' product. On 2 Zen 3 cores the GEMM takes 0.45x the time of zentorch's
    float32 one (576 x {960, 576, 3,072}, 286 and 2,048 rows); the row quantization costs back part of it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, act_absmax: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        smooth, q, scale = smoothed_int8_weight(weight, act_absmax)
        with torch.no_grad():
            packed = torch.ops.onednn.qlinear_prepack(q, None)
            sums = (q.float() * scale[:, None]).sum(dim=1)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer("weight_scales", scale.contiguous(), persistent=False)
        self.register_buffer("weight_zero_points", torch.zeros(self.out_features, dtype=torch.long), persistent=False)
        self.register_buffer("weight_sums", sums, persistent=False)
        self.register_buffer("inv_smooth", 1.0 / smooth, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float(), persistent=False)
        # zenserve's one-pass kernels where built (at 2,048 rows the quantization 14x torch's ops, the rescale
        # 2-4x, a copy counted on torch's side), else quantize_rows' arithmetic in torch.
        self.kernels = load_int8_rows()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float().contiguous()
        if self.kernels is None:
            q, low, step = quantize_rows(rows, self.inv_smooth, ROW_LEVELS)
        else:
            q, low, step = self.kernels[0](rows, self.inv_smooth, ROW_LEVELS)
        y = torch.ops.onednn.qlinear_pointwise(
            q, 1.0, 0, self.packed_weight, self.weight_scales, self.weight_zero_points,
            None, 1.0, 0, torch.float32, "none", [], "")
        if self.kernels is None:
            y = y.mul_(step[:, None]).addr_(low, self.weight_sums)
            if self.bias is not None:
                y = y.add_(self.bias)
        else:
            self.kernels[1](y, step, low, self.weight_sums, self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, w8a7 per row"


def quantize_rows(x: torch.Tensor, inv_smooth: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row of x * inv_smooth onto 0..levels between its minimum and maximum: (q uint8, low, step) with
    x * inv_smooth ~ q * step + low per row. The arithmetic of zenserve's kernel (engine/kernels/int8_rows.cpp)."""
    scaled = x * inv_smooth
    low, high = torch.aminmax(scaled, dim=1, keepdim=True)
    spread = high - low
    inv = torch.where(spread > 0, levels / spread, torch.zeros_like(spread))
    q = scaled.sub_(low).mul_(inv).round_().clamp_(0, levels).to(torch.uint8)
    return q, low.view(-1), (spread / levels).view(-1)


def smoothed_int8_weight(weight: torch.Tensor, act_absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(smoothing factors [K], int8 weight [N, K], per-output-channel scales [N]): W * s quantized symmetric
    per row, the scale of an all-zero row 1."""
    if act_absmax.shape != (weight.shape[1],):
        raise ValueError(f"activation ranges of shape {tuple(act_absmax.shape)} for a weight of {tuple(weight.shape)}")
    with torch.no_grad():
        smooth = smoothing_factors(weight, act_absmax)
        w = weight.float() * smooth
        scale = w.abs().amax(dim=1) / 127
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return smooth, q, scale


def smoothing_factors(weight: torch.Tensor, act_absmax: torch.Tensor) -> torch.Tensor:
    """SmoothQuant's s_k = max|x_k|^a / max|W[:, k]|^(1 - a), float32 [in_features]."""
    act = act_absmax.float()
    act = act.clamp(min=max(float(act.median()) * QUIET_CHANNEL_FLOOR, 1e-5))
    w = weight.float().abs().amax(dim=0).clamp(min=1e-5)
    return act.pow(SMOOTHING_ALPHA) / w.pow(1 - SMOOTHING_ALPHA)
