"""ImageMediaIO: decoding, mode conversion with background compositing, limits, encoding."""

from __future__ import annotations

import base64
import io
import random

import numpy as np
import pytest
from PIL import Image

import media.image
from media import (
    ImageMediaIO,
    MediaDecodeError,
    MediaLimits,
    MediaOptionError,
    MediaTooLargeError,
    encode_image_base64,
    encode_image_url,
)
from tests.media.conftest import encode, png_header_only, rgba_with_one_opaque_pixel


# -- ported from the seed: image_mode=None keeps the original mode ------------------------------------------


def test_image_media_io_no_mode_conversion(tmp_path):
    path = tmp_path / "rgba.png"
    rgba_with_one_opaque_pixel((10, 10), (5, 5)).save(path)

    converted = ImageMediaIO().load_file(path)
    assert converted.mode == "RGB"
    assert converted.getpixel((0, 0)) == (255, 255, 255)  # transparent → white background
    assert converted.getpixel((5, 5)) == (0, 0, 0)

    kept = ImageMediaIO(image_mode=None).load_file(path)
    assert kept.mode == "RGBA"
    assert kept.getpixel((0, 0)) == (0, 0, 0, 0)  # alpha kept, hidden colour untouched
    assert kept.getpixel((5, 5)) == (0, 0, 0, 255)


# -- background compositing --------------------------------------------------------------------------------


def test_rgba_composites_onto_custom_background(tmp_path):
    path = tmp_path / "rgba.png"
    rgba_with_one_opaque_pixel((10, 10), (5, 5)).save(path)

    green = ImageMediaIO(rgba_background_color=(0, 255, 0)).load_file(path)
    assert green.mode == "RGB"
    assert green.getpixel((0, 0)) == (0, 255, 0)
    assert green.getpixel((5, 5)) == (0, 0, 0)


def test_half_transparent_pixel_blends_with_background():
    image = Image.new("RGBA", (1, 1), (200, 100, 0, 128))
    loaded = ImageMediaIO(rgba_background_color=[0, 0, 255]).load_bytes(encode(image))
    red, green, blue = loaded.getpixel((0, 0))
    assert (abs(red - 100), abs(green - 50), abs(blue - 127)) <= (1, 1, 1)


def test_palette_transparency_composites_onto_background():
    image = Image.new("P", (2, 1))
    image.putpalette([255, 0, 0, 0, 0, 255] + [0] * 762)
    image.putpixel((0, 0), 0)
    image.putpixel((1, 0), 1)
    image.info["transparency"] = 0  # palette index 0 (red) is transparent
    loaded = ImageMediaIO(rgba_background_color=(10, 20, 30)).load_bytes(encode(image))
    assert loaded.mode == "RGB"
    assert loaded.getpixel((0, 0)) == (10, 20, 30)
    assert loaded.getpixel((1, 0)) == (0, 0, 255)


def test_grey_with_alpha_composites_before_converting_to_target_mode():
    image = Image.new("LA", (1, 1), (0, 0))  # black, fully transparent
    loaded = ImageMediaIO(image_mode="L", rgba_background_color=(255, 255, 255)).load_bytes(encode(image))
    assert loaded.mode == "L"
    assert loaded.getpixel((0, 0)) == 255


def test_mode_without_alpha_is_plainly_converted(rgb_image):
    loaded = ImageMediaIO(image_mode="L").load_bytes(encode(rgb_image))
    assert loaded.mode == "L"
    assert loaded.tobytes() == rgb_image.convert("L").tobytes()


def test_image_already_in_target_mode_is_returned_unchanged(rgb_image):
    loaded = ImageMediaIO().load_bytes(encode(rgb_image))
    assert loaded.mode == "RGB"
    assert loaded.tobytes() == rgb_image.tobytes()


@pytest.mark.parametrize(
    "color",
    [
        (255, 255),  # too few
        (0, 0, 0, 0),  # too many
        (256, 0, 0),  # out of range
        (-1, 0, 0),
        (0.5, 0, 0),  # not an int
        ("255", 0, 0),
        (True, 0, 0),  # a bool is not a channel value
        "white",
        None,
        255,
    ],
    ids=repr,
)
def test_invalid_background_colour_is_refused(color):
    with pytest.raises(MediaOptionError, match="rgba_background_color must be three integers in 0..255"):
        ImageMediaIO(rgba_background_color=color)


def test_valid_background_colour_list_is_accepted():
    assert ImageMediaIO(rgba_background_color=[0, 128, 255]).rgba_background_color == (0, 128, 255)


def test_unknown_image_mode_is_refused():
    with pytest.raises(MediaOptionError, match="image_mode must be None or one of"):
        ImageMediaIO(image_mode="RGBZ")


# -- bad input ----------------------------------------------------------------------------------------------


def test_truncated_png_is_a_decode_error():
    pixels = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    data = encode(Image.fromarray(pixels, "RGB"))  # noise: the pixel data is most of the file
    with pytest.raises(MediaDecodeError, match="truncated or corrupt"):
        ImageMediaIO().load_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("length", [0, 8, 20, 33, 50])
def test_any_prefix_of_a_png_is_a_decode_error(rgb_image, length):
    with pytest.raises(MediaDecodeError):
        ImageMediaIO().load_bytes(encode(rgb_image)[:length])


def test_non_image_bytes_are_a_decode_error():
    with pytest.raises(MediaDecodeError, match="not a readable image in an accepted format"):
        ImageMediaIO().load_bytes(b"hello, not an image")


def test_format_outside_the_accepted_list_is_refused(rgb_image):
    with pytest.raises(MediaDecodeError, match="not a readable image in an accepted format"):
        ImageMediaIO().load_bytes(encode(rgb_image, "PPM"))  # Pillow decodes PPM; we do not


@pytest.mark.parametrize("format", ["PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"])
def test_accepted_formats_decode(rgb_image, format):
    loaded = ImageMediaIO().load_bytes(encode(rgb_image, format))
    assert (loaded.mode, loaded.size) == ("RGB", rgb_image.size)


def test_pixel_limit_refuses_before_decoding():
    # The PNG declares 8000x8000 but carries no pixel data: reaching the decoder would be a truncation error.
    with pytest.raises(MediaTooLargeError, match="8000x8000 = 64000000 pixels, over the limit of 50000000"):
        ImageMediaIO().load_bytes(png_header_only(8000, 8000))


def test_pixel_limit_comes_from_media_limits(rgb_image):
    with pytest.raises(MediaTooLargeError, match="over the limit of 47"):
        ImageMediaIO(limits=MediaLimits(max_pixels=47)).load_bytes(encode(rgb_image))  # 8x6 = 48 pixels


def test_pillow_decompression_bomb_error_is_a_too_large_error():
    # Our limit is raised past Pillow's own hard limit (2x Image.MAX_IMAGE_PIXELS), so Pillow refuses first.
    pixels_before = Image.MAX_IMAGE_PIXELS
    with pytest.raises(MediaTooLargeError, match="decompression bomb"):
        ImageMediaIO(limits=MediaLimits(max_pixels=10**10)).load_bytes(png_header_only(20000, 20000))
    assert Image.MAX_IMAGE_PIXELS == pixels_before  # the process-wide threshold is never touched


def test_byte_limit_applies_to_bytes_base64_and_files(tmp_path, rgb_image):
    data = encode(rgb_image)
    media_io = ImageMediaIO(limits=MediaLimits(max_bytes=len(data) - 1))
    path = tmp_path / "image.png"
    path.write_bytes(data)
    for load, source in (
        (media_io.load_bytes, data),
        (media_io.load_base64, base64.b64encode(data).decode()),
        (media_io.load_file, path),
    ):
        with pytest.raises(MediaTooLargeError):
            load(source)


def test_invalid_base64_is_a_decode_error():
    with pytest.raises(MediaDecodeError, match="not valid base64"):
        ImageMediaIO().load_base64("not base64!")


# -- encoding -----------------------------------------------------------------------------------------------


def test_encode_image_base64_round_trips(rgb_image):
    decoded = ImageMediaIO().load_base64(encode_image_base64(rgb_image))
    assert decoded.tobytes() == rgb_image.tobytes()


def test_encode_converts_to_rgb_by_default_and_keeps_mode_with_none():
    rgba = rgba_with_one_opaque_pixel((4, 4), (2, 2))
    keep = ImageMediaIO(image_mode=None)
    assert keep.load_base64(encode_image_base64(rgba)).mode == "RGB"
    kept = keep.load_base64(encode_image_base64(rgba, image_mode=None))
    assert kept.mode == "RGBA"
    assert kept.getpixel((0, 0)) == (0, 0, 0, 0)


def test_encode_image_url_is_a_data_url_with_the_format_media_type(rgb_image):
    png_url = encode_image_url(rgb_image)
    jpeg_url = encode_image_url(rgb_image, format="JPEG")
    assert png_url.startswith("data:image/png;base64,")
    assert jpeg_url.startswith("data:image/jpeg;base64,")
    assert ImageMediaIO().load_base64(png_url.split(",", 1)[1]).tobytes() == rgb_image.tobytes()


def test_encoding_a_mode_the_format_cannot_hold_is_an_option_error():
    rgba = rgba_with_one_opaque_pixel((4, 4), (2, 2))
    with pytest.raises(MediaOptionError, match="cannot encode a mode RGBA image as JPEG"):
        encode_image_base64(rgba, image_mode=None, format="JPEG")


# -- large input stays off the GIL's critical path ----------------------------------------------------------


@pytest.fixture(scope="module")
def noise_png() -> tuple[Image.Image, bytes]:
    """~2 MB of PNG: over the join limit (1 MiB) and ~40 base64 slices of 64 Ki characters."""
    pixels = np.random.default_rng(1).integers(0, 256, (800, 800, 3), dtype=np.uint8)
    image = Image.fromarray(pixels, "RGB")
    data = encode(image)
    assert len(data) > 1 << 20
    return image, data


def test_large_base64_decodes_across_slices_from_an_offset(noise_png):
    image, data = noise_png
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    loaded = ImageMediaIO().load_base64(url, start=url.index(",") + 1)
    assert loaded.tobytes() == image.tobytes()


def test_base64_decoding_yields_the_gil_between_slices(noise_png, monkeypatch):
    """One a2b_base64 call over the whole payload would hold the GIL for its whole run (and the event loop
    thread with it); in slices, with the GIL offered after each one, the loop waits at most one slice."""

    yields = []
    monkeypatch.setattr(media.image, "yield_gil", lambda: yields.append(1))
    payload = base64.b64encode(noise_png[1]).decode()
    ImageMediaIO().load_base64(payload)
    assert len(yields) >= len(payload) // (64 * 1024)


def test_padding_inside_the_payload_is_refused_even_at_a_slice_boundary(rgb_image):
    head = base64.b64encode(b"x" * (48 * 1024 - 1)).decode()  # 64 Ki characters ending in "="
    assert len(head) == 64 * 1024 and head.endswith("=")
    with pytest.raises(MediaDecodeError, match="not valid base64"):
        ImageMediaIO().load_base64(head + encode_image_base64(rgb_image))


def test_non_ascii_base64_is_a_decode_error():
    with pytest.raises(MediaDecodeError, match="not valid base64"):
        ImageMediaIO().load_base64("iVBORw0KGgo" + "é")


@pytest.mark.parametrize("chunk_size", [999, 65536, 1 << 20], ids=lambda n: f"{n}B-chunks")
def test_large_input_in_chunks_decodes_like_one_buffer(noise_png, chunk_size):
    image, data = noise_png
    chunks = [data[i : i + chunk_size] for i in range(0, len(data), chunk_size)]
    assert ImageMediaIO().load_chunks(chunks).tobytes() == image.tobytes()


def test_small_input_in_byte_sized_chunks_decodes(rgb_image):
    data = encode(rgb_image)
    assert ImageMediaIO().load_chunks([data[i : i + 1] for i in range(len(data))]).tobytes() == rgb_image.tobytes()


def test_large_bytearray_input_is_read_in_place_not_copied(noise_png, monkeypatch):
    """BytesIO(bytearray) and b"".join copy the whole input in one GIL-holding call: big input must avoid both."""

    def no_big_copies(initial=b""):
        assert len(initial) <= 1 << 20, f"a {len(initial)}-byte buffer was copied into a BytesIO"
        return real_bytes_io(initial)

    real_bytes_io = media.image.BytesIO
    monkeypatch.setattr(media.image, "BytesIO", no_big_copies)
    image, data = noise_png
    assert ImageMediaIO().load_bytes(bytearray(data)).tobytes() == image.tobytes()
    halves = [data[: len(data) // 2], data[len(data) // 2 :]]
    assert ImageMediaIO().load_chunks(halves).tobytes() == image.tobytes()


def test_chunks_reader_behaves_like_bytesio():
    from media.image import _ChunksReader

    data = bytes(range(256)) * 40
    rng = random.Random(7)
    cuts = sorted(rng.sample(range(1, len(data)), 30))
    chunks = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)] + [b""]
    ours, reference = io.BufferedReader(_ChunksReader(chunks), buffer_size=64), io.BytesIO(data)
    for _ in range(500):
        op = rng.choice(["read", "seek", "seek_cur", "seek_end", "tell"])
        if op == "read":
            n = rng.choice([-1, 0, 1, 3, 50, 200, 5000])
            assert ours.read(n) == reference.read(n)
        elif op == "seek":
            pos = rng.randrange(0, len(data) + 20)
            assert ours.seek(pos) == reference.seek(pos)
        elif op == "seek_cur":
            delta = rng.randrange(-100, 100)
            if reference.tell() + delta >= 0:
                assert ours.seek(delta, io.SEEK_CUR) == reference.seek(delta, io.SEEK_CUR)
        elif op == "seek_end":
            delta = rng.randrange(-len(data), 10)
            assert ours.seek(delta, io.SEEK_END) == reference.seek(delta, io.SEEK_END)
        assert ours.tell() == reference.tell()
