"""Object-store URLs: ``s3://bucket/prefix``, ``gs://bucket/prefix``, ``az://container/prefix``.

Parsed the same way for every scheme: the host part is the bucket (container),
the rest a ``/``-separated prefix. The store itself is built by obstore from
``<scheme>://<bucket>`` and the standard environment variables.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

# The schemes nereid reads model repositories from (obstore's names for them).
SCHEMES = ("s3", "gs", "az")
_URL = re.compile(r"^(?P<scheme>[a-z0-9]+)://(?P<bucket>[^/?#]*)(?P<path>/[^?#]*)?$")


@dataclass(frozen=True)
class StoreURL:
    """A location in an object store: scheme, bucket and a prefix without leading or trailing ``/``."""

    scheme: str
    bucket: str
    prefix: str = ""

    @property
    def bucket_url(self) -> str:
        """``<scheme>://<bucket>``: what the store is built from."""
        return f"{self.scheme}://{self.bucket}"

    def key(self, *parts: str) -> str:
        """The object key of ``parts`` below this prefix (``prefix/a/b``)."""
        return "/".join(p.strip("/") for p in (self.prefix, *parts) if p.strip("/"))

    def child(self, *parts: str) -> StoreURL:
        """The URL of ``parts`` below this one."""
        return StoreURL(self.scheme, self.bucket, self.key(*parts))

    def __str__(self) -> str:
        return f"{self.bucket_url}/{self.prefix}" if self.prefix else self.bucket_url

    def cache_name(self, endpoint: str = "") -> str:
        """A folder name for this location's local cache: readable, and unique by a hash of the URL and the
        ``endpoint`` the store is reached at ("" for the provider's own, which keeps the name it always had)."""
        readable = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{self.scheme}-{self.bucket}-{self.prefix}")[:80]
        identity = str(self) if not endpoint else f"{self} at {endpoint}"
        return f"{readable}-{hashlib.sha256(identity.encode()).hexdigest()[:12]}"


class UserInfoInURL(ValueError):
    """A store URL holding ``user:password@`` before its bucket: its refusal must not quote it."""


def parse_store_url(text: str) -> StoreURL | None:
    """The StoreURL of ``text``, or None when it is not an object-store URL (a local path).

    Raises ValueError for a URL of an unknown scheme or without a bucket; UserInfoInURL for one holding a user
    name or password.
    """
    if "://" not in text:
        return None
    match = _URL.match(text)
    if match is None:
        raise ValueError("is not a URL of the form <scheme>://<bucket>/<prefix>")
    scheme = match.group("scheme")
    if scheme not in SCHEMES:
        raise ValueError(f"has an unknown scheme {scheme!r} (expected a local folder or one of "
                         f"{', '.join(s + '://' for s in SCHEMES)})")
    if not match.group("bucket"):
        raise ValueError("names no bucket")
    if "@" in match.group("bucket") or ":" in match.group("bucket"):
        # "s3://key:secret@bucket" (Hadoop's s3a, smart_open and DVC take it): the store client dropped the
        # credentials and read the environment's, and the URL, secret included, was in every message of the
        # store, clients' included, and in the cache's folder name (the secrets hunt). No bucket name holds these.
        raise UserInfoInURL("holds a user name, a password or a port with its bucket ('user:password@bucket', "
                            "'bucket:443'); a store's credentials go in its environment variables "
                            "(AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, GOOGLE_SERVICE_ACCOUNT, "
                            "AZURE_STORAGE_ACCOUNT_KEY...), its address in its endpoint's (AWS_ENDPOINT_URL...)")
    prefix = "/".join(p for p in (match.group("path") or "").split("/") if p)
    if any(p in (".", "..") for p in prefix.split("/")):
        raise ValueError("must not hold '.' or '..' path segments")
    return StoreURL(scheme, match.group("bucket"), prefix)
