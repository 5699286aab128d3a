"""The replicas' etcd client: one gateway client per endpoint, and the one way a request is made.

Every request goes through `EtcdEndpoints.call`: it turns etcd's and the HTTP stack's errors into
CoordinationUnavailable and moves the next call on to the next endpoint.

`EtcdAccess` is how etcd is reached: over TLS (a CA, a client certificate) and as an etcd user,
whose password buys a token from the gateway (POST /v3/auth/authenticate) sent with every
request and bought again when etcd refuses it (tokens expire after minutes unused, and etcd
forgets them all when its auth is turned off and on).
`EtcdEndpoints.check` tells at start-up whether etcd takes these credentials, naming the option
to fix when it does not, and whether it grants a lease as short as --replica-lease asks: etcd
raises a shorter TTL to its own shortest lease, 1.5 of its --election-timeout in whole seconds (2 s
at its default 1000 ms), so a primary lost under `--replica-lease 1` was replaced after 2 s, silently.
"""

from __future__ import annotations

import base64
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import requests
from etcd3gw.client import Etcd3Client
from etcd3gw.exceptions import Etcd3Exception

from gemps_server.config.coordination import CoordinationOptions, endpoint_urls

T = TypeVar("T")
log = logging.getLogger("gemps.server")

#: etcd's HTTP/JSON gateway path: etcd 3.4 and later (Debian bookworm's etcd-server is 3.4)
API_PATH = "/v3/"
#: Once connected, the start-up check waits this long at least for an endpoint's answer: a loaded
#: etcd answers (or hangs up on plain http) later than the election's requests wait (a third of
#: the lease), which read as "not answering yet" let a replica with wrong options start. The
#: connection itself is waited for no longer than those requests: an endpoint cut off stays quick.
CHECK_SECONDS = 5.0
# What etcd answers (HTTP 401, or 400 for the last two) to a token it no longer takes: a new one is
# fetched and the request sent again, once.
_STALE_TOKEN = ("invalid auth token", "auth store is old", "user name is empty")


class CoordinationUnavailable(Exception):
    """etcd could not be reached in time, or answered with an error: who is primary is not known."""


class EtcdAccessRefused(ValueError):
    """etcd answered, and refused these credentials: the server cannot start (the message names
    the option to fix)."""


class EtcdLeaseRefused(ValueError):
    """etcd answered, and grants no lease as short as --replica-lease asks: the server cannot start
    (a lost primary would be replaced later than the option says; the message says what to change)."""


def lease_ttl(seconds: float) -> int:
    """The TTL a lease of `seconds` asks of etcd, which counts whole seconds: rounded up."""
    return max(1, math.ceil(seconds))


def granted_lease(client: Etcd3Client, ttl: int) -> tuple[int, int]:
    """A new lease of `ttl` seconds: its id, and the TTL etcd granted (its shortest, if longer)."""
    result = client.post(client.get_url("/lease/grant"), json={"TTL": ttl, "ID": 0})
    return int(result["ID"]), int(result["TTL"])


def longer_lease(url: str, asked: int, granted: int) -> str:
    """What to say of an etcd at `url` that granted `granted` seconds where `asked` were asked."""
    return (
        f"etcd at {url} grants no lease shorter than {granted} s, and --replica-lease asks {asked} s: a lost "
        f"primary would be replaced after {granted} s. Give --replica-lease {granted} or more, or start etcd "
        f"with --election-timeout of at most {asked * 1000 * 2 // 3} ms (its shortest lease is 1.5 election "
        "timeouts, rounded up to a whole second: 2 s at its default of 1000 ms)"
    )


@dataclass(frozen=True)
class EtcdAccess:
    """How etcd is reached: PEM files for TLS (`ca` to check etcd, `cert`/`key` to be checked by
    it) and an etcd user with its password. Empty: plain http, no user."""

    ca: str = ""
    cert: str = ""
    key: str = ""
    user: str = ""
    password: str = ""

    @classmethod
    def of(cls, options: CoordinationOptions) -> EtcdAccess:
        return cls(options.etcd_ca, options.etcd_cert, options.etcd_key, options.etcd_user, options.etcd_secret())

    @property
    def tls(self) -> bool:
        return bool(self.ca or self.cert)

    def session(self, base_url: str, timeout: float) -> requests.Session:
        """A session to the etcd at `base_url` carrying these credentials."""
        session = self.tls_session()
        if self.user:
            session.auth = _TokenAuth(self, f"{base_url}{API_PATH}auth/authenticate", timeout)
        return session

    def tls_session(self) -> requests.Session:
        """A session with the TLS files alone (the one the password is sent on, too)."""
        session = requests.Session()
        if self.ca:
            session.verify = self.ca
            # Else REQUESTS_CA_BUNDLE (or CURL_CA_BUNDLE) in the environment would replace it.
            session.trust_env = False
        if self.cert:
            session.cert = (self.cert, self.key)
        return session


class _TokenAuth(requests.auth.AuthBase):
    """etcd's auth: the token the user's password buys, in the `Authorization` header; a refused
    token is replaced and the request sent again (as requests' digest auth re-sends on a 401)."""

    def __init__(self, access: EtcdAccess, url: str, timeout: float) -> None:
        self._access = access
        self._url = url
        self._timeout = timeout
        self._lock = threading.Lock()  # one token for the session's threads
        self._token = ""
        self._session = access.tls_session()  # the password goes with the requests' TLS settings

    def __call__(self, request: requests.PreparedRequest) -> requests.PreparedRequest:
        with self._lock:
            if not self._token:
                self._token = self._authenticate()
            request.headers["Authorization"] = self._token
        request.register_hook("response", self._on_response)
        return request

    def _authenticate(self) -> str:
        access = self._access
        response = self._session.post(
            self._url, json={"name": access.user, "password": access.password}, timeout=self._timeout
        )
        if response.status_code != 200:
            raise EtcdAccessRefused(
                f"etcd refused user {access.user!r} (etcd_user, etcd_password / GEMPS_ETCD_PASSWORD): "
                f"{_message(response)}"
            )
        return str(response.json()["token"])

    def close(self) -> None:
        self._session.close()

    def _on_response(self, response: requests.Response, **kwargs: Any) -> requests.Response:
        if not _stale_token(response):
            return response
        with self._lock:
            if response.request.headers.get("Authorization") == self._token:  # not renewed by another thread
                self._token = self._authenticate()
            token = self._token
        again = response.request.copy()
        again.headers["Authorization"] = token
        response.content  # noqa: B018 - read the refused answer, so its connection can be reused
        retried: requests.Response = response.connection.send(again, **kwargs)
        retried.history.append(response)
        return retried


def _message(response: requests.Response) -> str:
    """etcd's error message of a refused request (its gateway's JSON), else the body."""
    try:
        return str(response.json().get("error") or response.json().get("message") or response.text)
    except ValueError:
        return response.text.strip()[:200]


def _stale_token(response: requests.Response) -> bool:
    return response.status_code in (400, 401) and any(text in response.text for text in _STALE_TOKEN)


def _clients(endpoints: str, timeout: float, access: EtcdAccess) -> list[Etcd3Client]:
    """One gateway client per comma-separated endpoint ("http(s)://host:port" or "host:port", which
    means https when certificates are given)."""
    clients = []
    for endpoint in endpoint_urls(endpoints):
        url = urlsplit(endpoint if "//" in endpoint else f"{'https' if access.tls else 'http'}://{endpoint}")
        if url.hostname is None:
            raise ValueError(f"etcd endpoint {endpoint!r}: expected http://host:port")
        base_url = f"{url.scheme}://{url.netloc}"
        clients.append(
            Etcd3Client(
                host=url.hostname,
                port=url.port or 2379,
                protocol=url.scheme,
                timeout=timeout,
                api_path=API_PATH,
                session=access.session(base_url, timeout),
            )
        )
    if not clients:
        raise ValueError("no etcd endpoint given")
    return clients


class EtcdEndpoints:
    """The comma-separated `endpoints` of one etcd cluster, reached with `access`; each request
    bounded by `timeout`."""

    def __init__(self, endpoints: str, timeout: float, access: EtcdAccess | None = None) -> None:
        self._clients = _clients(endpoints, timeout, access or EtcdAccess())
        self._access = access or EtcdAccess()
        self._current = 0  # the endpoint calls go to; the next one after a failure
        self._longer_lease_told = False  # warned that etcd granted a longer lease than asked

    def call(self, what: str, request: Callable[[Etcd3Client], T]) -> T:
        """Run one request against the current endpoint; errors become CoordinationUnavailable,
        and the next call goes to the next endpoint."""
        index = self._current
        client = self._clients[index]
        try:
            return request(client)
        # etcd3gw raises Etcd3Exception for timeouts, refused connections and error statuses;
        # requests' other errors are OSErrors; a garbled answer is a ValueError or KeyError (a
        # refused password is an EtcdAccessRefused, a ValueError: while running, one more outage).
        except (Etcd3Exception, OSError, ValueError, KeyError) as error:
            self._current = (index + 1) % len(self._clients)
            raise CoordinationUnavailable(f"etcd {what} at {client.base_url}: {error!r}") from error

    def grant(self, ttl: int) -> int:
        """A new lease of `ttl` seconds (its id). Longer where etcd's shortest is longer: checked at
        start-up (`check`), so only an etcd changed since is warned of, once."""
        lease_id, granted = self.call("lease grant", lambda client: granted_lease(client, ttl))
        if granted > ttl and not self._longer_lease_told:
            self._longer_lease_told = True
            log.warning("%s", longer_lease(self._clients[0].base_url, ttl, granted))
        return lease_id

    def check(self, key: str, lease: int | None = None) -> list[str]:
        """Read `key` from every endpoint, as the replica will: EtcdAccessRefused when one answers
        and refuses these credentials (naming the option to fix); the endpoints that did not
        answer, as lines to warn of (etcd may be starting: the election waits for it). With
        `lease` (seconds): EtcdLeaseRefused when one grants no lease that short (a probe lease,
        revoked at once)."""
        silent = []
        for client in self._clients:
            try:
                response = client.session.post(
                    f"{client.base_url}{API_PATH}kv/range",
                    json={"key": _b64(key)},
                    timeout=(client.timeout, _check_read_timeout(client.timeout)),  # (connect, read)
                )
            except requests.exceptions.SSLError as error:
                raise EtcdAccessRefused(_tls_refusal(client.base_url, self._access, error)) from None
            except (requests.exceptions.Timeout, requests.exceptions.ConnectionError) as error:
                if "certificate" in str(error).lower():  # a TLS alert read as a closed connection
                    raise EtcdAccessRefused(_tls_refusal(client.base_url, self._access, error)) from None
                if client.protocol == "http" and "Connection aborted." in str(error):
                    # Not a refused connection: a listener that took the request and hung up (or reset
                    # the connection, as TLS ones do with unread bytes: timing picks which) on plain http.
                    raise EtcdAccessRefused(
                        f"etcd at {client.base_url} hung up on plain http: if it serves TLS, give an https:// "
                        "endpoint and etcd_ca (and etcd_cert/etcd_key)"
                    ) from None
                silent.append(f"etcd at {client.base_url} does not answer yet: {error}")
                continue
            if response.status_code != 200:
                raise EtcdAccessRefused(_refusal(client.base_url, self._access, response))
            if lease is not None:
                self._check_lease(client, lease)
        return silent

    @staticmethod
    def _check_lease(client: Etcd3Client, ttl: int) -> None:
        try:
            lease_id, granted = granted_lease(client, ttl)
            client.post(client.get_url("/kv/lease/revoke"), json={"ID": lease_id})
        except (Etcd3Exception, OSError, ValueError, KeyError) as error:  # read above: the election retries
            log.warning("etcd at %s granted no probe lease: %r", client.base_url, error)
            return
        if granted > ttl:
            raise EtcdLeaseRefused(longer_lease(client.base_url, ttl, granted))

    def close(self) -> None:
        """Close the HTTP connections."""
        for client in self._clients:
            if isinstance(client.session.auth, _TokenAuth):
                client.session.auth.close()
            client.session.close()


def check_access(endpoints: str, access: EtcdAccess, key: str, timeout: float, lease: int | None = None) -> None:
    """At start: EtcdAccessRefused when etcd refuses `access`, EtcdLeaseRefused when it grants no
    `lease` that short (EtcdEndpoints.check); a warning for each endpoint that does not answer yet."""
    etcd = EtcdEndpoints(endpoints, timeout, access)
    try:
        for line in etcd.check(key, lease):
            log.warning("%s", line)
    finally:
        etcd.close()


def _check_read_timeout(timeout: float | None) -> float | None:
    """How long the start-up check waits for an answer once connected (None: as long as it takes)."""
    return None if timeout is None else max(timeout, CHECK_SECONDS)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _tls_refusal(url: str, access: EtcdAccess, error: Exception) -> str:
    text = str(error)
    if "CERTIFICATE_VERIFY_FAILED" in text:
        fix = "its certificate is not signed by etcd_ca" if access.ca else "give the CA that signed it: etcd_ca"
    elif not access.cert:
        fix = "it requires a client certificate: give etcd_cert and etcd_key"
    else:
        fix = "it refused etcd_cert (signed by a CA etcd does not trust?)"
    return f"TLS with etcd at {url} failed: {fix} ({text[:300]})"


def _refusal(url: str, access: EtcdAccess, response: requests.Response) -> str:
    message = _message(response)
    if "HTTPS server" in response.text:
        fix = "it speaks TLS: give an https:// etcd endpoint and etcd_ca"
    elif "user name is empty" in message or "invalid auth token" in message:
        fix = "its auth is enabled: give etcd_user and its password (etcd_password_file or GEMPS_ETCD_PASSWORD)"
    elif "permission denied" in message:
        fix = f"etcd_user {access.user!r} may not read the job's keys: grant it readwrite on /gemps/"
    else:
        fix = "it refused the request"
    return f"etcd at {url}: {fix} (HTTP {response.status_code}: {message})"
