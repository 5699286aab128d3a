"""How the replicas reach etcd, the coordinator that decides each partition's primary (DESIGN §3d):
TLS (the CA etcd's certificate is checked against, a client certificate for etcd's
--client-cert-auth) and etcd's own users (a user and its password).

Whoever can write etcd's keys decides who is primary, so an etcd reachable by others must be
reached with these. The private etcd `gemps server --replicas R` starts is given them by its
supervisor: its own CA and client certificate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

_FILES = ("etcd_ca", "etcd_cert", "etcd_key", "etcd_password_file")


def endpoint_urls(endpoints: str) -> list[str]:
    """The comma-separated endpoints, each as written."""
    return [part for part in (piece.strip() for piece in endpoints.split(",")) if part]


@dataclass(frozen=True)
class CoordinationOptions:
    etcd_ca: str = field(
        default="",
        metadata={"help": "PEM CA bundle etcd's server certificate is checked against (https:// --etcd endpoints)"},
    )
    etcd_cert: str = field(
        default="",
        metadata={"help": "PEM client certificate shown to etcd (etcd's --client-cert-auth; needs --etcd-key)"},
    )
    etcd_key: str = field(default="", metadata={"help": "PEM private key of --etcd-cert"})
    etcd_user: str = field(
        default="",
        metadata={
            "help": "etcd user the replicas authenticate as (etcd's auth enabled); its password from "
            "--etcd-password-file or GEMPS_ETCD_PASSWORD"
        },
    )
    etcd_password: str = field(
        default="",
        metadata={
            "help": "password of --etcd-user: prefer GEMPS_ETCD_PASSWORD or --etcd-password-file (a command line "
            "is visible to every local user)"
        },
    )
    etcd_password_file: str = field(default="", metadata={"help": "read --etcd-user's password from this file"})

    def problems(self) -> list[str]:
        """Options that need each other, and files that are not there."""
        found = []
        if bool(self.etcd_cert) != bool(self.etcd_key):
            found.append("etcd_cert and etcd_key go together: give both or neither")
        if self.etcd_password and self.etcd_password_file:
            found.append("give etcd_password (GEMPS_ETCD_PASSWORD) or etcd_password_file, not both")
        if self.etcd_user and not (self.etcd_password or self.etcd_password_file):
            found.append(f"etcd_user {self.etcd_user!r} needs a password: etcd_password_file or GEMPS_ETCD_PASSWORD")
        if (self.etcd_password or self.etcd_password_file) and not self.etcd_user:
            found.append("an etcd password needs etcd_user")
        for name in _FILES:
            path = getattr(self, name)
            if path and not Path(path).is_file():
                found.append(f"{name} {path!r} is not a readable file")
        return found

    def endpoint_problems(self, endpoints: str, replicated: bool) -> list[str]:
        """Credentials for an etcd that is not named, and certificates over plain http."""
        given = [name for name in ("etcd_ca", "etcd_cert", "etcd_user") if getattr(self, name)]
        if not endpoints:
            return [f"{', '.join(given)}: for an etcd that --etcd names"] if given and replicated else []
        if not (self.etcd_ca or self.etcd_cert):
            return []
        plain = [url for url in endpoint_urls(endpoints) if urlsplit(url).scheme == "http"]
        return [f"etcd endpoint {url!r} is plain http, but etcd_ca/etcd_cert are given: use https://" for url in plain]

    def etcd_secret(self) -> str:
        """--etcd-user's password ('' without a user); reads etcd_password_file."""
        if not self.etcd_password_file:
            return self.etcd_password
        return Path(self.etcd_password_file).read_text().rstrip("\r\n")
