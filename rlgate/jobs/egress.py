"""Which task apps a run may call: the operator's allowlist, checked after DNS resolution.

A run's driver calls its task app from inside the cluster, with the task app's
key. Unchecked, a task-app URL would let whoever submits an RL job make the
cluster call its own private services (Ray's dashboard and job API, a cloud's
metadata endpoint, anything on the nodes' networks). So a task-app URL must be
``http`` or ``https`` without credentials in it, and every address its host
resolves to must be public: not loopback, link-local, private, unspecified,
multicast or otherwise reserved. ``[jobs] task_app_hosts`` lifts that for the
host names, addresses and networks it lists (an operator's own task apps on a
private network, or on loopback for a demo).

A job's URL is checked when it is submitted (:func:`check_url`) and again on
every connection its driver makes (:class:`GuardedTransport`, which connects
to the very address it vetted), so a name that resolves elsewhere later (DNS
rebinding) is refused then.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import httpx

SETTING = "[jobs] task_app_hosts"

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str, int], list[str]]

_NAME = re.compile(r"^(?=.{1,253}$)([a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?)(\.[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?)*$")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # IPv4 addresses as a NAT64 gateway reaches them


class TargetRefused(ValueError):
    """A task-app URL a run may not call; the message names the host and what to change."""


@dataclass(frozen=True)
class Allowlist:
    """Host names (exact, any case) and networks a run may call although they are not public."""

    names: frozenset[str] = frozenset()
    networks: tuple[Network, ...] = ()

    @classmethod
    def parse(cls, entries: Iterable[str]) -> Allowlist:
        """From ``[jobs] task_app_hosts``: ValueError names the first entry that is none of
        a host name, an IP address or a network."""
        names, networks = set(), []
        for entry in entries:
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
                continue
            except ValueError:
                pass
            name = _normal(entry)
            if "://" in entry:
                raise ValueError(f"{entry!r} is not a URL entry: give the host alone (e.g. 'taskapp.internal')")
            if "*" in entry:
                raise ValueError(f"{entry!r}: wildcards are not supported; list each host name, or a network")
            if not _NAME.match(name) or name.rsplit(".", 1)[-1].isdigit():  # 10.0.0.999 is no name
                raise ValueError(
                    f"{entry!r} is not a host name, an IP address or a network "
                    "(e.g. 'taskapp.internal', '10.0.0.5', '10.0.0.0/8')"
                )
            names.add(name)
        return cls(frozenset(names), tuple(networks))

    def admits(self, address: Address) -> bool:
        return any(address in network for network in self.networks)


def target(url: str) -> tuple[str, int]:
    """The host (ASCII, as it is resolved) and port of a task-app URL, which must be
    ``http`` or ``https``, name a host, and carry no credentials."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as err:
        raise TargetRefused(f"the task app URL is not a URL: {err}") from None
    if not parsed.scheme or "://" not in url:  # taskapp:8201 would read as a scheme
        raise TargetRefused(f"the task app URL {url!r} must start with http:// or https://")
    if parsed.scheme not in ("http", "https"):
        raise TargetRefused(f"a task app URL must be http or https, not {parsed.scheme!r}")
    if parsed.userinfo:  # not repeated: it would put a password into the job's error
        raise TargetRefused(
            "the task app URL carries a user name or password; remove it and pass the task app's key "
            "as task_app_api_key (sent as X-API-Key)"
        )
    host = parsed.raw_host.decode("ascii")
    if not host:
        raise TargetRefused(f"the task app URL {url!r} has no host")
    return host, parsed.port or (443 if parsed.scheme == "https" else 80)


def lookup(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to, as the system resolver answers (numeric
    spellings such as ``2130706433`` included), in its order."""
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as err:
        raise TargetRefused(f"task app host {host!r} does not resolve: {err}") from None
    return list(dict.fromkeys(info[4][0] for info in found))


def vet(host: str, addresses: list[str], allowed: Allowlist) -> list[str]:
    """``addresses`` (what ``host`` resolved to), if a run may call them: every one
    public, or ``host`` listed by name, or every one in a listed network."""
    if not addresses:
        raise TargetRefused(f"task app host {host!r} resolves to no address")
    if _normal(host) in allowed.names:
        return addresses
    for text in addresses:
        address = ipaddress.ip_address(text)
        kind = _kind(address)
        if kind is not None and not allowed.admits(address) and not allowed.admits(_unwrapped(address)):
            article = "an" if kind[0] in "aeiou" else "a"
            listed = f"{text} or a network holding it" if host == text else f"{host!r}, {text} or a network holding it"
            raise TargetRefused(
                f"task app host {host!r} resolves to {text}, {article} {kind} address; a run may call it only if "
                f"{SETTING} lists {listed} (for an RL job, the operator sets that in the gateway's config)"
            )
    return addresses


def check_url(url: str, allowed: Allowlist, resolve: Resolver | None = None) -> list[str]:
    """The addresses a task-app URL's host resolves to, once every one has passed :func:`vet`."""
    host, port = target(url)
    return vet(host, (resolve or lookup)(host, port), allowed)


class GuardedTransport(httpx.AsyncBaseTransport):
    """An httpx transport that checks each request as it connects: the host is
    resolved here, every address vetted, and the request sent to a vetted
    address (the ``Host`` header and TLS keep the URL's name), so what was
    checked is what is called. Redirects are not followed (httpx's default)."""

    def __init__(self, allowed: Allowlist, resolve: Resolver | None = None, **options) -> None:
        self.allowed = allowed
        self.resolve = resolve or lookup
        self.inner = httpx.AsyncHTTPTransport(**options)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        host, port = target(str(request.url))
        addresses = vet(host, await asyncio.to_thread(self.resolve, host, port), self.allowed)
        url = request.url
        request.extensions = {**request.extensions, "sni_hostname": host}
        failure = None
        for address in addresses:  # the next one when one refuses the connection, as a resolver's list is used
            request.url = url.copy_with(host=address)
            try:
                return await self.inner.handle_async_request(request)
            except httpx.ConnectError as err:
                failure = err
        raise failure

    async def aclose(self) -> None:
        await self.inner.aclose()


def _normal(host: str) -> str:
    return host.strip().lower().removesuffix(".")


def _unwrapped(address: Address) -> Address:
    """The IPv4 address inside an IPv4-mapped, 6to4 or NAT64 IPv6 address, else the address."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        if address.sixtofour is not None:  # 2002::/16: a relay would take it to the IPv4 address inside
            return address.sixtofour
        if address in _NAT64:
            return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return address


def _kind(address: Address) -> str | None:
    """What makes ``address`` not public, or None when it is."""
    address = _unwrapped(address)
    checks = [
        ("unspecified", address.is_unspecified),
        ("loopback", address.is_loopback),
        ("link-local", address.is_link_local),
        ("multicast", address.is_multicast),
        ("private", address.is_private),
        ("site-local", isinstance(address, ipaddress.IPv6Address) and address.is_site_local),
        ("reserved", address.is_reserved),
    ]
    kind = next((name for name, found in checks if found), None)
    return kind or (None if address.is_global else "non-public")
