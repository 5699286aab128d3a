"""A rule of rounds' progress where its users look (adamw): `Client.status().rounds`, the `rounds`
line of `gemps status` and the /metrics families, on a real server, against the commits made; and
none of them under a rule whose every commit moves θ."""

from __future__ import annotations

import re

import numpy as np
import pytest
from gemps_cli.main import main as gemps_main

import gemps
from gemps_proto.status import Rounds
from tests.helpers import scrape
from tests.integration.commit_threads import commit_together
from tests.integration.conftest import StartServer

P = 64


def shown(target: str, capsys: pytest.CaptureFixture[str]) -> str:
    assert gemps_main(["status", "--server", target]) == 0
    return capsys.readouterr().out


def test_status_and_metrics_say_the_rounds_closed_and_the_open_one(
    start_server: StartServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two workers, K 2, five rounds; a third registers: K 3, nothing held."""
    server = start_server(rule="adamw")
    gradient = np.ones(P, np.float32)
    clients = {name: gemps.Client(server.target, name=name) for name in "ab"}
    try:
        for client in clients.values():
            client.register({"w": np.zeros(P, np.float32)})
        pending = commit_together(clients, gradient, 5)
        assert sorted(pending["a"] + pending["b"]) == [0] * 5 + [1] * 5  # every round closed at its second
        with gemps.Client(server.target, name="c") as third:
            third.register({"w": np.zeros(P, np.float32)})
            assert third.status().rounds == Rounds(closed=5, size=3, held=0)
            text = shown(server.target, capsys)
            metrics = scrape(f"http://127.0.0.1:{server.metrics_port}/metrics")
    finally:
        for client in clients.values():
            client.close()
    assert re.search(r"^rounds          5 closed, a step each; the open one holds 0 of 3 commits$", text, re.M), text
    assert (metrics["gemps_rounds_closed_total"], metrics["gemps_round_size"], metrics["gemps_round_held"]) == (
        5.0,
        3.0,
        0.0,
    )


def test_a_gradient_after_its_round_closed_is_said_dropped_in_the_status(
    start_server: StartServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--backup-workers 1` with two workers: K 1, so one worker's commit closes each round, and a
    commit taken on the θ before it is dropped: the rounds line says what share of the commits was."""
    server = start_server(rule="adamw", backup_workers=1)
    with gemps.Client(server.target, name="a") as a, gemps.Client(server.target, name="b") as b:
        for client in (a, b):
            client.register({"w": np.zeros(P, np.float32)})
        a.commit(np.ones(P, np.float32))  # closes round 1 (K 1): b holds the θ before it
        dropped = b.commit(np.ones(P, np.float32))
        assert dropped.scaling_mean == 0.0
        text = shown(server.target, capsys)
    assert re.search(
        r"^rounds          1 closed, a step each; the open one holds 0 of 1 commits; 50% of the commits of the last "
        r"\S+ came after their round closed and were dropped \(a backup's place\)$",
        text,
        re.M,
    ), text


def test_a_rule_whose_every_commit_moves_theta_shows_no_rounds(
    start_server: StartServer, capsys: pytest.CaptureFixture[str]
) -> None:
    server = start_server(rule="gem")
    with gemps.Client(server.target) as client:
        client.register({"w": np.zeros(P, np.float32)})
        client.commit(np.ones(P, np.float32))
        assert client.status().rounds is None
        text = shown(server.target, capsys)
        metrics = scrape(f"http://127.0.0.1:{server.metrics_port}/metrics")
    assert "rounds " not in text and not any(name.startswith("gemps_round") for name in metrics)
