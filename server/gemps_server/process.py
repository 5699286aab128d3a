"""Run `gemps server` as a child process on a free port (for the demo, tests and benchmarks)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

# Code run in the child before the CLI: modules named in GEMPS_BLOCK_MODULES fail to import,
# which lets tests prove the server runs without them (torch, say).
_BOOTSTRAP = (
    "import os, sys\n"
    "for name in filter(None, os.environ.get('GEMPS_BLOCK_MODULES', '').split(',')):\n"
    "    sys.modules[name] = None\n"
    "from gemps.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


class ServerProcess:
    """A `gemps server` child process; `with ServerProcess(rule="gem") as server: server.target`.

    Options are ServerConfig field names (`lease_ttl=2.0` becomes `--lease-ttl 2.0`). The gRPC
    and metrics ports default to 0 (free ports); the child reports them through its port file.
    """

    def __init__(
        self,
        *,
        block_modules: tuple[str, ...] = (),
        log_path: Path | None = None,
        startup_timeout: float = 30.0,
        **options: object,
    ) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="gemps-server-")
        self.port_file = Path(self._dir.name) / "port"
        self.log_path = log_path or Path(self._dir.name) / "server.log"
        self.options = {"host": "127.0.0.1", "port": 0, "metrics_port": 0, **options}
        self.block_modules = block_modules
        self.startup_timeout = startup_timeout
        self.port = 0
        self.metrics_port = -1
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    def argv(self) -> list[str]:
        args = ["server", "--port-file", str(self.port_file)]
        for key, value in self.options.items():
            args += ["--" + key.replace("_", "-"), str(value)]
        return args

    def start(self) -> ServerProcess:
        self.port_file.unlink(missing_ok=True)
        env = {**os.environ, "GEMPS_BLOCK_MODULES": ",".join(self.block_modules)}
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                [sys.executable, "-c", _BOOTSTRAP, *self.argv()], stdout=log, stderr=subprocess.STDOUT, env=env
            )
        deadline = time.monotonic() + self.startup_timeout
        while not self.port_file.exists():
            if self._process.poll() is not None:
                raise RuntimeError(f"gemps server exited with {self._process.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"gemps server not serving after {self.startup_timeout}s:\n{self.log()}")
            time.sleep(0.02)
        lines = self.port_file.read_text().split()
        self.port, self.metrics_port = int(lines[0]), int(lines[1])
        return self

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM (graceful shutdown), then SIGKILL after `timeout`; returns the exit code."""
        if self._process is None:
            return None
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        return self._process.returncode

    def kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
        self._dir.cleanup()
