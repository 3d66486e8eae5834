"""media_hash: the prefix-cache key of a decoded image."""

from __future__ import annotations

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
