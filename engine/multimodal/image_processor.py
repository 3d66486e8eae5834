"""PIL image -> pixel values, step for step as transformers' PIL image processors do it
(convert to RGB, resize, center crop, rescale, normalize), so the pixels match exactly.

NumPy and PIL only: it runs on a plain thread pool, off the event loop and off the one thread that runs
torch ops (a torch op here would start a second OpenMP team beside the worker's).
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from engine.errors import InvalidRequestError
from engine.multimodal.config import ImageProcessorConfig


def preprocess_image(image: Image.Image, cfg: ImageProcessorConfig) -> np.ndarray:
    """[3, H, W] float32 pixel values. InvalidRequestError when the image cannot be brought to RGB."""
    try:
        image = _to_rgb(image) if cfg.do_convert_rgb or image.mode != "RGB" else image
    except (ValueError, OSError) as e:
        raise InvalidRequestError(f"cannot convert the image from mode {image.mode} to RGB: {e}") from None
    if cfg.do_resize:
        height, width = _resized_size(image.height, image.width, cfg)
        image = image.resize((width, height), resample=Image.Resampling(cfg.resample))
    pixels = np.asarray(image)  # [H, W, 3] uint8
    if cfg.do_center_crop and cfg.crop_height and cfg.crop_width:
        pixels = _center_crop(pixels, cfg.crop_height, cfg.crop_width)
    values: np.ndarray
    if cfg.do_rescale:
        # transformers rescales in float64 and then casts, which rounds differently than float32 math.
        values = (pixels.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    else:
        values = pixels.astype(np.float32)
    if cfg.do_normalize:
        mean = np.array(cfg.image_mean, dtype=np.float32)
        std = np.array(cfg.image_std, dtype=np.float32)
        values = (values - mean) / std
    return np.ascontiguousarray(values.transpose(2, 0, 1))


def _to_rgb(image: Image.Image) -> Image.Image:
    """transformers' convert_to_rgb: transparency is composited onto white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _resized_size(height: int, width: int, cfg: ImageProcessorConfig) -> tuple[int, int]:
    if cfg.shortest_edge:
        # torchvision's rule, as transformers' get_resize_output_image_size: the long side truncates.
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = cfg.shortest_edge, int(cfg.shortest_edge * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)
    assert cfg.resize_height and cfg.resize_width
    return cfg.resize_height, cfg.resize_width


def _center_crop(pixels: np.ndarray, crop_h: int, crop_w: int) -> np.ndarray:
    """Crop [H, W, C] to crop_h x crop_w around the centre, zero-padding an image smaller than that."""
    height, width = pixels.shape[:2]
    top, left = (height - crop_h) // 2, (width - crop_w) // 2
    if top >= 0 and left >= 0:
        return pixels[top : top + crop_h, left : left + crop_w]
    new_h, new_w = max(crop_h, height), max(crop_w, width)
    padded = np.zeros((new_h, new_w, pixels.shape[2]), dtype=pixels.dtype)
    pad_top, pad_left = -(-(new_h - height) // 2), -(-(new_w - width) // 2)
    padded[pad_top : pad_top + height, pad_left : pad_left + width] = pixels
    top, left = top + pad_top, left + pad_left
    return padded[max(0, top) : min(new_h, top + crop_h), max(0, left) : min(new_w, left + crop_w)]
