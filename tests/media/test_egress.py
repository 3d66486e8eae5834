"""The SSRF policy: which addresses and hosts the connector may reach. Pure; no socket is opened here."""

from __future__ import annotations

import ipaddress
import socket

import pytest
from yarl import URL

from media import EgressPolicy, MediaFetchError, MediaForbiddenError, MediaURLError
from media.egress import forbidden_reason


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("127.0.0.1", "loopback"),
        ("127.8.9.10", "loopback"),
        ("::1", "loopback"),
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("fc00::1", "private"),
        ("169.254.1.1", "link-local"),
        ("fe80::1", "link-local"),
        ("169.254.169.254", "cloud metadata"),
        ("fd00:ec2::254", "cloud metadata"),
        ("100.100.100.200", "cloud metadata"),
        ("224.0.0.1", "multicast"),
        ("ff02::1", "multicast"),
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("240.0.0.1", "reserved"),
        ("100.64.0.1", "non-public"),  # carrier-grade NAT
        ("::ffff:127.0.0.1", "loopback"),  # IPv4-mapped
        ("::ffff:169.254.169.254", "cloud metadata"),
        ("64:ff9b::a00:1", "private"),  # NAT64 of 10.0.0.1
        ("2002:a00:1::", "private"),  # 6to4 of 10.0.0.1
    ],
)
def test_non_public_addresses_are_refused_by_default(address, reason):
    assert forbidden_reason(ipaddress.ip_address(address), allow_private=False) == reason


@pytest.mark.parametrize("address", ["93.184.215.14", "8.8.8.8", "2606:4700:4700::1111", "::ffff:8.8.8.8"])
def test_public_addresses_are_allowed(address):
    assert forbidden_reason(ipaddress.ip_address(address), allow_private=False) is None


@pytest.mark.parametrize("address", ["127.0.0.1", "10.1.2.3", "::1", "fe80::1"])
def test_allow_private_lifts_the_private_address_refusal(address):
    assert forbidden_reason(ipaddress.ip_address(address), allow_private=True) is None


@pytest.mark.parametrize("address", ["169.254.169.254", "fd00:ec2::254", "::ffff:169.254.169.254"])
def test_cloud_metadata_stays_refused_with_private_allowed(address):
    assert forbidden_reason(ipaddress.ip_address(address), allow_private=True) == "cloud metadata"


def test_scoped_ipv6_address_is_judged_without_its_scope():
    assert forbidden_reason(ipaddress.ip_address("fd00:ec2::254%eth0"), allow_private=True) == "cloud metadata"


# -- URLs ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1/x",
        "http://[::1]/x",
        "http://10.0.0.1/x",
        "http://169.254.169.254/latest/meta-data/",
        "http://[fd00:ec2::254]/",
        "http://[::ffff:7f00:1]/",
        "http://[fe80::1%25eth0]/",
        "http://0.0.0.0/",
    ],
)
def test_ip_literal_urls_are_refused_before_any_lookup(url):
    with pytest.raises(MediaForbiddenError, match="address, which is not allowed"):
        EgressPolicy().check_url(URL(url))


@pytest.mark.parametrize("host", ["127.1", "2130706433", "0x7f000001", "0x7f.1", "0177.0.0.1", "10.1"])
def test_non_canonical_numeric_hosts_are_refused(host):
    with pytest.raises(MediaURLError, match="not a canonical IP address"):
        EgressPolicy(allow_private_addresses=True).check_url(URL(f"http://{host}/"))


@pytest.mark.parametrize("url", ["ftp://example.com/a.png", "file:///etc/passwd", "gopher://example.com/"])
def test_only_http_and_https_pass(url):
    with pytest.raises(MediaURLError, match="scheme must be http or https"):
        EgressPolicy().check_url(URL(url))


def test_domain_allowlist_matches_exact_hosts_and_dotted_subdomains():
    policy = EgressPolicy(allowed_domains=["images.example.com", ".cdn.example.org"])
    for allowed in ("images.example.com", "IMAGES.example.com.", "a.cdn.example.org", "b.a.cdn.example.org"):
        assert policy.is_domain_allowed(allowed), allowed
    for refused in ("example.com", "x.images.example.com", "cdn.example.org", "evilcdn.example.org", "evil.com"):
        assert not policy.is_domain_allowed(refused), refused


def test_domain_allowlist_compares_internationalised_names_in_ascii_form():
    policy = EgressPolicy(allowed_domains=["bücher.example", ".xn--caf-dma.example"])
    assert policy.is_domain_allowed("xn--bcher-kva.example")
    policy.check_url(URL("https://Bücher.example/a.png"))
    policy.check_url(URL("https://img.café.example/a.png"))
    with pytest.raises(MediaForbiddenError):
        policy.check_url(URL("https://bucher.example/a.png"))


def test_empty_domain_allowlist_refuses_every_host():
    with pytest.raises(MediaForbiddenError, match="not in the allowed media domains"):
        EgressPolicy(allowed_domains=[]).check_url(URL("https://example.com/a.png"))


def test_allowlist_is_checked_before_the_address():
    with pytest.raises(MediaForbiddenError, match="not in the allowed media domains"):
        EgressPolicy(allowed_domains=["example.com"], allow_private_addresses=True).check_url(URL("http://10.0.0.1/"))


def test_a_single_string_allowlist_is_a_type_error():
    with pytest.raises(TypeError):
        EgressPolicy(allowed_domains="example.com")


# -- resolution ---------------------------------------------------------------------------------------------


def fake_getaddrinfo(table: dict[str, list[str]]):
    """A getaddrinfo over a fixed table; unknown names fail like NXDOMAIN. Records every lookup."""
    lookups: list[str] = []

    async def getaddrinfo(host, port, *, family=0, type=0):
        lookups.append(host)
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [
            (socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in table[host]
        ]

    getaddrinfo.lookups = lookups
    return getaddrinfo


async def test_every_resolved_address_must_be_public():
    getaddrinfo = fake_getaddrinfo({"mixed.test": ["93.184.215.14", "10.0.0.7"]})
    with pytest.raises(MediaForbiddenError, match="'mixed.test' resolves to a private address") as raised:
        await EgressPolicy(getaddrinfo=getaddrinfo).resolve("mixed.test", 80)
    assert "10.0.0.7" not in str(raised.value)  # the internal address is not echoed to the client


async def test_public_names_resolve_to_their_addresses():
    getaddrinfo = fake_getaddrinfo({"public.test": ["93.184.215.14", "2606:4700::1"]})
    resolved = await EgressPolicy(getaddrinfo=getaddrinfo).resolve("public.test", 443)
    assert resolved == [(socket.AF_INET, "93.184.215.14"), (socket.AF_INET6, "2606:4700::1")]


async def test_unresolvable_name_is_a_fetch_error():
    with pytest.raises(MediaFetchError, match="cannot resolve media host 'nowhere.test'"):
        await EgressPolicy(getaddrinfo=fake_getaddrinfo({})).resolve("nowhere.test", 80)


async def test_trusted_hosts_skip_dns_and_the_private_check():
    getaddrinfo = fake_getaddrinfo({})
    policy = EgressPolicy(trusted_hosts={"mirror.internal": "10.0.0.5"}, getaddrinfo=getaddrinfo)
    assert await policy.resolve("Mirror.Internal.", 80) == [(socket.AF_INET, "10.0.0.5")]
    assert getaddrinfo.lookups == []


@pytest.mark.parametrize("address", ["169.254.169.254", "::ffff:169.254.169.254"])
async def test_trusted_hosts_never_reach_cloud_metadata(address):
    policy = EgressPolicy(trusted_hosts={"meta.test": address}, getaddrinfo=fake_getaddrinfo({}))
    with pytest.raises(MediaForbiddenError, match="cloud metadata"):
        await policy.resolve("meta.test", 80)
