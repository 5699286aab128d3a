"""The emulated cluster: each worker of a run in a slot of its own (a CPU quota group and a network
namespace on a tbf-shaped cable), the coordinator in another, and the scenario's faults applied
from outside the processes, so every system gets the same treatment without cooperating.

- speed: the slot's quota scaled (a third of the speed: a third of the quota);
- pauses: SIGSTOP, then SIGCONT, of every process in the slot's group;
- kills: SIGKILL of the slot's processes (but those the system spares: DDP's elastic agent), and
  the slot's command started again after the delay, unless the system restarts it itself;
- the coordinator kill: the system's coordinator slot killed (gemps with replicas: the primary
  alone), and started again (unless its supervisor does);
- bytes on the wire: each host's cable's counters (the switch's end), read at the end.

Needs root: cgroups.unavailable_reason() and simulated_hosts.unavailable_reason() say why not.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from types import TracebackType

from gemps_bench.alternatives.cgroups import CpuGroup, Groups
from gemps_bench.alternatives.cgroups import unavailable_reason as cgroups_unavailable
from gemps_bench.alternatives.scenario import Event, Scenario
from gemps_bench.alternatives.systems.base import COORDINATOR, Launch, System
from gemps_worker.simulated_hosts import Host, SimulatedNetwork
from gemps_worker.simulated_hosts import unavailable_reason as hosts_unavailable


def unavailable_reason() -> str | None:
    """Why the rig cannot run here (one line), or None."""
    return cgroups_unavailable() or hosts_unavailable()


class Rig:
    """One run's slots (a context manager): `start(slot, launch)`, `apply(event)`, `wire_bytes()`."""

    def __init__(self, scenario: Scenario, run_dir: Path, system: System) -> None:
        self.scenario = scenario
        self.run_dir = run_dir
        self.system = system
        self.logs = run_dir / "logs"
        self.network = SimulatedNetwork(rate=scenario.link)
        self.groups = Groups(run_dir.name[:40])
        self.hosts: dict[int, Host] = {}
        self.cpu: dict[int, CpuGroup] = {}
        self.launched: dict[int, tuple[Launch, subprocess.Popen[bytes]]] = {}
        self.extra: list[subprocess.Popen[bytes]] = []  # outside every group: the observer
        self.applied: list[dict[str, object]] = []

    def __enter__(self) -> Rig:
        self.logs.mkdir(parents=True, exist_ok=True)
        try:
            self.network.open()
            self.hosts[COORDINATOR] = self.network.add_host("c")
            self.cpu[COORDINATOR] = self.groups.add("coordinator", self.scenario.coordinator_cpu)
            for i in range(self.scenario.workers):
                self.hosts[i] = self.network.add_host(f"w{i}")
                self.cpu[i] = self.groups.add(f"w{i}", self.scenario.worker_cpu)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def address(self, slot: int) -> str:
        return self.hosts[slot].address

    def start(self, slot: int, launch: Launch) -> subprocess.Popen[bytes]:
        """`launch` in `slot`'s namespace and CPU group, its output appended to logs/<slot>.log."""
        # the group first: `ip netns exec` mounts a sysfs of the namespace's, without the cgroups
        argv = [*self.cpu[slot].enter_argv(), *self.hosts[slot].command(launch.argv)]
        process = self._popen(argv, launch, _slot_name(slot))
        self.launched[slot] = (launch, process)
        return process

    def start_outside(self, slot: int, launch: Launch, name: str) -> subprocess.Popen[bytes]:
        """`launch` in `slot`'s namespace but in no CPU group (the harness's own eyes: gemps' observer)."""
        process = self._popen(self.hosts[slot].command(launch.argv), launch, name)
        self.extra.append(process)
        return process

    def _popen(self, argv: list[str], launch: Launch, name: str) -> subprocess.Popen[bytes]:
        with open(self.logs / f"{name}.log", "ab") as log:
            return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **launch.env})

    def apply(self, event: Event) -> None:
        """One fault event, now; recorded (with its wall time) for the run's log."""
        slot = self.system.coordinator_slot if event.target == COORDINATOR else event.target
        group = self.cpu[slot]
        if event.action == "speed":
            group.set_cores(self.scenario.worker_cpu * event.value)
        elif event.action == "stop":
            group.signal(signal.SIGSTOP)
        elif event.action == "cont":
            group.signal(signal.SIGCONT)
        elif event.action == "kill":
            chosen = set(self.system.killed(event.target, group.pids(), self.launched[slot][1].pid))
            spared = set(group.pids()) - chosen
            group.signal(signal.SIGKILL, spare=spared)
            group.signal(signal.SIGCONT, spare=spared)  # a stopped process dies once continued
        elif event.action == "restart":
            if not self.system.restarts_itself(event.target):
                self._reap(slot)
                self.start(slot, self.launched[slot][0])
        else:
            raise ValueError(f"unknown event action {event.action!r}")
        self.applied.append({"t": time.time(), "at_s": event.at_s, "action": event.action, "target": event.target})

    def _reap(self, slot: int) -> None:
        """Wait for the slot's killed processes to be gone (a restart must not meet them at its port)."""
        deadline = time.monotonic() + 10.0
        while self.cpu[slot].pids() and time.monotonic() < deadline:
            self.cpu[slot].signal(signal.SIGKILL)
            time.sleep(0.05)
        self.launched[slot][1].poll()

    def wire_bytes(self) -> dict[str, int]:
        """Bytes each host has sent down its cable so far (the switch end's received counter), by slot name."""
        found: dict[str, int] = {}
        for slot, host in self.hosts.items():
            shown = subprocess.run(
                ["ip", "-n", self.network.switch, "-s", "-j", "link", "show", "dev", host.switch_port],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            found[_slot_name(slot)] = int(json.loads(shown.stdout)[0]["stats64"]["rx"]["bytes"])
        return found

    def stop_all(self, grace: float = 5.0) -> None:
        """SIGCONT, then SIGTERM every process of the run; SIGKILL what is left after `grace`."""
        for group in self.cpu.values():
            group.signal(signal.SIGCONT)
            group.signal(signal.SIGTERM)
        for process in self.extra:
            process.terminate()
        deadline = time.monotonic() + grace
        while any(g.pids() for g in self.cpu.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        for process in self.extra:
            if process.poll() is None:
                process.kill()
            process.wait()

    def close(self) -> None:
        try:
            self.groups.close()
        finally:
            self.network.close()  # kills whatever is left in the namespaces too
            for _, process in self.launched.values():
                process.poll()


def _slot_name(slot: int) -> str:
    return "coordinator" if slot == COORDINATOR else f"worker-{slot}"
