"""A channel's security settings: TLS material and a bearer token, from arguments or GEMPS_* variables
(settings only: the sockets are `gemps.data_plane_connection` and gRPC's channels)."""

from __future__ import annotations

import os
import ssl
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from gemps.options import parse_bool

Pem = str | bytes  # a PEM file's path, or its content


def _pem(value: Pem | None) -> bytes | None:
    if value is None or value == "":
        return None
    return value if isinstance(value, bytes) else Path(value).read_bytes()


def _token_file(path: str) -> str:
    """The token in GEMPS_AUTH_TOKEN_FILE's file; ValueError naming both if unreadable or empty
    (an empty one would send no token, and the server's refusal would not say why)."""
    try:
        token = Path(path).read_text().strip()
    except OSError as error:
        raise ValueError(f"GEMPS_AUTH_TOKEN_FILE names {path}, which cannot be read: {error.strerror}") from error
    if not token:
        raise ValueError(f"GEMPS_AUTH_TOKEN_FILE names {path}, which is empty")
    return token


@dataclass(frozen=True)
class ChannelSecurity:
    """How to reach a server: TLS material and a bearer token (None: plaintext, no token).

    `resolve` fills what the caller left out from GEMPS_AUTH_TOKEN (or the file in
    GEMPS_AUTH_TOKEN_FILE), GEMPS_TLS (1: TLS with the system's root certificates), GEMPS_TLS_CA,
    GEMPS_TLS_CLIENT_CERT, GEMPS_TLS_CLIENT_KEY and GEMPS_TLS_SERVER_NAME.
    """

    token: str | None = None
    tls: bool = False
    ca_cert: bytes | None = None  # PEM roots to verify the server (None: the system's)
    client_cert: bytes | None = None  # PEM chain for mutual TLS
    client_key: bytes | None = None
    server_name: str | None = None  # expected name in the server's certificate, if not the target's

    @classmethod
    def resolve(
        cls,
        *,
        token: str | None = None,
        tls: bool | None = None,
        ca_cert: Pem | None = None,
        client_cert: Pem | None = None,
        client_key: Pem | None = None,
        server_name: str | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> ChannelSecurity:
        env = os.environ if environ is None else environ
        if token is None:
            token = env.get("GEMPS_AUTH_TOKEN") or None
            if token is None and env.get("GEMPS_AUTH_TOKEN_FILE"):
                token = _token_file(env["GEMPS_AUTH_TOKEN_FILE"])
        if tls is False:  # plaintext asked for: certificates from the environment do not apply
            if ca_cert or client_cert or client_key:
                raise ValueError("TLS certificates given but tls=False")
            env = {key: value for key, value in env.items() if not key.startswith("GEMPS_TLS")}
        ca = _pem(ca_cert if ca_cert is not None else env.get("GEMPS_TLS_CA"))
        cert = _pem(client_cert if client_cert is not None else env.get("GEMPS_TLS_CLIENT_CERT"))
        key = _pem(client_key if client_key is not None else env.get("GEMPS_TLS_CLIENT_KEY"))
        if (cert is None) != (key is None):
            raise ValueError("a client certificate and its key go together: give both or neither")
        if tls is None:
            tls = parse_bool(env.get("GEMPS_TLS", ""), "GEMPS_TLS") or ca is not None or cert is not None
        return cls(
            token=token or None,
            tls=tls,
            ca_cert=ca,
            client_cert=cert,
            client_key=key,
            server_name=server_name or env.get("GEMPS_TLS_SERVER_NAME") or None,
        )

    def channel(self, target: str, options: list[tuple[str, object]]) -> grpc.Channel:
        if not self.tls:
            return grpc.insecure_channel(target, options=options)
        credentials = grpc.ssl_channel_credentials(
            root_certificates=self.ca_cert, private_key=self.client_key, certificate_chain=self.client_cert
        )
        if self.server_name:
            options = [*options, ("grpc.ssl_target_name_override", self.server_name)]
        return grpc.secure_channel(target, credentials, options=options)

    def ssl_context(self) -> ssl.SSLContext:
        """The same trust for a plain socket (the data plane): these roots (else the system's) and
        this client certificate. The caller checks the name: `server_name`, else the target's host."""
        context = ssl.create_default_context(cadata=self.ca_cert.decode("ascii") if self.ca_cert else None)
        if self.client_cert is not None and self.client_key is not None:
            # ssl loads a certificate chain from files only: written to a private folder, then gone.
            with tempfile.TemporaryDirectory() as folder:
                cert, key = Path(folder, "cert.pem"), Path(folder, "key.pem")
                cert.write_bytes(self.client_cert)
                key.write_bytes(self.client_key)
                context.load_cert_chain(cert, key)
        return context

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()
