"""A peer run's rendezvous port is picked free and bound a moment later by a child process;
another program may be given it between (a loaded suite's Ray took 44011 from torch-rpc's
parameter server). The run is tried again on another port then, and when torch RPC's start-up
gather fails (its processes never met: nothing was measured), and only then."""

from __future__ import annotations

import socket
from typing import Any

import pytest
from gemps_bench.peers.common import PORT_TRIES, PeerError, on_a_free_port


def bind(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", port))
    return sock


def test_a_port_taken_before_the_child_bound_it_is_replaced_by_another() -> None:
    ports: list[int] = []
    held: list[socket.socket] = []

    def run(port: int) -> dict[str, Any]:
        ports.append(port)
        if len(ports) == 1:
            held.append(bind(port))  # another program takes it first
        try:
            bind(port).close()  # what the child's bind does
        except OSError as error:
            raise PeerError(f"process ps failed:\n{error}") from error
        return {"port": port}

    try:
        assert on_a_free_port(run) == {"port": ports[-1]}
    finally:
        for sock in held:
            sock.close()
    assert len(ports) == 2 and ports[0] != ports[1]


def test_other_failures_are_not_tried_again_and_a_port_taken_every_time_gives_up() -> None:
    calls: list[int] = []

    def fails(port: int) -> dict[str, Any]:
        calls.append(port)
        raise PeerError("process ps failed:\nthe server diverged")

    with pytest.raises(PeerError, match="diverged"):
        on_a_free_port(fails)
    assert len(calls) == 1

    def taken(port: int) -> dict[str, Any]:
        calls.append(port)
        raise PeerError("process ps failed:\nEADDRINUSE: address already in use")

    with pytest.raises(PeerError, match="EADDRINUSE"):
        on_a_free_port(taken)
    assert len(calls) == 1 + PORT_TRIES


def test_a_start_up_gather_that_failed_is_tried_again_saying_so(capsys: pytest.CaptureFixture[str]) -> None:
    calls: list[int] = []

    def once(port: int) -> dict[str, Any]:
        calls.append(port)
        if len(calls) == 1:  # as torch RPC's parameter server reported it when a trainer aborted
            raise PeerError("process ps failed:\nRuntimeError: Followers ['trainer0'] timed out in _all_gather")
        return {"port": port}

    assert on_a_free_port(once) == {"port": calls[-1]} and len(calls) == 2
    assert "did not meet, trying another port" in capsys.readouterr().err
