"""Decode image bytes into PIL images, convert modes, encode images back into base64 and data URLs.

Everything here is synchronous and CPU-bound: the connector calls it on a decode thread, never on the loop.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import functools
import io
import itertools
import os
import time
from collections.abc import Sequence
from io import BytesIO
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from media.errors import MediaDecodeError, MediaOptionError, MediaTooLargeError
from media.limits import MediaLimits
from media.local_file import read_regular_file

RGBColor = tuple[int, int, int]
Buffer = bytes | bytearray | memoryview

# NOTE: Pillow can open ~40 formats; some have long CVE histories (and EPS shells out to Ghostscript).
# Clients send web images, so only these decoders ever see untrusted bytes.
_ACCEPTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF", "AVIF")
# Characters per a2b_base64 call: a multiple of 4, so slices decode independently; ~0.1-0.4 ms of work each.
_BASE64_SLICE = 64 * 1024
# Encoded input up to this size is joined into one bytes object (a copy this short is harmless); larger input is
# read in place through _ChunksReader.
_JOIN_LIMIT = 1 << 20
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


def yield_gil() -> None:
    """Let a thread waiting for the GIL (the event loop's) take it now.

    Pure-Python or GIL-holding C work on a decode thread (base64, copies) never lets go of the GIL on its own;
    CPython takes it away only after sys.getswitchinterval() (5 ms), so the loop thread would stall that long
    each time. time.sleep(0) releases the GIL in a blocking call, long enough for a waiter to get it.
    """
    time.sleep(0)


class _ChunksReader(io.RawIOBase):
    """A seekable, read-only file over a sequence of byte chunks, read in place.

    io.BytesIO copies anything but `bytes`, and joining chunks copies them all: either is one C call that holds
    the GIL for the whole buffer (tens of ms for 20 MB on a loaded machine), stalling the event loop thread as
    much as if it ran there. Wrapped in io.BufferedReader, small reads (header parsing) stay in C.
    """

    def __init__(self, chunks: Sequence[Buffer]) -> None:
        super().__init__()
        self._chunks = [view for view in (memoryview(c).cast("B") for c in chunks) if len(view)]
        self._starts = list(itertools.accumulate((len(v) for v in self._chunks), initial=0))
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._starts[-1]}[whence]
        if base + offset < 0:
            raise ValueError("negative seek position")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: Buffer) -> int:
        out = memoryview(buffer).cast("B")
        written = 0
        while written < len(out) and self._pos < self._starts[-1]:
            index = bisect.bisect_right(self._starts, self._pos) - 1
            chunk, offset = self._chunks[index], self._pos - self._starts[index]
            n = min(len(out) - written, len(chunk) - offset)
            out[written : written + n] = chunk[offset : offset + n]
            written += n
            self._pos += n
        return written


def _encoded_file(chunks: Sequence[Buffer], size: int) -> io.IOBase:
    """A file object over encoded image data for Image.open, copying it only when that is cheap."""
    if len(chunks) == 1 and type(chunks[0]) is bytes:
        return BytesIO(chunks[0])  # shares the bytes object, no copy
    if size <= _JOIN_LIMIT:
        return BytesIO(b"".join(chunks))
    return io.BufferedReader(_ChunksReader(chunks), buffer_size=64 * 1024)


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

    def load_bytes(self, data: Buffer) -> Image.Image:
        """Decode encoded image bytes, refusing oversized, truncated or unsupported input."""
        return self.load_chunks([data])

    def load_chunks(self, chunks: Sequence[Buffer]) -> Image.Image:
        """`load_bytes` for data that arrived in pieces (a download), decoded without joining them first."""
        size = sum(memoryview(chunk).nbytes for chunk in chunks)
        if size > self.limits.max_bytes:
            raise MediaTooLargeError(f"image is {size} bytes, over the limit of {self.limits.max_bytes}")
        try:
            # NOTE: Image.open reads only the header. Pillow's own bomb check (a process-wide threshold we
            # must not change) may already raise here; ours runs next, before a single pixel is decoded.
            image = Image.open(_encoded_file(chunks, size), formats=_open_formats())
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

    def load_base64(self, data: str, start: int = 0) -> Image.Image:
        """Decode a base64 payload, data[start:] (a data URL from after its comma), then the image inside it."""
        # Four base64 characters carry three bytes; refuse before decoding anything.
        if len(data) - start > (self.limits.max_bytes + 2) // 3 * 4 + 4:
            raise MediaTooLargeError(f"base64 image data is over the limit of {self.limits.max_bytes} bytes")
        chunks = []
        try:
            # NOTE: a2b_base64 holds the GIL (3-6 ms per MB on the 2-core dev machine), so one call on a large
            # payload stalls the event loop thread as if it ran there; slices alone do not help either, as the
            # loop would still wait out the 5 ms switch interval. Slices with the GIL offered after each: the
            # loop's GIL waits went from p99 6.6 ms to 0.2 ms. Slices are cut straight from `data` (the payload
            # is never copied whole) and the decoded ones are never joined.
            for offset in range(start, len(data), _BASE64_SLICE):
                piece = data[offset : offset + _BASE64_SLICE]
                if offset + _BASE64_SLICE < len(data) and piece[-1:] in ("=", b"="):
                    raise binascii.Error("padding before the end")  # each slice alone would accept it
                chunks.append(binascii.a2b_base64(piece, strict_mode=True))
                yield_gil()
        except (binascii.Error, ValueError):  # ValueError: non-ASCII characters
            raise MediaDecodeError("image data is not valid base64") from None
        return self.load_chunks(chunks)

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
