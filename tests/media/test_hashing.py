"""media_hash: the prefix-cache key of a decoded image."""

from __future__ import annotations

import hashlib
from io import BytesIO

import pytest
from PIL import Image

from media import ImageMediaIO, encode_image_url, media_hash
from tests.media.conftest import encode


def test_same_pixels_from_different_encodings_hash_equal(rgb_image):
    from_png = ImageMediaIO().load_bytes(encode(rgb_image, "PNG"))
    from_data_url = ImageMediaIO().load_base64(encode_image_url(rgb_image, format="BMP").split(",", 1)[1])
    assert media_hash(from_png) == media_hash(from_data_url) == media_hash(rgb_image)


def test_one_different_pixel_changes_the_hash(rgb_image):
    changed = rgb_image.copy()
    changed.putpixel((3, 2), (0, 0, 0))
    assert media_hash(changed) != media_hash(rgb_image)


def test_same_bytes_in_another_shape_or_mode_hash_differently():
    row = Image.frombytes("L", (4, 1), bytes([1, 2, 3, 4]))
    column = Image.frombytes("L", (1, 4), bytes([1, 2, 3, 4]))
    palette = Image.frombytes("P", (4, 1), bytes([1, 2, 3, 4]))
    assert len({media_hash(row), media_hash(column), media_hash(palette)}) == 3


def test_same_indices_under_another_palette_hash_differently():
    red = Image.new("P", (2, 2), 0)
    red.putpalette([255, 0, 0] * 256)
    blue = Image.new("P", (2, 2), 0)
    blue.putpalette([0, 0, 255] * 256)
    assert red.tobytes() == blue.tobytes()
    assert media_hash(red) != media_hash(blue)


def test_hash_is_hex_sha256(rgb_image):
    digest = media_hash(rgb_image)
    assert len(digest) == 64 and int(digest, 16) >= 0


def _hash_of_tobytes(image: Image.Image) -> str:
    """The key's definition, written the plain way: the streamed hash must never change a key."""
    digest = hashlib.sha256(b"zenserve-media-hash-v1")
    digest.update(f"|{image.mode}|{image.width}x{image.height}|".encode())
    if image.mode in ("P", "PA"):
        digest.update(bytes(image.getpalette() or []))
    digest.update(f"|transparency={image.info.get('transparency')!r}|".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


@pytest.mark.parametrize(
    "image",
    [
        Image.new("RGB", (1000, 700), (1, 2, 3)),  # ~2 MB packed: several blocks
        Image.new("RGBA", (70_000, 2), (1, 2, 3, 4)),  # one line is over a block: blocks grow to one line
        Image.new("L", (3, 3), 9),
        Image.new("I;16", (300, 300), 513),
        Image.new("P", (640, 480), 5),
        Image.new("RGB", (0, 5)),
    ],
    ids=lambda image: f"{image.mode}-{image.width}x{image.height}",
)
def test_streamed_hash_equals_the_hash_of_tobytes(image):
    assert media_hash(image) == _hash_of_tobytes(image)


def test_hash_of_a_decoded_file_equals_the_hash_of_tobytes(rgb_image):
    assert media_hash(Image.open(BytesIO(encode(rgb_image, "PNG")))) == _hash_of_tobytes(rgb_image)


def test_pixels_are_hashed_in_blocks_never_as_one_bytes_object(monkeypatch):
    """tobytes() builds the whole pixel buffer in one GIL-holding join; fed block by block, every sha256 update
    releases the GIL and the event loop thread gets it in between."""
    updates: list[int] = []
    sha256 = hashlib.sha256

    class Recorder:
        def __init__(self, data: bytes = b"") -> None:
            self._digest = sha256(data)

        def update(self, data: bytes) -> None:
            updates.append(len(data))
            self._digest.update(data)

        def hexdigest(self) -> str:
            return self._digest.hexdigest()

    def no_tobytes(*args, **kwargs):
        raise AssertionError("media_hash built the whole pixel buffer")

    image = Image.new("RGB", (2048, 2048), (7, 8, 9))  # 12 MiB packed
    expected = _hash_of_tobytes(image)
    monkeypatch.setattr(hashlib, "sha256", Recorder)
    monkeypatch.setattr(Image.Image, "tobytes", no_tobytes)
    assert media_hash(image) == expected
    assert sum(updates) > 12 << 20
    assert max(updates) <= 1 << 20
