"""Decode image bytes into PIL images, convert modes, encode images back into base64 and data URLs.

Everything here is synchronous and CPU-bound: the connector calls it on a decode thread, never on the loop.
"""

from __future__ import annotations

import base64
import binascii
import functools
import os
from collections.abc import Sequence
from io import BytesIO
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from media.errors import MediaDecodeError, MediaOptionError, MediaTooLargeError
from media.limits import MediaLimits
from media.local_file import read_regular_file

RGBColor = tuple[int, int, int]

# NOTE: Pillow can open ~40 formats; some have long CVE histories (and EPS shells out to Ghostscript).
# Clients send web images, so only these decoders ever see untrusted bytes.
_ACCEPTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF", "AVIF")
_BASE64_SLICE = 1 << 20  # characters per b64decode call; a multiple of 4, so slices decode independently
_ALPHA_MODES = frozenset({"RGBA", "RGBa", "LA", "La", "PA"})


@functools.cache
def _open_formats() -> tuple[str, ...]:
    """The accepted formats this Pillow build can decode (Image.open raises KeyError on unknown names)."""
    Image.init()
    return tuple(name for name in _ACCEPTED_FORMATS if name in Image.OPEN)


def _short_repr(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _validate_image_mode(image_mode: str | None) -> str | None:
    if image_mode is not None and image_mode not in Image.MODES:
        modes = ", ".join(Image.MODES)
        raise MediaOptionError(f"image_mode must be None or one of {modes}; got {_short_repr(image_mode)}")
    return image_mode


def _validate_background(color: object) -> RGBColor:
    def is_channel(value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 255

    if not isinstance(color, (list, tuple)) or len(color) != 3 or not all(is_channel(c) for c in color):
        raise MediaOptionError(
            f"rgba_background_color must be three integers in 0..255 (R, G, B); got {_short_repr(color)}"
        )
    return (color[0], color[1], color[2])


def _has_alpha(image: Image.Image) -> bool:
    """True when some pixel may be (partly) transparent: an alpha band, or a transparency key (tRNS)."""
    return image.mode in _ALPHA_MODES or "transparency" in image.info


class ImageMediaIO:
    """Loads images from bytes, base64 or files and brings them into one mode.

    image_mode: the mode every loaded image is converted to; None keeps the decoded mode (alpha included).
    rgba_background_color: when an image with transparency is converted to a mode without alpha, it is
        composited onto this colour (not just stripped of its alpha, which would expose hidden pixels).
    limits: max_bytes for encoded input, max_pixels for the decoded size.
    """

    def __init__(
        self,
        image_mode: str | None = "RGB",
        rgba_background_color: Sequence[int] = (255, 255, 255),
        *,
        limits: MediaLimits = MediaLimits(),
    ) -> None:
        self.image_mode = _validate_image_mode(image_mode)
        self.rgba_background_color = _validate_background(rgba_background_color)
        self.limits = limits

    # -- loading --------------------------------------------------------------------------------------------

    def load_bytes(self, data: bytes | bytearray) -> Image.Image:
        """Decode encoded image bytes, refusing oversized, truncated or unsupported input."""
        if len(data) > self.limits.max_bytes:
            raise MediaTooLargeError(f"image is {len(data)} bytes, over the limit of {self.limits.max_bytes}")
        try:
            # NOTE: Image.open reads only the header. Pillow's own bomb check (a process-wide threshold we
            # must not change) may already raise here; ours runs next, before a single pixel is decoded.
            image = Image.open(BytesIO(data), formats=_open_formats())
            self._check_pixels(image.size)
            image.load()
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            # (the warning arrives as an exception only when warnings are configured as errors)
            raise MediaTooLargeError(f"image is too large to decode (decompression bomb check: {exc})") from None
        except MediaTooLargeError:
            raise
        except UnidentifiedImageError:
            raise MediaDecodeError(
                f"data is not a readable image in an accepted format ({', '.join(_open_formats())})"
            ) from None
        except Exception as exc:  # NOTE: Pillow's decoders raise OSError, ValueError, SyntaxError, EOFError, ...
            raise MediaDecodeError(f"image data is truncated or corrupt ({type(exc).__name__}: {exc})") from None
        return self.convert(image)

    def load_base64(self, data: str) -> Image.Image:
        """Decode a base64 payload (a data URL's part after the comma) and then the image inside it."""
        # Four base64 characters carry three bytes; refuse before allocating the decoded buffer.
        if len(data) > (self.limits.max_bytes + 2) // 3 * 4 + 4:
            raise MediaTooLargeError(f"base64 image data is over the limit of {self.limits.max_bytes} bytes")
        try:
            # NOTE: in slices, because one b64decode call holds the GIL throughout: a 25 MB payload in one call
            # would freeze the event loop thread for ~0.1 s even though it runs on a decode thread.
            raw = b"".join(
                base64.b64decode(data[start : start + _BASE64_SLICE], validate=True)
                for start in range(0, len(data), _BASE64_SLICE)
            )
        except (binascii.Error, ValueError):
            raise MediaDecodeError("image data is not valid base64") from None
        return self.load_bytes(raw)

    def load_file(self, path: str | os.PathLike[str]) -> Image.Image:
        """Read and decode a regular file. The caller decides whether the path may be read at all."""
        return self.load_bytes(read_regular_file(Path(path), self.limits.max_bytes))

    # -- conversion and encoding ----------------------------------------------------------------------------

    def convert(self, image: Image.Image) -> Image.Image:
        """Bring `image` into image_mode; transparent pixels are composited onto the background colour."""
        target = self.image_mode
        if target is None or image.mode == target:
            return image
        try:
            if _has_alpha(image) and target not in _ALPHA_MODES:
                rgba = image.convert("RGBA")
                background = Image.new("RGB", rgba.size, self.rgba_background_color)
                background.paste(rgba, mask=rgba.getchannel("A"))
                return background if target == "RGB" else background.convert(target)
            return image.convert(target)
        except ValueError as exc:
            raise MediaDecodeError(f"cannot convert image from mode {image.mode} to {target}: {exc}") from None

    def encode_base64(self, image: Image.Image, *, format: str = "PNG") -> str:
        """Convert (per image_mode) and encode as base64 text in the given Pillow format."""
        converted = self.convert(image)
        buffer = BytesIO()
        try:
            converted.save(buffer, format=format)
        except (KeyError, OSError, ValueError) as exc:
            raise MediaOptionError(f"cannot encode a mode {converted.mode} image as {format}: {exc}") from None
        return base64.b64encode(buffer.getvalue()).decode("ascii")

    def _check_pixels(self, size: tuple[int, int]) -> None:
        width, height = size
        if width * height > self.limits.max_pixels:
            raise MediaTooLargeError(
                f"image is {width}x{height} = {width * height} pixels, over the limit of {self.limits.max_pixels}"
            )


def encode_image_base64(image: Image.Image, *, image_mode: str | None = "RGB", format: str = "PNG") -> str:
    """Encode a PIL image as base64. Converted to RGB first by default; image_mode=None keeps its mode."""
    return ImageMediaIO(image_mode=image_mode).encode_base64(image, format=format)


def encode_image_url(image: Image.Image, *, image_mode: str | None = "RGB", format: str = "PNG") -> str:
    """Encode a PIL image as a `data:` URL. Converted to RGB first by default; image_mode=None keeps its mode."""
    payload = encode_image_base64(image, image_mode=image_mode, format=format)
    Image.init()
    media_type = Image.MIME.get(format.upper(), f"image/{format.lower()}")
    return f"data:{media_type};base64,{payload}"
