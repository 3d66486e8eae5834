"""Where the media connector may connect: the SSRF policy and the resolver that enforces it.

Two doors lead to a connection, and both are guarded:
- a URL whose host is an IP literal: `EgressPolicy.check_url` vets the literal (aiohttp dials literals directly);
- a URL with a hostname: aiohttp asks `VettingResolver`, which resolves the name itself, vets every address
  and hands aiohttp only those. aiohttp dials exactly what was vetted, so a DNS answer that changes between
  check and connect (rebinding) cannot slip through: there is no second lookup.

Every redirect hop passes both doors again.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from aiohttp.abc import AbstractResolver, ResolveResult
from yarl import URL

from media.errors import MediaFetchError, MediaForbiddenError, MediaURLError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# loop.getaddrinfo's shape: (host, port, family=..., type=...) -> [(family, type, proto, canonname, sockaddr)]
GetAddrInfo = Callable[..., Awaitable[list[tuple[Any, ...]]]]

# NOTE: refused even with allow_private_addresses: nobody serves images from a metadata endpoint, and a
# developer who lifts the private-address check on a cloud VM must not expose its credentials.
CLOUD_METADATA_ADDRESSES: frozenset[IPAddress] = frozenset(
    ipaddress.ip_address(a)
    for a in (
        "169.254.169.254",  # AWS, GCP, Azure, OpenStack, DigitalOcean, ...
        "169.254.170.2",  # AWS ECS task metadata
        "169.254.169.123",  # AWS time sync
        "fd00:ec2::254",  # AWS IMDS over IPv6
        "100.100.100.200",  # Alibaba Cloud
        "192.0.0.192",  # Oracle Cloud
    )
)
_NAT64_PREFIX = ipaddress.ip_network("64:ff9b::/96")
# What inet_aton accepts besides dotted quads ("127.1", "2130706433", "0x7f.1", "0177.0.0.1"): a resolver would
# turn it into an address, so a host of this shape must be a canonical IP literal or nothing.
_NUMERIC_HOST = re.compile(r"(0x[0-9a-f]*|[0-9]+)(\.(0x[0-9a-f]*|[0-9]+)){0,3}\.?", re.IGNORECASE)


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address is translated to on the way (mapped, NAT64, 6to4), if any."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address in _NAT64_PREFIX:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return address.sixtofour


def forbidden_reason(address: IPAddress, *, allow_private: bool) -> str | None:
    """Why the connector must not connect to `address`, or None when it may.

    An IPv6 address that carries an IPv4 address (::ffff:a.b.c.d, NAT64, 6to4) is judged by the IPv4 address
    its packets end up at.
    """
    if isinstance(address, ipaddress.IPv6Address):
        address = ipaddress.IPv6Address(int(address))  # drop any %scope: it would defeat the set lookup
        address = _embedded_ipv4(address) or address
    if address in CLOUD_METADATA_ADDRESSES:
        return "cloud metadata"
    if allow_private:
        return None
    for reason, matches in (
        ("unspecified", address.is_unspecified),
        ("loopback", address.is_loopback),
        ("link-local", address.is_link_local),
        ("multicast", address.is_multicast),
        ("reserved", address.is_reserved),
        ("private", address.is_private),
        # NOTE: covers what the flags above miss, e.g. carrier-grade NAT 100.64.0.0/10, Teredo 2001::/32.
        ("non-public", not address.is_global),
    ):
        if matches:
            return reason
    return None


def _normalize_host(host: str) -> str:
    """Lower-case ASCII (IDNA) form without the trailing dot, as URL.raw_host gives it."""
    host = host.strip().rstrip(".").lower()
    try:
        return URL.build(scheme="http", host=host).raw_host or host
    except ValueError:
        return host  # not a valid host: it can match no URL, so leaving it as is refuses nothing extra


def _normalize_entry(entry: str) -> str:
    entry = entry.strip()
    return "." + _normalize_host(entry[1:]) if entry.startswith(".") else _normalize_host(entry)


class EgressPolicy:
    """Which hosts and addresses media may be fetched from. Immutable after construction.

    allowed_domains: None allows any host; otherwise a hostname must equal an entry, or be a subdomain of an
        entry written with a leading dot (".example.com" allows "cdn.example.com", not "example.com").
        An empty list allows no host at all.
    allow_private_addresses: lift the loopback/private/link-local/... refusal (local testing only). Cloud
        metadata addresses stay refused.
    trusted_hosts: hostname -> addresses answered without DNS and exempt from the private-address check:
        an operator vouches for them (an internal image mirror); tests map "public.test" to a loopback server.
        They still need to pass allowed_domains.
    getaddrinfo: name resolution, `loop.getaddrinfo` by default; its answers are always vetted.
    """

    def __init__(
        self,
        *,
        allowed_domains: Sequence[str] | None = None,
        allow_private_addresses: bool = False,
        trusted_hosts: Mapping[str, str | Sequence[str]] | None = None,
        getaddrinfo: GetAddrInfo | None = None,
    ) -> None:
        if isinstance(allowed_domains, str):
            raise TypeError("allowed_domains must be a sequence of host names, not one string")
        self._allowed_domains = None if allowed_domains is None else frozenset(map(_normalize_entry, allowed_domains))
        self.allow_private_addresses = allow_private_addresses
        self._trusted_hosts: dict[str, tuple[IPAddress, ...]] = {}
        for host, addresses in (trusted_hosts or {}).items():
            listed = [addresses] if isinstance(addresses, str) else list(addresses)
            self._trusted_hosts[_normalize_host(host)] = tuple(ipaddress.ip_address(a) for a in listed)
        self._getaddrinfo = getaddrinfo

    def is_domain_allowed(self, host: str) -> bool:
        if self._allowed_domains is None:
            return True
        host = _normalize_host(host)
        return host in self._allowed_domains or any(
            entry.startswith(".") and host.endswith(entry) for entry in self._allowed_domains
        )

    def check_url(self, url: URL) -> None:
        """Refuse a URL (first or redirect hop) before any connection: scheme, allowlist, IP literal."""
        if url.scheme not in ("http", "https"):
            raise MediaURLError(f"media URL scheme must be http or https, got {url.scheme or 'none'!r}")
        host = url.raw_host  # ASCII (IDNA) form, what the resolver and the allowlist see
        if not host:
            raise MediaURLError("media URL has no host")
        if not self.is_domain_allowed(host):
            raise MediaForbiddenError(f"media host {host!r} is not in the allowed media domains")
        try:
            literal = ipaddress.ip_address(url.host or "")  # decoded form: an IPv6 zone reads "%eth0", not "%25eth0"
        except ValueError:
            if _NUMERIC_HOST.fullmatch(host):
                raise MediaURLError(f"media URL host {host!r} is not a canonical IP address") from None
            return  # a hostname: VettingResolver checks what it resolves to
        reason = forbidden_reason(literal, allow_private=self.allow_private_addresses)
        if reason is not None:
            raise MediaForbiddenError(f"media URL host {host} is a {reason} address, which is not allowed")

    async def resolve(self, host: str, port: int, family: int = socket.AF_UNSPEC) -> list[tuple[int, str]]:
        """(family, address) pairs to connect to for `host`, every one vetted. Refuses if any is forbidden."""
        name = _normalize_host(host)
        trusted = self._trusted_hosts.get(name)
        if trusted is not None:
            if any(forbidden_reason(a, allow_private=True) for a in trusted):  # i.e. a cloud metadata address
                raise MediaForbiddenError(f"media host {host!r} resolves to a cloud metadata address")
            return [(socket.AF_INET if a.version == 4 else socket.AF_INET6, str(a)) for a in trusted]

        getaddrinfo = self._getaddrinfo or asyncio.get_running_loop().getaddrinfo
        try:
            infos = await getaddrinfo(host, port, family=family, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError):
            raise MediaFetchError(f"cannot resolve media host {host!r}") from None
        resolved: list[tuple[int, str]] = []
        for info_family, _type, _proto, _canonname, sockaddr in infos:
            address = ipaddress.ip_address(sockaddr[0])
            # NOTE: one bad address refuses the host: otherwise a name with a public and a private record
            # would be a coin toss away from an internal service.
            reason = forbidden_reason(address, allow_private=self.allow_private_addresses)
            if reason is not None:
                raise MediaForbiddenError(f"media host {host!r} resolves to a {reason} address, which is not allowed")
            host_address = sockaddr[0]
            if len(sockaddr) >= 4 and sockaddr[3]:  # a scoped IPv6 address: the scope picks the interface
                host_address = f"{host_address.split('%')[0]}%{sockaddr[3]}"
            resolved.append((info_family, host_address))
        if not resolved:
            raise MediaFetchError(f"cannot resolve media host {host!r}")
        return resolved


class VettingResolver(AbstractResolver):
    """The aiohttp resolver of the connector's session: answers only with addresses the policy vetted."""

    def __init__(self, policy: EgressPolicy) -> None:
        self._policy = policy

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        return [
            ResolveResult(
                hostname=host,
                host=address,
                port=port,
                family=address_family,
                proto=0,
                flags=socket.AI_NUMERICHOST | socket.AI_NUMERICSERV,
            )
            for address_family, address in await self._policy.resolve(host, port, family)
        ]

    async def close(self) -> None:
        pass
