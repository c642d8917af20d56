"""rlgate.jobs.egress: which task apps a run may call (pure; DNS is a fake unless the
name is numeric), and the transport that checks every connection as it is made."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI, Request

from rlgate.jobs.egress import Allowlist, GuardedTransport, TargetRefused, check_url, target, vet
from tests.support import serve_asgi

NOTHING = Allowlist.parse([])


def resolver(table: dict[str, list[str]]):
    def resolve(host: str, port: int) -> list[str]:
        if host not in table:
            raise TargetRefused(f"task app host {host!r} does not resolve")
        return table[host]

    return resolve


@pytest.mark.parametrize(
    "address, kind",
    [
        ("127.0.0.1", "loopback"),
        ("127.8.9.10", "loopback"),
        ("::1", "loopback"),
        ("::ffff:127.0.0.1", "loopback"),  # IPv4-mapped
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("169.254.169.254", "link-local"),  # cloud metadata
        ("fe80::1", "link-local"),
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("fd00::1", "private"),
        ("64:ff9b::a00:1", "private"),  # NAT64 of 10.0.0.1
        ("2002:7f00:1::", "loopback"),  # 6to4 of 127.0.0.1
        ("2002:a9fe:a9fe::1", "link-local"),  # 6to4 of 169.254.169.254
        ("224.0.0.1", "multicast"),
        ("ff02::1", "multicast"),
        ("100.64.0.1", "non-public"),  # shared address space (carrier NAT)
        ("fec0::1", "site-local"),
        ("240.0.0.1", "private"),
    ],
)
def test_non_public_addresses_are_refused_with_the_host_the_address_and_the_setting(address, kind):
    with pytest.raises(TargetRefused) as refused:
        vet("taskapp.example", [address], NOTHING)
    message, article = str(refused.value), "an" if kind[0] in "aeiou" else "a"
    assert f"'taskapp.example' resolves to {address}, {article} {kind} address" in message
    assert "[jobs] task_app_hosts" in message


def test_public_addresses_pass_and_every_address_counts():
    assert vet("example.com", ["93.184.215.14", "2606:2800:21f:cb07:6820:80da:af6b:8b2c"], NOTHING) == [
        "93.184.215.14",
        "2606:2800:21f:cb07:6820:80da:af6b:8b2c",
    ]
    assert vet("nat64.example", ["64:ff9b::5db8:d70e"], NOTHING)  # NAT64 of a public address
    with pytest.raises(TargetRefused, match="10.0.0.7, a private address"):  # one private address is enough
        vet("split.example", ["93.184.215.14", "10.0.0.7"], NOTHING)


def test_the_allowlist_admits_names_addresses_and_networks():
    allowed = Allowlist.parse(["TaskApp.Internal.", "127.0.0.1", "10.0.0.0/8", "fd00::/8"])
    assert vet("taskapp.internal", ["10.9.9.9", "192.168.0.1"], allowed)  # a listed name: whatever it resolves to
    assert vet("TASKAPP.internal.", ["192.168.0.1"], allowed)
    assert vet("127.0.0.1", ["127.0.0.1"], allowed)
    assert vet("other.internal", ["10.200.0.1", "fd00::5"], allowed)  # every address in a listed network
    with pytest.raises(TargetRefused, match="127.0.0.2, a loopback address"):  # 127.0.0.1 is one address
        vet("127.0.0.2", ["127.0.0.2"], allowed)
    with pytest.raises(TargetRefused, match="192.168.0.1, a private address"):
        vet("other.internal", ["10.0.0.1", "192.168.0.1"], allowed)


@pytest.mark.parametrize(
    "entry, message",
    [
        ("http://10.0.0.1", "not a URL"),
        ("10.0.0.0/33", "is not a host name, an IP address or a network"),
        ("*.internal", "wildcards are not supported"),
        ("bad host", "is not a host name, an IP address or a network"),
        ("", "is not a host name, an IP address or a network"),
    ],
)
def test_bad_allowlist_entries_are_named(entry, message):
    with pytest.raises(ValueError, match=message) as refused:
        Allowlist.parse(["ok.internal", entry])
    assert repr(entry) in str(refused.value)


@pytest.mark.parametrize(
    "url, message",
    [
        ("file:///etc/passwd", "must be http or https, not 'file'"),
        ("gopher://10.0.0.1:70/", "must be http or https, not 'gopher'"),
        ("ftp://example.com/", "must be http or https"),
        ("http:///health", "has no host"),
        ("taskapp.example:8201", "must start with http:// or https://"),
        ("/rollout", "must start with http:// or https://"),
    ],
)
def test_only_http_and_https_urls_with_a_host(url, message):
    with pytest.raises(TargetRefused, match=message):
        target(url)


def test_credentials_in_the_url_are_refused_without_repeating_them():
    with pytest.raises(TargetRefused, match="user name or password") as refused:
        target("https://user:hunter2-secret@example.com/")
    assert "hunter2" not in str(refused.value)


def test_check_url_resolves_and_vets_every_address():
    table = {"taskapp.example": ["93.184.215.14"], "sneaky.example": ["93.184.215.14", "169.254.169.254"]}
    assert check_url("https://taskapp.example/v1", NOTHING, resolver(table)) == ["93.184.215.14"]
    with pytest.raises(TargetRefused, match="'sneaky.example' resolves to 169.254.169.254, a link-local address"):
        check_url("http://sneaky.example:8080", NOTHING, resolver(table))
    with pytest.raises(TargetRefused, match="'nowhere.example' does not resolve"):
        check_url("http://nowhere.example", NOTHING, resolver(table))


def test_numeric_hosts_are_checked_as_what_they_resolve_to():
    """The system resolver turns 2130706433 and 0x7f.1 into 127.0.0.1: the check
    happens after resolution, so other spellings of a refused address are refused."""
    for host in ("2130706433", "127.1", "[::ffff:127.0.0.1]", "localhost"):
        with pytest.raises(TargetRefused, match="loopback address"):
            check_url(f"http://{host}:8000/", NOTHING)
    assert check_url("http://2130706433:8000/", Allowlist.parse(["127.0.0.0/8"])) == ["127.0.0.1"]


def host_echo() -> FastAPI:
    app = FastAPI()
    app.state.seen = []

    @app.get("/health")
    async def health(request: Request):
        app.state.seen.append(request.headers["host"])
        return {"healthy": True}

    return app


def test_the_transport_connects_only_to_what_it_checked():
    """Each request is resolved and vetted as it connects, then sent to the vetted
    address with the URL's own Host: a name that changes what it resolves to
    between the submission check and the call (DNS rebinding) is refused then."""
    app = host_echo()
    answers = iter([["93.184.215.14"], ["127.0.0.1"]])  # public when submitted, loopback when called
    rebinding = lambda host, port: next(answers)  # noqa: E731
    with serve_asgi(app) as url:
        port = httpx.URL(url).port
        assert check_url(f"http://rebind.example:{port}", NOTHING, rebinding)  # the submission check passes

        async def get(allowed, resolve, host):
            transport = GuardedTransport(allowed, resolve=resolve)
            async with httpx.AsyncClient(transport=transport, timeout=10) as http:
                return await http.get(f"http://{host}:{port}/health")

        with pytest.raises(TargetRefused, match="'rebind.example' resolves to 127.0.0.1, a loopback address"):
            asyncio.run(get(NOTHING, rebinding, "rebind.example"))
        with pytest.raises(TargetRefused, match="loopback address"):
            asyncio.run(get(NOTHING, None, "127.0.0.1"))
        assert app.state.seen == []  # nothing reached the app

        # a listed name is called at the address it was vetted at (no second lookup: .test never resolves)
        named = Allowlist.parse(["taskapp.test"])
        pinned = asyncio.run(get(named, resolver({"taskapp.test": ["127.0.0.1"]}), "taskapp.test"))
        assert pinned.status_code == 200 and app.state.seen == [f"taskapp.test:{port}"]
        assert asyncio.run(get(Allowlist.parse(["127.0.0.1"]), None, "127.0.0.1")).status_code == 200
