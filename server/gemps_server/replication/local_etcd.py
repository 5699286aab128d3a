"""A private single-member etcd: `gemps server --replicas R` on one machine elects its partitions'
primaries through one (so does `gemps ray`, for replicas on other machines), and the tests run
against a real one.

Whoever writes its keys decides who is primary, so it is the job's alone: it serves TLS and
requires the job's client certificate (etcd's --client-cert-auth; a per-job CA, etcd_tls.py), on
its client port and on its peer port alike. Its folder (0700: certificates, data, log) lives for
the job's life: `restart()` starts etcd again on the same data, ports and certificates, so the
replicas' keys survive its crash and they reconnect by themselves. `secure=False` serves plain
http, as the tests that are not about its security do.

The binary is Debian's `etcd-server` package (tools/install-system-deps installs it).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType

from gemps_server.replication.etcd_client import EtcdAccess
from gemps_server.replication.etcd_tls import EtcdTls, issue, private_folder

log = logging.getLogger("gemps.server")

#: how long etcd may take to answer after starting
START_TIMEOUT = 10.0
#: how long a stop waits for etcd to exit after SIGTERM before killing it
STOP_TIMEOUT = 5.0
#: etcd's raft timing (ms). Its shortest lease is 1.5 election timeouts in whole seconds: at its
#: defaults (100, 1000) 2 s, so `--replica-lease 1` would last 2. One member has no peer to elect
#: against, so a shorter timeout costs it nothing; at 600 ms the shortest lease is 1 s.
HEARTBEAT_MS, ELECTION_TIMEOUT_MS = 100, 600
_START_ATTEMPTS = 3  # a probed free port can be taken before etcd binds it: rare, so retry


class EtcdNotInstalled(RuntimeError):
    """No etcd binary on this machine."""


def find_etcd() -> str:
    """The etcd binary: first on PATH, else Debian's /usr/bin/etcd (PATH may lack /usr/bin in a
    stripped-down environment)."""
    found = shutil.which("etcd") or ("/usr/bin/etcd" if os.access("/usr/bin/etcd", os.X_OK) else None)
    if found is None:
        raise EtcdNotInstalled(
            "etcd not found on PATH or at /usr/bin/etcd: install Debian's `etcd-server` package "
            "(apt-get install etcd-server, or tools/install-system-deps)"
        )
    return found


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def _scratch_root() -> str | None:
    """Where its folder goes: tmpfs when there is one. The data lives as long as the job (a
    restarted etcd finds it), not longer, so fsync buys nothing, and on a busy disk it would slow
    every write etcd makes through raft."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None


class LocalEtcd:
    """One etcd process on free ports; a context manager (start on enter, stop on exit).
    `host`: the address its clients reach it at instead of loopback (an IPv4 address of this
    machine: replicas on other machines, as `gemps ray` starts); its peer port stays on loopback.
    Clients reach it at `endpoint` with `access` (the job's client certificate; none when not
    `secure`).

    `pause()`/`resume()` freeze and thaw it (SIGSTOP/SIGCONT): to clients it looks like a cut
    cable, which is how the tests exercise fencing. `restart()` brings back a dead one.
    """

    def __init__(
        self, binary: str | None = None, name: str = "gemps-local", host: str = "127.0.0.1", secure: bool = True
    ) -> None:
        self.binary = binary or find_etcd()
        self.name = name
        self.host = host
        self.secure = secure
        self.endpoint = ""  # "https://HOST:PORT" once started
        self.tls: EtcdTls | None = None  # its certificates, once started (secure)
        self._process: subprocess.Popen[bytes] | None = None
        self._data_dir: Path | None = None
        self._argv: list[str] = []
        self._paused = False

    @property
    def pid(self) -> int:
        if self._process is None:
            raise RuntimeError("etcd is not running")
        return self._process.pid

    @property
    def data_dir(self) -> Path | None:
        """Its folder: certificates, data and log (None when stopped)."""
        return self._data_dir

    @property
    def access(self) -> EtcdAccess:
        """What a client needs to reach it: the CA and the job's client pair (nothing when not secure)."""
        if self.tls is None:
            return EtcdAccess()
        return EtcdAccess(str(self.tls.ca), str(self.tls.client_cert), str(self.tls.client_key))

    @property
    def exit_code(self) -> int | None:
        """Its exit status once it died (None: running, or never started)."""
        return None if self._process is None else self._process.poll()

    def client_pems(self) -> dict[str, str]:
        """`access` as PEM texts ("ca", "cert", "key"), for replicas on other machines ({} when not secure)."""
        return {} if self.tls is None else self.tls.client_pems()

    def running(self) -> bool:
        """Whether its process is alive (a paused one is)."""
        return self._process is not None and self._process.poll() is None

    def start(self) -> LocalEtcd:
        for attempt in range(1, _START_ATTEMPTS + 1):
            try:
                self._start_once()
                return self
            except OSError as error:
                self.stop()
                if attempt == _START_ATTEMPTS:
                    raise
                log.warning("etcd did not start (%s); trying other ports", error)
        raise AssertionError("unreachable")

    def _start_once(self) -> None:
        self._data_dir = private_folder(Path(tempfile.mkdtemp(prefix="gemps-etcd-", dir=_scratch_root())))
        scheme = "https" if self.secure else "http"
        client_url = f"{scheme}://{self.host}:{_free_port(self.host)}"
        peer_url = f"{scheme}://127.0.0.1:{_free_port()}"
        self._argv = [
            self.binary,
            f"--name={self.name}",
            f"--data-dir={self._data_dir / 'data'}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster={self.name}={peer_url}",
            "--initial-cluster-state=new",
            f"--heartbeat-interval={HEARTBEAT_MS}",
            f"--election-timeout={ELECTION_TIMEOUT_MS}",
            "--logger=zap",
            "--log-outputs=stderr",
            "--log-level=error",
        ]
        if self.secure:
            self.tls = issue(self._data_dir / "tls", [self.host, "127.0.0.1", "localhost"])
            self._argv += _tls_flags(self.tls)
        self.endpoint = client_url
        self._launch()

    def restart(self) -> None:
        """Start etcd again after it died: the same data, ports and certificates (OSError if it
        does not come back, e.g. its port was taken meanwhile; call again)."""
        if self._data_dir is None:
            raise RuntimeError("etcd was never started (or was stopped)")
        if self.running():
            return
        self._paused = False
        try:
            self._launch()
        except OSError:
            if self._process is not None and self._process.poll() is None:
                self._process.kill()  # up but not healthy in time: dead, so the next call tries again
                self._process.wait()
            raise

    def _launch(self) -> None:
        assert self._data_dir is not None
        # Its log goes to a file, not a pipe: nobody reads a pipe while it runs, and a full one
        # would block etcd. The file is quoted when it fails to start.
        with open(self._data_dir / "etcd.log", "ab") as log_file:
            self._process = subprocess.Popen(
                self._argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
            )
        self._wait_until_healthy()
        log.info("etcd (pid %d) serving on %s", self._process.pid, self.endpoint)

    def _wait_until_healthy(self) -> None:
        assert self._process is not None
        deadline = time.monotonic() + START_TIMEOUT
        context = self._client_context()
        while True:
            if self._process.poll() is not None:
                raise OSError(f"etcd exited with status {self._process.returncode}: {self._log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.endpoint}/health", timeout=1.0, context=context) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass  # not listening yet, or no leader yet (503)
            if time.monotonic() > deadline:
                raise OSError(f"etcd did not answer on {self.endpoint} within {START_TIMEOUT:g} s: {self._log_tail()}")
            time.sleep(0.05)

    def _client_context(self) -> ssl.SSLContext | None:
        if self.tls is None:
            return None
        context = ssl.create_default_context(cafile=str(self.tls.ca))
        context.load_cert_chain(str(self.tls.client_cert), str(self.tls.client_key))
        return context

    def _log_tail(self, limit: int = 2000) -> str:
        try:
            assert self._data_dir is not None
            return (self._data_dir / "etcd.log").read_bytes()[-limit:].decode(errors="replace")
        except (OSError, AssertionError):
            return "(no log)"

    def pause(self) -> None:
        """Freeze etcd (SIGSTOP): connections stay open and nothing answers."""
        os.kill(self.pid, signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)
        self._paused = False

    def stop(self) -> None:
        """Stop etcd and remove its folder (data and certificates); idempotent."""
        process, self._process = self._process, None
        if process is not None:
            if self._paused:
                process.send_signal(signal.SIGCONT)  # a stopped process would not act on SIGTERM
                self._paused = False
            process.terminate()
            try:
                process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._data_dir is not None:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            self._data_dir = None
            self.tls = None

    def __enter__(self) -> LocalEtcd:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()


def _tls_flags(tls: EtcdTls) -> list[str]:
    """TLS on both of its ports, each requiring a certificate the job's CA signed: a client without
    the job's, or a would-be peer, is refused at the handshake."""
    server = [f"--trusted-ca-file={tls.ca}", f"--cert-file={tls.server_cert}", f"--key-file={tls.server_key}"]
    peer = [
        f"--peer-trusted-ca-file={tls.ca}",
        f"--peer-cert-file={tls.server_cert}",
        f"--peer-key-file={tls.server_key}",
    ]
    return ["--client-cert-auth", *server, "--peer-client-cert-auth", *peer]
