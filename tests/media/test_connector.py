"""MediaConnector without the network: options, data URLs, file URLs, URL schemes.

http(s) fetching, limits and SSRF are in test_connector_http.py.
"""

from __future__ import annotations

import base64
import os

import pytest
from PIL import Image

from media import (
    MediaConnector,
    MediaDecodeError,
    MediaFetchError,
    MediaForbiddenError,
    MediaLimits,
    MediaOptionError,
    MediaTooLargeError,
    MediaURLError,
    encode_image_url,
)
from tests.media.conftest import encode, rgba_with_one_opaque_pixel


def data_url(image_bytes: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(image_bytes).decode()}"


@pytest.fixture
def rgba_data_url() -> str:
    return data_url(encode(rgba_with_one_opaque_pixel((4, 4), (2, 2))))


# -- ported from the seed: media_io_kwargs can keep the original mode ---------------------------------------


async def test_fetch_image_keep_original_mode(rgba_data_url, make_connector):
    default = make_connector().fetch_image(rgba_data_url)
    assert default.mode == "RGB"
    assert default.getpixel((0, 0)) == (255, 255, 255)
    assert default.getpixel((2, 2)) == (0, 0, 0)

    connector = make_connector(media_io_kwargs={"image": {"image_mode": None}})
    for image in (connector.fetch_image(rgba_data_url), await connector.fetch_image_async(rgba_data_url)):
        assert image.mode == "RGBA"
        assert image.getpixel((0, 0)) == (0, 0, 0, 0)
        assert image.getpixel((2, 2)) == (0, 0, 0, 255)


# -- media_io_kwargs and image_mode -------------------------------------------------------------------------


async def test_call_image_mode_none_keeps_alpha(rgba_data_url, make_connector):
    image = await make_connector().fetch_image_async(rgba_data_url, image_mode=None)
    assert image.mode == "RGBA"


async def test_media_io_kwargs_image_mode_overrides_the_call(rgba_data_url, make_connector):
    connector = make_connector(media_io_kwargs={"image": {"image_mode": "L"}})
    assert (await connector.fetch_image_async(rgba_data_url, image_mode="RGB")).mode == "L"
    assert (await connector.fetch_image_async(rgba_data_url, image_mode=None)).mode == "L"


async def test_media_io_kwargs_background_colour_is_used(rgba_data_url, make_connector):
    connector = make_connector(media_io_kwargs={"image": {"rgba_background_color": [0, 0, 0]}})
    for image in (connector.fetch_image(rgba_data_url), await connector.fetch_image_async(rgba_data_url)):
        assert image.mode == "RGB"
        assert image.getpixel((0, 0)) == (0, 0, 0)


@pytest.mark.parametrize(
    ("media_io_kwargs", "message"),
    [
        ({"image": {"rgba_background_color": [0, 0]}}, "rgba_background_color must be three integers"),
        ({"image": {"rgba_background_color": [0, 0, 300]}}, "rgba_background_color must be three integers"),
        ({"image": {"image_mode": "nope"}}, "image_mode must be None or one of"),
        ({"image": {"resize": 3}}, "unknown option\\(s\\) 'resize'"),
        ({"image": {"limits": {}}}, "unknown option\\(s\\) 'limits'"),
        ({"video": {"num_frames": 8}}, "unsupported modality 'video'"),
        ({"image": ["RGB"]}, "must be an object of keyword arguments"),
    ],
)
def test_bad_media_io_kwargs_fail_at_construction(media_io_kwargs, message):
    with pytest.raises(MediaOptionError, match=message):
        MediaConnector(media_io_kwargs=media_io_kwargs)


def test_image_io_is_built_once_per_mode_and_still_validates(make_connector):
    connector = make_connector(media_io_kwargs={"image": {"rgba_background_color": [1, 2, 3]}})
    assert connector.image_io("RGB") is connector.image_io("RGB")
    assert connector.image_io(None).image_mode is None and connector.image_io("L").image_mode == "L"
    assert connector.image_io("L").rgba_background_color == (1, 2, 3)
    for bad in ("nope", ["RGB"]):
        with pytest.raises(MediaOptionError, match="image_mode must be None or one of"):
            connector.image_io(bad)


# -- data URLs ----------------------------------------------------------------------------------------------


async def test_data_url_sync_and_async_agree(rgb_image, make_connector):
    connector = make_connector()
    url = encode_image_url(rgb_image)
    sync, asynchronous = connector.fetch_image(url), await connector.fetch_image_async(url)
    assert sync.tobytes() == asynchronous.tobytes() == rgb_image.tobytes()


async def test_data_url_media_type_parameters_are_allowed(rgb_image, make_connector):
    url = data_url(encode(rgb_image), "IMAGE/PNG;charset=binary")
    assert (await make_connector().fetch_image_async(url)).size == rgb_image.size


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("data:text/plain;base64,aGVsbG8=", "media type must be image/\\*, got 'text/plain'"),
        ("data:;base64,aGVsbG8=", "media type must be image/\\*, got 'none'"),
        ("data:image/png,rawbytes", "only base64 data URLs are supported"),
        ("data:image/png;base64", "must look like data:image/<type>;base64,<data>"),
    ],
)
async def test_malformed_data_urls_are_refused(url, message, make_connector):
    connector = make_connector()
    with pytest.raises(MediaURLError, match=message):
        await connector.fetch_image_async(url)
    with pytest.raises(MediaURLError, match=message):
        connector.fetch_image(url)


async def test_data_url_with_bad_base64_is_a_decode_error(make_connector):
    with pytest.raises(MediaDecodeError, match="not valid base64"):
        await make_connector().fetch_image_async("data:image/png;base64,@@@@")


async def test_data_url_with_non_image_payload_is_a_decode_error(make_connector):
    with pytest.raises(MediaDecodeError, match="not a readable image"):
        await make_connector().fetch_image_async(data_url(b"just text"))


async def test_data_url_over_the_byte_limit_is_refused(rgb_image, make_connector):
    image_bytes = encode(rgb_image)
    connector = make_connector(limits=MediaLimits(max_bytes=len(image_bytes) - 1))
    with pytest.raises(MediaTooLargeError):
        await connector.fetch_image_async(data_url(image_bytes))


# -- file URLs ----------------------------------------------------------------------------------------------


@pytest.fixture
def media_dir(tmp_path, rgb_image):
    """tmp/allowed/{image.png, sub/nested.png} and tmp/secret.png outside it."""
    allowed = tmp_path / "allowed"
    (allowed / "sub").mkdir(parents=True)
    rgb_image.save(allowed / "image.png")
    rgb_image.save(allowed / "sub" / "nested.png")
    Image.new("RGB", (3, 3), (255, 0, 0)).save(tmp_path / "secret.png")
    return allowed


async def test_file_url_inside_the_allowed_path_loads(media_dir, rgb_image, make_connector):
    connector = make_connector(allowed_local_media_path=media_dir)
    for path in (media_dir / "image.png", media_dir / "sub" / "nested.png"):
        url = path.as_uri()
        assert (await connector.fetch_image_async(url)).tobytes() == rgb_image.tobytes()
        assert connector.fetch_image(url).tobytes() == rgb_image.tobytes()


async def test_file_url_with_percent_encoding_and_localhost_loads(media_dir, make_connector):
    (media_dir / "with space.png").write_bytes((media_dir / "image.png").read_bytes())
    connector = make_connector(allowed_local_media_path=str(media_dir))
    assert (await connector.fetch_image_async(f"file://localhost{media_dir}/with%20space.png")).size == (8, 6)


async def test_file_urls_are_refused_without_an_allowed_path(media_dir, make_connector):
    with pytest.raises(MediaForbiddenError, match="file: URLs are disabled"):
        await make_connector().fetch_image_async((media_dir / "image.png").as_uri())


@pytest.mark.parametrize(
    "url_of",
    [
        lambda allowed: (allowed.parent / "secret.png").as_uri(),
        lambda allowed: f"file://{allowed}/../secret.png",
        lambda allowed: f"file://{allowed}/sub/../../secret.png",
        lambda allowed: f"file://{allowed}/%2e%2e/secret.png",
        lambda allowed: "file:///etc/passwd",
        lambda allowed: f"file://{allowed}-sibling/image.png",  # a prefix of the path, not inside it
    ],
    ids=["outside", "dotdot", "nested-dotdot", "encoded-dotdot", "etc-passwd", "sibling-prefix"],
)
async def test_file_url_outside_the_allowed_path_is_refused(media_dir, make_connector, url_of):
    connector = make_connector(allowed_local_media_path=media_dir)
    with pytest.raises(MediaForbiddenError, match="outside the allowed local media path"):
        await connector.fetch_image_async(url_of(media_dir))
    with pytest.raises(MediaForbiddenError, match="outside the allowed local media path"):
        connector.fetch_image(url_of(media_dir))


async def test_symlink_escaping_the_allowed_path_is_refused(media_dir, make_connector):
    (media_dir / "escape.png").symlink_to(media_dir.parent / "secret.png")
    (media_dir / "escape-dir").symlink_to(media_dir.parent)
    connector = make_connector(allowed_local_media_path=media_dir)
    for url in ((media_dir / "escape.png").as_uri(), (media_dir / "escape-dir" / "secret.png").as_uri()):
        with pytest.raises(MediaForbiddenError, match="outside the allowed local media path"):
            await connector.fetch_image_async(url)


async def test_symlink_staying_inside_the_allowed_path_loads(media_dir, make_connector):
    (media_dir / "alias.png").symlink_to(media_dir / "sub" / "nested.png")
    connector = make_connector(allowed_local_media_path=media_dir)
    assert (await connector.fetch_image_async((media_dir / "alias.png").as_uri())).size == (8, 6)


async def test_allowed_path_that_is_itself_a_symlink_is_resolved(media_dir, tmp_path, make_connector):
    link = tmp_path / "link-to-allowed"
    link.symlink_to(media_dir)
    connector = make_connector(allowed_local_media_path=link)
    assert (await connector.fetch_image_async((media_dir / "image.png").as_uri())).size == (8, 6)
    assert (await connector.fetch_image_async((link / "image.png").as_uri())).size == (8, 6)


async def test_missing_file_inside_the_allowed_path_is_a_fetch_error(media_dir, make_connector):
    with pytest.raises(MediaFetchError, match="does not exist"):
        await make_connector(allowed_local_media_path=media_dir).fetch_image_async((media_dir / "no.png").as_uri())


async def test_directory_and_fifo_are_refused_without_blocking(media_dir, make_connector):
    os.mkfifo(media_dir / "pipe.png")  # opening a FIFO for reading would wait for a writer forever
    connector = make_connector(allowed_local_media_path=media_dir)
    for path in (media_dir / "sub", media_dir / "pipe.png"):
        with pytest.raises(MediaFetchError, match="not a regular file"):
            await connector.fetch_image_async(path.as_uri())


async def test_file_over_the_byte_limit_is_refused(media_dir, make_connector):
    connector = make_connector(allowed_local_media_path=media_dir, limits=MediaLimits(max_bytes=10))
    with pytest.raises(MediaTooLargeError, match="over the limit of 10"):
        await connector.fetch_image_async((media_dir / "image.png").as_uri())


@pytest.mark.parametrize(
    "url", ["file://otherhost/etc/passwd", "file:relative/image.png", "file:///image.png?x=1"]
)
async def test_malformed_file_urls_are_refused(media_dir, make_connector, url):
    with pytest.raises(MediaURLError):
        await make_connector(allowed_local_media_path=media_dir).fetch_image_async(url)


def test_allowed_path_must_be_an_existing_directory(tmp_path):
    with pytest.raises(ValueError, match="is not an existing directory"):
        MediaConnector(allowed_local_media_path=tmp_path / "missing")


# -- schemes ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["ftp://example.com/a.png", "gopher://x/", "javascript:alert(1)", "a.png", "", "//x"])
async def test_unsupported_schemes_are_refused(url, make_connector):
    connector = make_connector()
    with pytest.raises(MediaURLError, match="must be an http\\(s\\), data or file URL"):
        await connector.fetch_image_async(url)
    with pytest.raises(MediaURLError, match="must be an http\\(s\\), data or file URL"):
        connector.fetch_image(url)


async def test_closed_connector_refuses_to_fetch(rgb_image):
    connector = MediaConnector()
    await connector.close()
    await connector.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        await connector.fetch_image_async(encode_image_url(rgb_image))
