"""Hosts with real links on this one machine: network namespaces joined to a switch by veth pairs.

Everything past one machine is tested on these (docs/RELIABILITY.md, "Simulated hosts"): each
host is a network namespace with its own network stack, so a client on one reaches a server on
another over TCP, as between machines (the data plane's local socket and shared memory are out
of reach there). Each host's cable is a veth pair to a switch namespace (one bridge), shaped with
`tc ... tbf` on both ends (1 Gbit/s by default; this kernel has no netem).

    with SimulatedNetwork() as network:
        server, workers = network.add_host("server"), network.add_host("workers")
        process = server.start(["python", "-m", "gemps_cli", "server", "--host", server.address])
        network.cut(server)   # `ip link set ... down` on the switch's end: packets are dropped
        network.heal(server)  # back up; TCP retransmits what it held
        network.cut_between(server, workers)   # only these two no longer hear each other
        network.heal_between(server, workers)
        server.kill()         # SIGKILL every process in the host, as when a machine dies

Needs root (CAP_NET_ADMIN) and iproute2 (`cut_between` also iptables); `unavailable_reason()`
says why not, in one line.
Namespaces, links and processes are named after this process's pid, so two runs never meet, and
`close()` removes everything it made. Addresses are private to the namespaces: no packet leaves
them, and the host's own stack never sees one.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

SUBNET = "10.231.0"  # hosts are SUBNET.1, SUBNET.2, ... inside the namespaces only
DEFAULT_RATE = "1gbit"
DIRECT_SUBNET = "10.232"  # direct cables between two hosts: 10.232.<pair>.1 and .2
INTERFACE = "eth0"  # a host's one cable, as seen inside it
_CLONE_NEWNET = 0x40000000  # <sched.h>; os.setns is Python 3.12+
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit)\s*$", re.IGNORECASE)
_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}  # tc's: SI units


def rate_bits_per_second(rate: str) -> float:
    """A tc rate ("1gbit", "100mbit") in bits per second; ValueError when not one."""
    match = _RATE.match(rate)
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(f"not a link rate: {rate!r} (e.g. 1gbit, 100mbit)")
    return float(match.group(1)) * _RATE_UNITS[match.group(2).lower()]


def unavailable_reason() -> str | None:
    """Why simulated hosts cannot be made here (one line), or None when they can."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces, veth, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"simulated hosts need iproute2's `{tool}`"
    return None


def enter_namespace(namespace: str) -> None:
    """Move this process into a host's network namespace (what `ip netns exec` does first), for a
    process forked where the host's command line cannot be used. Call it before any thread starts:
    the namespace is the calling thread's, which threads started afterwards inherit."""
    with open(f"/run/netns/{namespace}") as handle:
        _setns(handle.fileno(), namespace)


@contextlib.contextmanager
def inside(namespace: str) -> Iterator[None]:
    """This process in a host's network namespace for the block (enter_namespace), then back in the
    one it was in: a host's `kill` (SimulatedNetwork.close) kills every process inside it."""
    with open("/proc/thread-self/ns/net") as home:
        enter_namespace(namespace)
        try:
            yield
        finally:
            _setns(home.fileno(), "the namespace it left")


def _setns(descriptor: int, label: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(descriptor, _CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns into {label}: {os.strerror(errno)}")


def _run(*argv: str) -> None:
    completed = subprocess.run(list(argv), capture_output=True, text=True)
    if completed.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({completed.returncode}): {completed.stderr.strip()}")


def _shape(namespace: str, device: str, rate: str) -> None:
    """tbf on `device`'s egress: `rate`, a burst large enough for that rate at any kernel HZ."""
    _run("ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root", "tbf",
         "rate", rate, "burst", "1mb", "latency", "50ms")  # fmt: skip


@dataclass
class Host:
    """One simulated machine: a network namespace, its address, and the processes started in it."""

    name: str
    namespace: str
    address: str
    switch_port: str  # the cable's end in the switch namespace (what cut/heal switch)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this host."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def start(
        self, argv: Sequence[str], *, log_path: Path | None = None, env: Mapping[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start `argv` on this host (output to `log_path`, else inherited)."""
        if log_path is None:
            process = subprocess.Popen(self.command(argv), env=env)
        else:
            with open(log_path, "ab") as log:
                process = subprocess.Popen(self.command(argv), stdout=log, stderr=subprocess.STDOUT, env=env)
        self.processes.append(process)
        return process

    def pids(self) -> list[int]:
        """Every process inside this host's namespace, whoever started it."""
        found = subprocess.run(["ip", "netns", "pids", self.namespace], capture_output=True, text=True)
        return [int(pid) for pid in found.stdout.split()]

    def kill(self) -> None:
        """SIGKILL every process on the host, as when the machine dies: no shutdown, no goodbye."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for process in self.processes:
            process.wait()


class SimulatedNetwork:
    """A switch namespace with one bridge, and hosts cabled to it (a context manager)."""

    def __init__(self, rate: str = DEFAULT_RATE) -> None:
        self.rate = rate
        self.prefix = f"g{os.getpid() % 100_000:05d}"  # interface names stay within 15 characters
        self.switch = f"{self.prefix}-switch"
        self.hosts: list[Host] = []
        self._open = False

    def __enter__(self) -> SimulatedNetwork:
        return self.open()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def open(self) -> SimulatedNetwork:
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(reason)
        _run("ip", "netns", "add", self.switch)
        self._open = True
        _run("ip", "-n", self.switch, "link", "add", "bridge", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "bridge", "up")
        return self

    def add_host(self, name: str, rate: str | None = None) -> Host:
        """A new host cabled to the switch, its link shaped to `rate` (default: the network's)."""
        index = len(self.hosts) + 1
        namespace, port, inside = f"{self.prefix}-{name}", f"{self.prefix}p{index}", f"{self.prefix}h{index}"
        host = Host(name, namespace, f"{SUBNET}.{index}", port)
        _run("ip", "netns", "add", namespace)
        self.hosts.append(host)
        _run("ip", "link", "add", inside, "netns", namespace, "type", "veth",
             "peer", "name", port, "netns", self.switch)  # fmt: skip
        _run("ip", "-n", namespace, "link", "set", inside, "name", INTERFACE)
        _run("ip", "-n", namespace, "addr", "add", f"{host.address}/24", "dev", INTERFACE)
        for device, where in (("lo", namespace), (INTERFACE, namespace)):
            _run("ip", "-n", where, "link", "set", device, "up")
        _run("ip", "-n", self.switch, "link", "set", port, "master", "bridge")
        _run("ip", "-n", self.switch, "link", "set", port, "up")
        _shape(namespace, INTERFACE, rate or self.rate)
        _shape(self.switch, port, rate or self.rate)
        return host

    def direct_cable(self, a: Host, b: Host, pair: int, rate: str) -> list[tuple[Host, str]]:
        """A second cable straight from `a` to `b` (the `pair`-th such), shaped to `rate` both ways,
        and routes that send their traffic to each other's (switch) address over it: what they say
        to each other (a replication stream) no longer shares their cables to the switch. Returns
        each end: (host, device)."""
        ends = [(a, f"{self.prefix}x{pair}a", b), (b, f"{self.prefix}x{pair}b", a)]
        _run("ip", "link", "add", ends[0][1], "netns", a.namespace, "type", "veth",
             "peer", "name", ends[1][1], "netns", b.namespace)  # fmt: skip
        for side, (host, device, other) in enumerate(ends):
            address = f"{DIRECT_SUBNET}.{pair}.{side + 1}/30"
            _run("ip", "-n", host.namespace, "addr", "add", address, "dev", device)
            _run("ip", "-n", host.namespace, "link", "set", device, "up")
            _run("ip", "-n", host.namespace, "route", "add", f"{other.address}/32", "dev", device, "src", host.address)
            _shape(host.namespace, device, rate)
        return [(host, device) for host, device, _ in ends]

    def bytes_to(self, host: Host) -> int:
        """Bytes the switch has sent down `host`'s cable so far (to tell when an upload is under way)."""
        found = subprocess.run(
            ["ip", "-n", self.switch, "-s", "-j", "link", "show", "dev", host.switch_port],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        return int(json.loads(found.stdout)[0]["stats64"]["tx"]["bytes"])

    def cut(self, host: Host) -> None:
        """Pull the host's cable: nothing passes either way until `heal` (connections stay open)."""
        _run("ip", "-n", self.switch, "link", "set", host.switch_port, "down")

    def heal(self, host: Host) -> None:
        _run("ip", "-n", self.switch, "link", "set", host.switch_port, "up")

    def cut_between(self, a: Host, b: Host) -> None:
        """`a` and `b` no longer hear each other, while both still reach every other host (a
        partition of the network, not of a machine): each drops what arrives from the other, so
        both ends see silence, as with a cut cable, and connections stay open until `heal_between`."""
        self._between("-I", a, b)

    def heal_between(self, a: Host, b: Host) -> None:
        self._between("-D", a, b)

    def _between(self, action: str, a: Host, b: Host) -> None:
        iptables = shutil.which("iptables") or shutil.which("iptables", path="/usr/sbin:/sbin")
        if iptables is None:
            raise RuntimeError("cutting the link between two simulated hosts needs iptables")
        for host, other in ((a, b), (b, a)):
            _run("ip", "netns", "exec", host.namespace, iptables, action, "INPUT", "-s", other.address, "-j", "DROP")

    def close(self) -> None:
        """Kill every host's processes and delete every namespace this network made."""
        for host in self.hosts:
            host.kill()
        for namespace in [host.namespace for host in self.hosts] + ([self.switch] if self._open else []):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        self.hosts.clear()
        self._open = False


def shared_folder_unavailable_reason() -> str | None:
    """Why a SharedFolder cannot be made here (one line), or None."""
    for tool, package in (("sshfs", "sshfs"), ("sshd", "openssh-server"), ("ssh-keygen", "openssh-client")):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            return f"a shared folder between simulated hosts needs `{tool}` (Debian's {package})"
    if not Path("/dev/fuse").exists():
        return "a shared folder between simulated hosts needs /dev/fuse (sshfs)"
    return None


class SharedFolder:
    """A folder that hosts reach over the network, as on a network filesystem: a storage host
    exports `export` over SFTP (sshd, a key made for the purpose), and a program started with
    `mounted(...)` sees it at a mount point through sshfs, in a mount namespace of its own. Reads
    and writes there cross the storage host's cable: cutting it stalls them, as it would an NFS
    share. Made for tests; nothing here is secure beyond the namespaces it lives in."""

    PORT = 2222

    def __init__(self, host: Host, export: Path, keys: Path) -> None:
        self.host, self.export, self.keys = host, export, keys
        export.mkdir(parents=True, exist_ok=True)
        keys.mkdir(parents=True, exist_ok=True)
        for name in ("client", "host"):
            if not (keys / name).exists():
                _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / name))
        (keys / "authorized_keys").write_text((keys / "client.pub").read_text())
        config = keys / "sshd_config"
        config.write_text(
            f"Port {self.PORT}\nListenAddress {host.address}\nHostKey {keys / 'host'}\n"
            f"AuthorizedKeysFile {keys / 'authorized_keys'}\nPidFile {keys / 'sshd.pid'}\nStrictModes no\n"
            "PermitRootLogin prohibit-password\nUsePAM no\nSubsystem sftp internal-sftp\n"
        )
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory
        self.server = host.start(["/usr/sbin/sshd", "-D", "-e", "-f", str(config)], log_path=keys / "sshd.log")
        deadline = time.monotonic() + 10.0
        while (
            f":{self.PORT} " not in subprocess.run(host.command(["ss", "-ltn"]), capture_output=True, text=True).stdout
        ):
            if self.server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sshd did not start: {(keys / 'sshd.log').read_text()[-500:]}")
            time.sleep(0.05)

    def mounted(self, mount_point: Path) -> list[str]:
        """A command prefix: the program after it runs with the folder mounted at `mount_point`
        (sshfs reconnects when the cable is back; a stalled request fails after about 3 s)."""
        options = (
            f"IdentityFile={self.keys / 'client'},StrictHostKeyChecking=no,UserKnownHostsFile=/dev/null,"
            "reconnect,ServerAliveInterval=1,ServerAliveCountMax=3,ConnectTimeout=5"
        )
        mount = (
            f'mkdir -p "{mount_point}" && sshfs -p {self.PORT} -o {options} '
            f'root@{self.host.address}:"{self.export}" "{mount_point}" && exec "$@"'
        )
        return ["unshare", "-m", "--propagation", "private", "sh", "-c", mount, "sh"]
