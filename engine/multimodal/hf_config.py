"""config.json (LlavaForConditionalGeneration) + preprocessor_config.json -> MultiModalConfig.

Older checkpoints state only what differs from transformers' class defaults, so those defaults are
filled in here (CLIPVisionConfig, SiglipVisionConfig, CLIPImageProcessor, SiglipImageProcessor).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError, UnsupportedModelError
from engine.multimodal.config import ImageProcessorConfig, MultiModalConfig, VisionTowerConfig

_OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_HALF = (0.5, 0.5, 0.5)
_BICUBIC = 3

# model_type of vision_config -> (kind, transformers' defaults for what the config may omit).
_VISION_DEFAULTS: dict[str, tuple[str, dict[str, Any]]] = {
    "clip_vision_model": ("clip", dict(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, image_size=224,
        patch_size=32, num_channels=3, layer_norm_eps=1e-5, hidden_act="quick_gelu",
    )),
    "siglip_vision_model": ("siglip", dict(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, image_size=224,
        patch_size=16, num_channels=3, layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh",
    )),
}

# image_processor_type -> class defaults (transformers' *ImageProcessorPil class attributes).
_CLIP_PROCESSOR = dict(
    do_convert_rgb=True, do_resize=True, size={"shortest_edge": 224}, resample=_BICUBIC, do_center_crop=True,
    crop_size={"height": 224, "width": 224}, do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
    image_mean=_OPENAI_CLIP_MEAN, image_std=_OPENAI_CLIP_STD, do_pad=False,
)
_PROCESSOR_DEFAULTS: dict[str, dict[str, Any]] = {
    "CLIPImageProcessor": _CLIP_PROCESSOR,
    "LlavaImageProcessor": _CLIP_PROCESSOR,
    "SiglipImageProcessor": dict(
        do_convert_rgb=True, do_resize=True, size={"height": 224, "width": 224}, resample=_BICUBIC,
        do_center_crop=False, crop_size=None, do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
        image_mean=_HALF, image_std=_HALF, do_pad=False,
    ),
}


def is_llava_config(config: dict[str, Any]) -> bool:
    architectures = config.get("architectures") or []
    return (architectures[:1] == ["LlavaForConditionalGeneration"]) or (
        not architectures and config.get("model_type") == "llava"
    )


def read_llava_config(config: dict[str, Any], model_dir: Path) -> MultiModalConfig:
    vision = _vision_config(config.get("vision_config"), model_dir)
    image_token_id = config.get("image_token_id", config.get("image_token_index", 32000))
    if not isinstance(image_token_id, int):
        raise ModelLoadError(f"{model_dir}/config.json: image_token_index must be an int")
    strategy = config.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise UnsupportedModelError(f"vision_feature_select_strategy {strategy!r} is not supported (default, full)")
    layers = config.get("vision_feature_layer", -2)
    layer_list = [layers] if isinstance(layers, int) else layers
    num_states = vision.num_hidden_layers + 1  # the embeddings, then each layer's output
    if not isinstance(layer_list, list) or not layer_list or not all(isinstance(i, int) for i in layer_list):
        raise ModelLoadError(f"{model_dir}/config.json: vision_feature_layer must be an int or a list of ints")
    if not all(-num_states <= i < num_states for i in layer_list):
        raise ModelLoadError(f"{model_dir}/config.json: vision_feature_layer {layers} is outside the tower")
    processor = read_image_processor(model_dir)
    size = processor.output_size()
    if size != (vision.image_size, vision.image_size):
        raise UnsupportedModelError(
            f"{model_dir}/preprocessor_config.json gives images of {size or 'image-dependent size'}; "
            f"the vision tower takes {vision.image_size}x{vision.image_size}"
        )
    return MultiModalConfig(
        image_token_id=image_token_id,
        vision=vision,
        feature_layers=tuple(i % num_states for i in layer_list),
        feature_strategy=strategy,
        projector_hidden_act=str(config.get("projector_hidden_act", "gelu")),
        projector_bias=bool(config.get("multimodal_projector_bias", True)),
        image_processor=processor,
    )


def _vision_config(raw: Any, model_dir: Path) -> VisionTowerConfig:
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{model_dir}/config.json has no vision_config object")
    model_type = raw.get("model_type", "clip_vision_model")
    if model_type not in _VISION_DEFAULTS:
        raise UnsupportedModelError(
            f"vision tower {model_type!r} is not supported (supported: {', '.join(_VISION_DEFAULTS)})"
        )
    kind, defaults = _VISION_DEFAULTS[model_type]
    values = {k: raw.get(k, d) for k, d in defaults.items()}
    if values["hidden_size"] % values["num_attention_heads"]:
        raise ModelLoadError(f"{model_dir}/config.json: vision hidden_size is not a multiple of its heads")
    return VisionTowerConfig(kind=kind, **values)  # type: ignore[arg-type]


def read_image_processor(model_dir: Path) -> ImageProcessorConfig:
    path = model_dir / "preprocessor_config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: missing (a vision-language model needs its image processor config)") from None
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot read ({e})") from e
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: not a JSON object")
    kind = str(raw.get("image_processor_type", "CLIPImageProcessor")).removesuffix("Fast").removesuffix("Pil")
    if kind not in _PROCESSOR_DEFAULTS:
        raise UnsupportedModelError(
            f"image processor {kind!r} is not supported (supported: {', '.join(_PROCESSOR_DEFAULTS)})"
        )
    v = _PROCESSOR_DEFAULTS[kind] | {k: raw[k] for k in _PROCESSOR_DEFAULTS[kind] if raw.get(k) is not None}
    if v["do_pad"]:
        raise UnsupportedModelError(f"{path}: do_pad (pad to square) is not supported")
    size, crop = _size(v["size"], square=False), _size(v["crop_size"], square=True)
    if v["do_resize"] and not (size.get("shortest_edge") or (size.get("height") and size.get("width"))):
        raise UnsupportedModelError(f"{path}: size {v['size']!r} is not supported (shortest_edge or height/width)")
    if size.get("longest_edge"):
        raise UnsupportedModelError(f"{path}: size.longest_edge is not supported")
    return ImageProcessorConfig(
        do_convert_rgb=bool(v["do_convert_rgb"]),
        do_resize=bool(v["do_resize"]),
        shortest_edge=size.get("shortest_edge"),
        resize_height=size.get("height"),
        resize_width=size.get("width"),
        resample=int(v["resample"]),
        do_center_crop=bool(v["do_center_crop"]),
        crop_height=crop.get("height"),
        crop_width=crop.get("width"),
        do_rescale=bool(v["do_rescale"]),
        rescale_factor=float(v["rescale_factor"]),
        do_normalize=bool(v["do_normalize"]),
        image_mean=_triple(v["image_mean"], path),
        image_std=_triple(v["image_std"], path),
    )


def _size(value: Any, *, square: bool) -> dict[str, int]:
    """transformers' get_size_dict: an int means a shortest edge (size) or a square (crop_size)."""
    if value is None:
        return {}
    if isinstance(value, int):
        return {"height": value, "width": value} if square else {"shortest_edge": value}
    if isinstance(value, dict):
        return {k: int(x) for k, x in value.items() if isinstance(x, int)}
    raise UnsupportedModelError(f"image size {value!r} is not supported")


def _triple(value: Any, path: Path) -> tuple[float, float, float]:
    if isinstance(value, (int, float)):
        return (float(value),) * 3
    if isinstance(value, list) and len(value) == 3 and all(isinstance(x, (int, float)) for x in value):
        return (float(value[0]), float(value[1]), float(value[2]))
    raise ModelLoadError(f"{path}: image_mean/image_std must be three numbers")
