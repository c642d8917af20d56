"""Who is calling: the admin key, a session key or a job key, from ``Authorization: Bearer``;
and, among colocated replicas, whether a session key is this replica's (its :class:`Slot`).

Keys are compared by SHA-256 in constant time and never kept raw. Which admin
keys may guard a port beyond loopback is decided here too (:func:`refuse_public_bind`).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from rlgate.serving.errors import HTTPError
from rlgate.sessions.manager import hash_key, same_secret

# Keys published in other projects' docs and examples: never acceptable off loopback.
KNOWN_WEAK_KEYS = frozenset({"areal-admin-key", "admin", "changeme", "password", "secret", "test", "sk-test"})
MIN_KEY_LENGTH = 16


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_weak(key: str) -> bool:
    return key in KNOWN_WEAK_KEYS or len(key) < MIN_KEY_LENGTH


class AdminKeyRefused(RuntimeError):
    """The admin key may not guard where the application would listen."""


def refuse_public_bind(host: str | None, key_fit_for_public: bool) -> None:
    """Refuse to serve beyond loopback with an admin key that is weak or was
    generated and printed (a print in a Serve replica or build task lands in
    Ray's log files). ``host`` is where Serve's proxies really listen (None:
    Serve runs no HTTP proxy, so nothing listens)."""
    if host is not None and not is_loopback(host) and not key_fit_for_public:
        raise AdminKeyRefused(
            f"rlgate: refusing to serve on {host} (beyond loopback) with a weak or generated admin key: set "
            f"RLGATE_ADMIN_KEY (or RLGATE_ADMIN_KEY_FILE) to a long random key (at least {MIN_KEY_LENGTH} "
            "characters, not a published default), e.g. `openssl rand -hex 32`, in the environment the "
            "application is built in"
        )


def bearer(authorization: str | None) -> str:
    if not authorization:
        raise HTTPError(401, "missing API key: send the header 'Authorization: Bearer <key>'")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise HTTPError(401, "malformed Authorization header: expected 'Bearer <key>'")
    return token.strip()


_SLOTTED = re.compile(r"rlg(\d{1,4})-", re.ASCII)


def key_slot(key: str) -> int | None:
    """The slot a session key names, or None (split-shape keys, admin and job keys)."""
    match = _SLOTTED.match(key)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class Slot:
    """A colocated replica's place: slot ``index`` of ``replicas``."""

    index: int
    replicas: int

    @classmethod
    def of_rank(cls, rank: int, replicas: int) -> Slot:
        """The slot of the replica Serve ranked ``rank``: the same number, which a replacement
        inherits with the sessions' journal. Serve ranks a replacement past the end while the
        replica it replaces is still stopping (it keeps its rank until stopped): that one is
        refused, and Serve starts it again, by then on the freed rank."""
        if not 0 <= rank < replicas:
            raise RuntimeError(
                f"this gateway replica has Serve rank {rank}, past its {replicas} slots: the replica it "
                "replaces still holds its slot while it stops; Serve will start this one again"
            )
        return cls(rank, replicas)

    def owner(self, key: str) -> int | None:
        """The other replica's slot that owns ``key``; None for this one's keys and
        keys that name no replica (those are simply unknown here)."""
        slot = key_slot(key)
        return slot if slot is not None and slot != self.index and slot < self.replicas else None

    def check(self, key: str) -> None:
        owner = self.owner(key)
        if owner is not None:
            raise HTTPError(
                421,
                f"this session belongs to gateway replica {owner} but reached replica {self.index}: send its "
                "requests through a Serve proxy started with rlgate's routing hook "
                "(serve.start(**rlgate.serving.routing.serve_start_options()), or controller_options in a "
                f"Serve config file), or to replica {owner}'s own port ([gateway] direct_port + {owner})",
            )


class Auth:
    def __init__(self, admin_key_hash: str, slot: Slot | None = None) -> None:
        """``slot``: this colocated replica's, whose session keys alone it serves."""
        self.admin_key_hash, self.slot = admin_key_hash, slot

    def is_admin(self, key: str) -> bool:
        return same_secret(hash_key(key), self.admin_key_hash)

    def admin(self, authorization: str | None) -> None:
        if not self.is_admin(bearer(authorization)):
            raise HTTPError(401, "this route needs the admin key")

    def session_key(self, authorization: str | None) -> str:
        """The hash of the session key sent; the admin key is refused (it opens no session)."""
        key = bearer(authorization)
        if self.is_admin(key):
            raise HTTPError(400, "the admin key is not a session key; use the api_key from /rl/start_session")
        if self.slot is not None:
            self.slot.check(key)
        return hash_key(key)

    def job_caller(self, authorization: str | None) -> str | None:
        """None for the admin, else the job key the caller sent."""
        key = bearer(authorization)
        return None if self.is_admin(key) else key
