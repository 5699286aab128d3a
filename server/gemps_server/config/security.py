"""Who may talk to the server: TLS (mutual, with a client CA) and the bearer token."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


def valid_token(token: str) -> bool:
    """A bearer token fits an HTTP/2 header value: visible ASCII, no spaces, not empty."""
    return bool(token) and all(33 <= ord(c) <= 126 for c in token)


@dataclass(frozen=True)
class SecurityOptions:
    tls_cert: str = field(default="", metadata={"help": "PEM certificate chain: serve TLS (needs --tls-key)"})
    tls_key: str = field(default="", metadata={"help": "PEM private key of --tls-cert"})
    tls_client_ca: str = field(
        default="", metadata={"help": "PEM CA bundle: require client certificates it signed (mutual TLS)"}
    )
    tls_crl: str = field(
        default="",
        metadata={
            "help": "certificate revocation list(s) of --tls-client-ca (PEM, one or more; or one DER list; an "
            "intermediate CA's list needs that CA in --tls-client-ca): a worker or replica whose certificate, or "
            "a CA of its chain, is listed is refused on its next call, request or replication frame, connections "
            "open before included; re-read within a second when the file changes, no restart"
        },
    )
    auth_token: str = field(
        default="", metadata={"help": "require 'authorization: Bearer TOKEN' on every RPC except health checks"}
    )
    auth_token_file: str = field(default="", metadata={"help": "read the bearer token from this file instead"})

    def problems(self) -> list[str]:
        """Options that need each other, a token a header cannot carry, and files that are not there."""
        found = []
        if bool(self.tls_cert) != bool(self.tls_key):
            found.append("tls_cert and tls_key go together: give both or neither")
        if self.tls_client_ca and not self.tls_cert:
            found.append("tls_client_ca (mutual TLS) needs tls_cert and tls_key")
        if self.tls_crl and not self.tls_client_ca:
            found.append("tls_crl revokes client certificates: it needs tls_client_ca (mutual TLS)")
        if self.auth_token and self.auth_token_file:
            found.append("give auth_token or auth_token_file, not both")
        if self.auth_token and not valid_token(self.auth_token):
            found.append("auth_token must be printable ASCII without spaces")
        for name in ("tls_cert", "tls_key", "tls_client_ca", "tls_crl", "auth_token_file"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                found.append(f"{name} {path!r} is not a readable file")
        return found

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    def token(self) -> str:
        """The bearer token clients must send ('' when auth is off); reads auth_token_file."""
        if not self.auth_token_file:
            return self.auth_token
        token = Path(self.auth_token_file).read_text().strip()
        if not valid_token(token):
            raise ValueError(f"auth_token_file {self.auth_token_file}: the token must be visible ASCII, no spaces")
        return token
