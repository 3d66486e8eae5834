"""MediaConnector over http against a real aiohttp server on 127.0.0.1: fetching, limits, redirects, SSRF.

The server is on loopback, so connectors that must succeed either allow private addresses or reach it as
"public.test" through `trusted_hosts`. `connect_log` (autouse) fails any test that dials anything else.
"""

from __future__ import annotations

import asyncio
import base64
import time
from urllib.parse import quote

import pytest

from media import (
    MediaFetchError,
    MediaForbiddenError,
    MediaLimits,
    MediaTimeoutError,
    MediaTooLargeError,
    MediaURLError,
)
from media.errors import MediaDecodeError

PUBLIC = "public.test"  # a "public" name for the loopback server, vouched for through trusted_hosts


@pytest.fixture(autouse=True)
def _no_other_addresses(connect_log):
    """Every test here runs under the connect tripwire."""
    return connect_log


@pytest.fixture
def public_connector(make_connector):
    """Private addresses refused (the default), but public.test maps to the loopback test server."""

    def make(**kwargs):
        return make_connector(trusted_hosts={PUBLIC: "127.0.0.1"}, **kwargs)

    return make


# -- fetching -----------------------------------------------------------------------------------------------


async def test_fetch_png_jpeg_and_rgba(image_server, make_connector, rgb_image):
    connector = make_connector(allow_private_addresses=True)
    png = await connector.fetch_image_async(image_server.url("/rgb.png"))
    assert png.tobytes() == rgb_image.tobytes()
    jpeg = await connector.fetch_image_async(image_server.url("/image.jpg"))
    assert (jpeg.mode, jpeg.size) == ("RGB", rgb_image.size)
    rgba = await connector.fetch_image_async(image_server.url("/rgba.png"))
    assert (rgba.mode, rgba.getpixel((0, 0)), rgba.getpixel((2, 2))) == ("RGB", (255, 255, 255), (0, 0, 0))


async def test_fetch_keeps_alpha_with_image_mode_none_from_media_io_kwargs(image_server, make_connector):
    connector = make_connector(allow_private_addresses=True, media_io_kwargs={"image": {"image_mode": None}})
    image = await connector.fetch_image_async(image_server.url("/rgba.png"))
    assert (image.mode, image.getpixel((0, 0)), image.getpixel((2, 2))) == ("RGBA", (0, 0, 0, 0), (0, 0, 0, 255))


async def test_sync_fetch_works_with_and_without_a_running_loop(image_server, make_connector, rgb_image):
    # Both calls run off this loop, which serves the test server: the sync API blocks whichever thread calls it.
    connector = make_connector(allow_private_addresses=True)
    url = image_server.url("/rgb.png")

    async def inside_another_loop():
        return connector.fetch_image(url)  # a loop is running in this thread: fetched on a helper thread

    from_plain_thread = await asyncio.to_thread(connector.fetch_image, url)  # no loop in that thread
    from_loop_thread = await asyncio.to_thread(asyncio.run, inside_another_loop())
    assert from_loop_thread.tobytes() == from_plain_thread.tobytes() == rgb_image.tobytes()


async def test_sync_fetch_applies_the_same_ssrf_checks(image_server, make_connector):
    with pytest.raises(MediaForbiddenError, match="loopback"):
        await asyncio.to_thread(make_connector().fetch_image, image_server.url("/rgb.png"))
    with pytest.raises(MediaForbiddenError, match="loopback"):
        await asyncio.to_thread(make_connector().fetch_image, image_server.url("/rgb.png", host="localhost"))
    assert image_server.hits == []


async def test_fetches_share_one_session_and_its_pooled_connection(image_server, make_connector, connect_log):
    connector = make_connector(allow_private_addresses=True)
    for _ in range(5):
        await connector.fetch_image_async(image_server.url("/rgb.png"))
    assert connect_log == ["127.0.0.1"]  # one keep-alive connection carried all five
    await connector.close()
    with pytest.raises(RuntimeError, match="closed"):
        await connector.fetch_image_async(image_server.url("/rgb.png"))


async def test_concurrent_fetches_all_succeed(image_server, make_connector, rgb_image):
    connector = make_connector(allow_private_addresses=True)
    images = await asyncio.gather(*(connector.fetch_image_async(image_server.url("/rgb.png")) for _ in range(8)))
    assert {image.tobytes() for image in images} == {rgb_image.tobytes()}


async def test_upstream_http_error_is_a_fetch_error(image_server, make_connector):
    connector = make_connector(allow_private_addresses=True)
    with pytest.raises(MediaFetchError, match="answered HTTP 404"):
        await connector.fetch_image_async(image_server.url("/status/404"))
    with pytest.raises(MediaFetchError, match="answered HTTP 500"):
        await connector.fetch_image_async(image_server.url("/status/500"))


async def test_non_image_body_is_a_decode_error(image_server, make_connector):
    with pytest.raises(MediaDecodeError, match="not a readable image"):
        await make_connector(allow_private_addresses=True).fetch_image_async(image_server.url("/text"))


async def test_truncated_image_is_a_decode_error(image_server, make_connector):
    with pytest.raises(MediaDecodeError):
        await make_connector(allow_private_addresses=True).fetch_image_async(image_server.url("/truncated.png"))


async def test_decompression_bomb_is_refused(image_server, make_connector):
    with pytest.raises(MediaTooLargeError, match="8000x8000"):
        await make_connector(allow_private_addresses=True).fetch_image_async(image_server.url("/bomb.png"))


async def test_connection_refused_is_a_fetch_error(image_server, make_connector):
    port = image_server.port
    await image_server.server.close()
    with pytest.raises(MediaFetchError, match="cannot connect to media host '127.0.0.1'"):
        await make_connector(allow_private_addresses=True).fetch_image_async(f"http://127.0.0.1:{port}/rgb.png")


# -- byte and time limits -----------------------------------------------------------------------------------


async def test_byte_limit_aborts_an_endless_body_mid_stream(image_server, make_connector):
    connector = make_connector(allow_private_addresses=True, limits=MediaLimits(max_bytes=1_000_000))
    with pytest.raises(MediaTooLargeError, match="over the limit of 1000000 bytes"):
        await connector.fetch_image_async(image_server.url("/endless"))
    for _ in range(100):  # the server notices the dropped connection on its next write
        if image_server.state["endless_finished"]:
            break
        await asyncio.sleep(0.01)
    assert image_server.state["endless_finished"]
    # Socket buffers let the server get some way ahead, but nowhere near an unbounded read.
    assert image_server.state["endless_bytes_sent"] < 10_000_000


async def test_declared_content_length_over_the_limit_fails_before_the_body(image_server, make_connector):
    # The server declares a gigabyte and sends nothing: only the Content-Length check can answer quickly.
    connector = make_connector(allow_private_addresses=True, limits=MediaLimits(total_timeout=5.0))
    started = time.monotonic()
    with pytest.raises(MediaTooLargeError):
        await connector.fetch_image_async(image_server.url("/declared-huge"))
    assert time.monotonic() - started < 2.0


async def test_total_timeout_stops_a_trickling_body(image_server, make_connector):
    connector = make_connector(allow_private_addresses=True, limits=MediaLimits(total_timeout=0.5))
    started = time.monotonic()
    with pytest.raises(MediaTimeoutError, match="took longer than allowed"):
        await connector.fetch_image_async(image_server.url("/slow"))
    assert time.monotonic() - started < 2.0


async def test_total_timeout_covers_every_redirect_hop(image_server, make_connector):
    slow = image_server.url("/slow")
    connector = make_connector(allow_private_addresses=True, limits=MediaLimits(total_timeout=0.5))
    with pytest.raises(MediaTimeoutError):
        await connector.fetch_image_async(image_server.url(f"/redirect-to?target={quote(slow)}"))


# -- redirects ----------------------------------------------------------------------------------------------


async def test_redirects_within_the_limit_are_followed(image_server, make_connector, rgb_image):
    connector = make_connector(allow_private_addresses=True, limits=MediaLimits(max_redirects=3))
    image = await connector.fetch_image_async(image_server.url("/redirect/3"))
    assert image.tobytes() == rgb_image.tobytes()
    assert image_server.hits == ["/redirect/3", "/redirect/2", "/redirect/1", "/redirect/0"]


async def test_redirects_over_the_limit_are_refused(image_server, make_connector):
    connector = make_connector(allow_private_addresses=True, limits=MediaLimits(max_redirects=3))
    with pytest.raises(MediaFetchError, match="redirected more than 3 times"):
        await connector.fetch_image_async(image_server.url("/redirect/4"))
    assert "/redirect/0" not in image_server.hits


async def test_max_redirects_zero_refuses_any_redirect(image_server, make_connector):
    connector = make_connector(allow_private_addresses=True, limits=MediaLimits(max_redirects=0))
    with pytest.raises(MediaFetchError, match="redirected more than 0 times"):
        await connector.fetch_image_async(image_server.url("/redirect/1"))


@pytest.mark.parametrize("target", ["file:///etc/passwd", "data:image/png;base64,AAAA", "ftp://example.com/a.png"])
async def test_redirect_to_another_scheme_is_refused(image_server, make_connector, target):
    connector = make_connector(allow_private_addresses=True)
    with pytest.raises(MediaURLError, match="scheme must be http or https"):
        await connector.fetch_image_async(image_server.url(f"/redirect-to?target={quote(target)}"))


# -- SSRF ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url_of",
    [
        lambda port: f"http://127.0.0.1:{port}/rgb.png",
        lambda port: f"http://localhost:{port}/rgb.png",
        lambda port: f"http://[::1]:{port}/rgb.png",
        lambda port: f"http://[::ffff:127.0.0.1]:{port}/rgb.png",
        lambda port: f"http://0.0.0.0:{port}/rgb.png",
        lambda port: "http://10.0.0.1/rgb.png",
        lambda port: "http://192.168.0.1/rgb.png",
        lambda port: "http://169.254.169.254/latest/meta-data/",
        lambda port: "http://[fd00:ec2::254]/latest/meta-data/",
        lambda port: "https://169.254.169.254/",
    ],
    ids=["127.0.0.1", "localhost", "::1", "mapped-loopback", "0.0.0.0", "10.x", "192.168.x",
         "metadata", "metadata-v6", "metadata-https"],
)
async def test_private_targets_are_refused_by_default_without_connecting(
    image_server, make_connector, connect_log, url_of
):
    connector = make_connector()
    with pytest.raises(MediaForbiddenError, match="address, which is not allowed"):
        await connector.fetch_image_async(url_of(image_server.port))
    assert connect_log == []
    assert image_server.hits == []


@pytest.mark.parametrize("host", ["127.1", "2130706433", "0x7f000001"])
async def test_numeric_host_tricks_are_refused_without_connecting(image_server, make_connector, connect_log, host):
    with pytest.raises(MediaURLError, match="not a canonical IP address"):
        await make_connector().fetch_image_async(f"http://{host}:{image_server.port}/rgb.png")
    assert connect_log == []


async def test_allow_private_addresses_lifts_the_refusal(image_server, make_connector, connect_log):
    image = await make_connector(allow_private_addresses=True).fetch_image_async(image_server.url("/rgb.png"))
    assert image.size == (8, 6)
    assert connect_log == ["127.0.0.1"]


async def test_metadata_stays_refused_with_private_addresses_allowed(make_connector, connect_log):
    with pytest.raises(MediaForbiddenError, match="cloud metadata"):
        await make_connector(allow_private_addresses=True).fetch_image_async("http://169.254.169.254/latest/")
    assert connect_log == []


async def test_trusted_public_host_is_fetched_at_its_vetted_address(image_server, public_connector, connect_log):
    image = await public_connector().fetch_image_async(image_server.url("/rgb.png", host=PUBLIC))
    assert image.size == (8, 6)
    assert connect_log == ["127.0.0.1"]


@pytest.mark.parametrize(
    "target_of",
    [
        lambda port: f"http://127.0.0.1:{port}/rgb.png",
        lambda port: f"http://localhost:{port}/rgb.png",
        lambda port: "http://169.254.169.254/latest/meta-data/iam/",
        lambda port: "http://10.0.0.1/rgb.png",
    ],
    ids=["127.0.0.1", "localhost", "metadata", "10.x"],
)
async def test_redirect_from_an_allowed_host_to_a_private_address_is_refused(
    image_server, public_connector, connect_log, target_of
):
    first_hop = image_server.url(f"/redirect-to?target={quote(target_of(image_server.port))}", host=PUBLIC)
    with pytest.raises(MediaForbiddenError, match="address, which is not allowed"):
        await public_connector().fetch_image_async(first_hop)
    assert image_server.hits == ["/redirect-to"]  # the second hop never reached the server
    assert connect_log == ["127.0.0.1"]  # the one connection: the first hop


async def test_redirect_between_allowed_hosts_is_followed(image_server, public_connector):
    target = image_server.url("/rgb.png", host=PUBLIC)
    image = await public_connector().fetch_image_async(
        image_server.url(f"/redirect-to?target={quote(target)}", host=PUBLIC)
    )
    assert image.size == (8, 6)
    assert image_server.hits == ["/redirect-to", "/rgb.png"]


async def test_domain_allowlist_refuses_other_hosts_without_connecting(image_server, public_connector, connect_log):
    connector = public_connector(allowed_media_domains=["images.example.com"])
    with pytest.raises(MediaForbiddenError, match="'public.test' is not in the allowed media domains"):
        await connector.fetch_image_async(image_server.url("/rgb.png", host=PUBLIC))
    assert connect_log == []


async def test_domain_allowlist_admits_listed_hosts(image_server, public_connector):
    connector = public_connector(allowed_media_domains=[PUBLIC])
    assert (await connector.fetch_image_async(image_server.url("/rgb.png", host=PUBLIC))).size == (8, 6)


async def test_domain_allowlist_applies_to_every_redirect_hop(image_server, make_connector):
    # Both names map to the test server; only the first is on the allowlist.
    connector = make_connector(
        trusted_hosts={PUBLIC: "127.0.0.1", "other.test": "127.0.0.1"}, allowed_media_domains=[PUBLIC]
    )
    target = image_server.url("/rgb.png", host="other.test")
    with pytest.raises(MediaForbiddenError, match="'other.test' is not in the allowed media domains"):
        await connector.fetch_image_async(image_server.url(f"/redirect-to?target={quote(target)}", host=PUBLIC))
    assert image_server.hits == ["/redirect-to"]


async def test_domain_allowlist_with_private_addresses_allowed(image_server, make_connector):
    connector = make_connector(allow_private_addresses=True, allowed_media_domains=["127.0.0.1"])
    assert (await connector.fetch_image_async(image_server.url("/rgb.png"))).size == (8, 6)
    with pytest.raises(MediaForbiddenError, match="not in the allowed media domains"):
        await connector.fetch_image_async(image_server.url("/rgb.png", host="localhost"))


# -- the event loop stays responsive ------------------------------------------------------------------------


async def test_decoding_big_images_never_stalls_the_loop(image_server, make_connector, big_jpeg):
    """Three ~20 MB JPEGs over http and one as a data URL, all at once. Decoding one takes ~0.3 s, so a decode
    (or base64 decode) on the loop thread would stall it past the bound; on decode threads it never does."""
    connector = make_connector(
        allow_private_addresses=True, limits=MediaLimits(max_bytes=40 * 1024 * 1024), num_decode_threads=2
    )
    data_url = "data:image/jpeg;base64," + base64.b64encode(big_jpeg).decode()
    done = asyncio.Event()
    worst_stall = 0.0

    async def watch_loop() -> None:
        """How late a 1 ms sleep wakes: whatever holds the loop thread (or the GIL) delays it."""
        nonlocal worst_stall
        while not done.is_set():
            started = time.monotonic()
            await asyncio.sleep(0.001)
            worst_stall = max(worst_stall, time.monotonic() - started - 0.001)

    watcher = asyncio.create_task(watch_loop())
    try:
        fetches = [connector.fetch_image_async(image_server.url(f"/big/{i}.jpg")) for i in range(3)]
        images = await asyncio.gather(*fetches, connector.fetch_image_async(data_url))
    finally:
        done.set()
        await watcher
    assert [image.size for image in images] == [(6000, 6000)] * 4
    assert worst_stall < 0.2, f"the event loop stalled for {worst_stall:.3f} s"
