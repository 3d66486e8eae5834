"""Content hashes of decoded media, for prefix-cache keys: same pixels, same key; any other pixel, another."""

from __future__ import annotations

import hashlib

from PIL import Image

_HASH_VERSION = b"zenserve-media-hash-v1"


def media_hash(image: Image.Image) -> str:
    """sha256 (hex) over an image's mode, size and pixel bytes, so the same picture fetched from two URLs or
    in two encodings shares a key. CPU-bound on large images: call it on a thread, not the event loop."""
    digest = hashlib.sha256(_HASH_VERSION)
    width, height = image.size
    digest.update(f"|{image.mode}|{width}x{height}|".encode())
    if image.mode in ("P", "PA"):
        # NOTE: palette images store indices; the same indices under another palette are another picture.
        palette = image.getpalette() or []
        digest.update(bytes(palette))
    # A transparency key (tRNS) makes some pixels transparent once the image is converted to RGBA.
    digest.update(f"|transparency={image.info.get('transparency')!r}|".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()
