"""Checkpoint files, the commit ledger (deduplication), restore into the state, and the small
security pieces (token check, rate limit, exposure warnings) without a network."""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy

from gemps_proto.schema import ParameterSpec, PayloadKind
from gemps_proto.tensor_codec import EncodedTensor
from gemps_server import checkpoint_files as checkpoints
from gemps_server.checkpoint_files import (
    Checkpoint,
    CheckpointError,
    checkpoint_path,
    export_state_dict,
    list_checkpoints,
    load,
    load_latest,
    prune,
    remove_temporaries,
    save,
)
from gemps_server.domain import images
from gemps_server.domain.errors import InvalidArgument
from gemps_server.domain.ledger import LEGACY_SCOPE, CommitLedger, Receipt, receipt_key
from gemps_server.domain.records import Commit, StateImage
from gemps_server.domain.rules import ApplyStats
from gemps_server.domain.state import ServerState
from gemps_server.domain.workers import WorkerRegistry
from gemps_server.security import BearerToken, RateLimiter, exposure_warnings, is_loopback
from tests.helpers import encoded, server_config, training

SPEC = (ParameterSpec("layer.weight", (2, 3)), ParameterSpec("layer.bias", (2,)))
STATS = ApplyStats(0.5, 0.25, 0.1, 0.2)


def make_checkpoint(version: int = 7, **overrides: Any) -> Checkpoint:
    fields: dict[str, Any] = {
        "version": version,
        "commits_applied": version,
        "spec": SPEC,
        "theta": np.arange(8, dtype=np.float32) * 0.5,
        "rule": "gem",
        "receipts": {receipt_key("client-1", "req-a"): Receipt(version, 2, STATS)},
    }
    fields.update(overrides)
    return Checkpoint(StateImage(**fields), config={"rule": "gem", "learning_rate": 0.05})


def test_round_trip_keeps_everything(tmp_path: Path) -> None:
    original = make_checkpoint(rule_state={"velocity": np.full(8, 0.125, np.float32)})
    path, size = save(tmp_path, original)
    assert path == checkpoint_path(tmp_path, 7) and path.stat().st_size == size
    restored = load(path)
    np.testing.assert_array_equal(restored.image.theta, original.image.theta)
    np.testing.assert_array_equal(restored.image.rule_state["velocity"], original.image.rule_state["velocity"])
    assert (restored.version, restored.image.commits_applied, restored.image.spec) == (7, 7, SPEC)
    assert restored.config == original.config
    assert restored.image.receipts == {receipt_key("client-1", "req-a"): Receipt(7, 2, STATS)}
    assert restored.named()["layer.weight"].shape == (2, 3)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left behind


def test_the_file_is_plain_safetensors_not_pickle(tmp_path: Path) -> None:
    path, _ = save(tmp_path, make_checkpoint())
    raw = path.read_bytes()
    (header_length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + header_length])
    assert header["central_variable"]["dtype"] == "F32" and header["__metadata__"]["format"] == "gemps-checkpoint"
    assert raw[:1] != b"\x80"  # a pickle stream starts with the PROTO opcode
    assert safetensors.numpy.load_file(str(path))["central_variable"].shape == (8,)


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda raw: raw[:-5], "not a readable safetensors file"),
        (lambda raw: b"garbage", "not a readable safetensors file"),
        (lambda raw: raw[:-4] + b"\x00\x00\x80\x7f", "CRC-32"),  # last float flipped to +Inf
    ],
    ids=["truncated", "garbage", "bit-flip"],
)
def test_damaged_files_are_refused(tmp_path: Path, damage: object, message: str) -> None:
    path, _ = save(tmp_path, make_checkpoint())
    path.write_bytes(damage(path.read_bytes()))  # type: ignore[operator]
    with pytest.raises(CheckpointError, match=message):
        load(path)


def rewrite(path: Path, metadata: dict[str, str], tensors: dict[str, np.ndarray] | None = None) -> None:
    safetensors.numpy.save_file(tensors or safetensors.numpy.load_file(str(path)), str(path), metadata=metadata)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"format": "other"}, "not a gemps checkpoint"),
        ({"format_version": "99"}, "unsupported checkpoint format version"),
        ({"spec": json.dumps([{"name": "w", "shape": [3]}])}, "spec describes 3"),
        ({"spec": "not json"}, "malformed metadata"),
        ({"version": "-1"}, "negative version"),
        ({"client_receipts": json.dumps({"c\nr": [1, 2]})}, "malformed metadata"),
        ({"client_receipts": json.dumps({"r": [1, 0, 1, 1, 0, 0]})}, "names no client"),
        ({"client_receipts": json.dumps({"a b\nr": [1, 0, 1, 1, 0, 0]})}, "bad client"),
        # Crafted: metadata is outside the CRC, so whatever it says must raise CheckpointError (the
        # server falls back to an older file) and never restore values Status could not send.
        ({"spec": "[" * 100_000 + "]" * 100_000}, "nested too deeply"),
        ({"client_receipts": '{"c\\nr": [Infinity, 0, 1, 1, 0, 0]}'}, "Infinity in metadata"),
        ({"client_receipts": '{"c\\nr": [NaN, 0, 1, 1, 0, 0]}'}, "NaN in metadata"),
        ({"client_receipts": '{"c\\nr": [true, 0, 1, 1, 0, 0]}'}, "not numbers"),
        ({"client_receipts": json.dumps({"c\nr": [2**64, 0, 1, 1, 0, 0]})}, "impossible version"),
        ({"version": str(2**64)}, "outside 0.."),
        ({"commits_applied": str(2**70)}, "outside 0.."),
        ({"spec": json.dumps([{"name": "w", "shape": [True, 8]}])}, "bad shape"),
        ({"config": '{"a": ' * 50_000 + "1" + "}" * 50_000}, "nested too deeply"),
        ({"epoch": "-3"}, "outside 0.."),
        ({"epoch": "two"}, "malformed metadata"),
    ],
)
def test_inconsistent_metadata_is_refused(tmp_path: Path, change: dict[str, str], message: str) -> None:
    path, _ = save(tmp_path, make_checkpoint())
    with safetensors.safe_open(str(path), framework="numpy") as f:
        metadata = dict(f.metadata())
    rewrite(path, {**metadata, **change})
    with pytest.raises(CheckpointError, match=message):
        load(path)


def test_a_replicas_checkpoint_keeps_its_epoch_and_one_written_before_epochs_reads_0(tmp_path: Path) -> None:
    path, _ = save(tmp_path, dataclasses.replace(make_checkpoint(), epoch=41))
    assert load(path).epoch == 41
    with safetensors.safe_open(str(path), framework="numpy") as f:
        metadata = dict(f.metadata())
    del metadata["epoch"]
    rewrite(path, metadata)
    assert load(path).epoch == 0


def test_a_file_whose_name_disagrees_with_its_metadata_is_not_restored(tmp_path: Path) -> None:
    save(tmp_path, make_checkpoint(5))
    old, _ = save(tmp_path, make_checkpoint(3))
    renamed = checkpoint_path(tmp_path, 9)
    old.rename(renamed)  # an old file under a newer name would sort first
    with pytest.raises(CheckpointError, match="its name says version 9, its metadata 3"):
        load(renamed)
    found = load_latest(tmp_path)
    assert found is not None and found[1].version == 5


def test_non_finite_values_are_refused(tmp_path: Path) -> None:
    theta = np.arange(8, dtype=np.float32)
    theta[3] = np.nan
    with pytest.raises(CheckpointError, match="NaN or Inf"):  # never written ...
        save(tmp_path, make_checkpoint(theta=theta))
    assert list(tmp_path.iterdir()) == []
    path, _ = save(tmp_path, make_checkpoint())  # ... nor loaded, with a CRC that matches
    with safetensors.safe_open(str(path), framework="numpy") as f:
        metadata = dict(f.metadata())
    tensors = {"central_variable": theta}
    rewrite(path, {**metadata, "crc32": checkpoints.crc32_of(tensors)}, tensors)
    with pytest.raises(CheckpointError, match="NaN or Inf"):
        load(path)


def test_latest_skips_and_quarantines_damaged_checkpoints(tmp_path: Path) -> None:
    for version in (3, 5, 9):
        save(tmp_path, make_checkpoint(version))
    newest = checkpoint_path(tmp_path, 9)
    newest.write_bytes(newest.read_bytes()[:100])
    seen: list[Path] = []
    found = load_latest(tmp_path, on_corrupt=lambda path, error: seen.append(path))
    assert found is not None and found[1].version == 5
    assert seen == [newest]
    assert [v for v, _ in list_checkpoints(tmp_path)] == [3, 5]
    assert (tmp_path / (newest.name + ".corrupt")).exists()
    assert load_latest(tmp_path / "missing") is None


def test_prune_keeps_the_newest(tmp_path: Path) -> None:
    for version in (1, 2, 10, 11):  # numeric, not lexical, order
        save(tmp_path, make_checkpoint(version))
    removed = prune(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == [checkpoint_path(tmp_path, v).name for v in (1, 2)]
    assert [v for v, _ in list_checkpoints(tmp_path)] == [10, 11]


def test_a_crash_before_the_rename_leaves_the_previous_checkpoint(tmp_path: Path, monkeypatch: object) -> None:
    save(tmp_path, make_checkpoint(4))

    def crash(src: object, dst: object) -> None:
        raise KeyboardInterrupt("simulated crash between write and rename")

    monkeypatch.setattr(os, "replace", crash)  # type: ignore[attr-defined]
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path, make_checkpoint(8))
    monkeypatch.undo()  # type: ignore[attr-defined]
    assert [v for v, _ in list_checkpoints(tmp_path)] == [4]
    found = load_latest(tmp_path)
    assert found is not None and found[1].version == 4
    # A real crash (SIGKILL) leaves the temporary itself: start-up removes it.
    (tmp_path / ".checkpoint-abc.tmp").write_bytes(b"partial")
    assert [p.name for p in remove_temporaries(tmp_path)] == [".checkpoint-abc.tmp"]


def test_export_is_a_state_dict_by_parameter_name(tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    checkpoint = make_checkpoint()
    export_state_dict(checkpoint.named(), checkpoint.version, out)
    tensors = safetensors.numpy.load_file(str(out))
    assert {k: v.shape for k, v in tensors.items()} == {"layer.weight": (2, 3), "layer.bias": (2,)}
    np.testing.assert_array_equal(tensors["layer.bias"], [3.0, 3.5])


# -- the ledger -------------------------------------------------------------------------------


def test_ledger_keeps_each_clients_last_commit_and_a_bounded_tail_of_departed_ones() -> None:
    ledger = CommitLedger(capacity=2)
    ledger.record("c1", "a", Receipt(1, 0, STATS))
    ledger.record("c1", "b", Receipt(2, 0, STATS))
    assert ledger.lookup("c1", "a") is None and ledger.lookup("c1", "b") == Receipt(2, 0, STATS)
    assert ledger.lookup("c2", "b") is None  # request ids are per client
    ledger.record("c2", "", Receipt(3, 0, STATS))  # no id: nothing to remember
    assert len(ledger) == 1 and ledger.lookup("c2", "") is None
    for client, request in (("c1", "b"), ("c3", "c"), ("c4", "d")):
        ledger.record(client, request, Receipt(4, 0, STATS))
        ledger.depart(client)
    assert ledger.lookup("c1", "b") is None  # the oldest departed receipt went first
    assert ledger.lookup("c3", "c") is not None and ledger.lookup("c4", "d") is not None
    ledger.restore({receipt_key("c5", "e"): Receipt(9, 1, STATS)})
    assert ledger.lookup("c5", "e") == Receipt(9, 1, STATS) and ledger.lookup("c3", "c") is None
    # From a checkpoint written before clients had scopes: any client's retry matches.
    ledger.restore({receipt_key(LEGACY_SCOPE, "old"): Receipt(5, 0, STATS)})
    assert ledger.lookup("anyone", "old") == Receipt(5, 0, STATS)


def test_a_late_attempt_of_a_numbered_commit_is_superseded_whatever_order_it_arrives_in() -> None:
    """A commit numbered at or below the client's last applied one, under another request id, is an
    old attempt delivered late (issue 37, item 0): the request id alone no longer finds it."""
    ledger = CommitLedger(capacity=2)
    for sequence, request in enumerate("abc", start=1):
        assert ledger.lookup("c1", request) is None and ledger.superseded("c1", sequence) is None
        ledger.record("c1", request, Receipt(sequence, 0, STATS, sequence))
    assert ledger.lookup("c1", "a") is None  # a's receipt is gone: only the last is kept ...
    assert ledger.superseded("c1", 1) == 3 and ledger.superseded("c1", 3) == 3  # ... and yet refused
    assert ledger.superseded("c1", 4) is None and ledger.superseded("c2", 1) is None  # per client
    assert ledger.superseded("c1", 0) is None  # unnumbered: request ids alone, as before
    ledger.record("c1", "u", Receipt(4, 0, STATS))  # an unnumbered commit keeps the client's mark
    assert ledger.superseded("c1", 2) == 3
    ledger.depart("c1")  # a client between registrations still refuses its late attempts
    assert ledger.superseded("c1", 3) == 3
    restored = CommitLedger(capacity=2)
    restored.restore(ledger.entries())  # and so does a server restarted from a checkpoint
    assert restored.superseded("c1", 2) == 3 and restored.lookup("c1", "u") is not None


def test_receipts_reject_malformed_numbers() -> None:
    with pytest.raises(ValueError):
        Receipt.from_list([1.5, 0, 1, 1, 0, 0])
    with pytest.raises(ValueError):
        Receipt.from_list([1, 0, 1, 1, 0, 0, -2])  # a negative sequence
    assert Receipt.from_list(Receipt(3, 1, STATS, 12).to_list()) == Receipt(3, 1, STATS, 12)
    assert Receipt.from_list([3, 1, 0.5, 0.25, 0.1, 0.2]) == Receipt(3, 1, STATS)  # before numbering


# -- the state: deduplication and restore -------------------------------------------------------


def new_state(rule: str = "gem") -> ServerState:
    return ServerState(training(rule), WorkerRegistry(max_workers=8, lease_ttl=60))


def register(state: ServerState, client_id: str = "client-1") -> str:
    return state.register("w", SPEC, encoded(np.arange(8, dtype=np.float32)), client_id=client_id).worker.worker_id


def gradient(value: float = 1.0) -> EncodedTensor:
    return encoded(np.full(8, value, np.float32))


def test_a_retried_commit_is_applied_once() -> None:
    state = new_state()
    worker = register(state)
    first = state.core.commit_record(Commit(worker, 0, PayloadKind.GRADIENT, gradient(), request_id="r1"))
    theta = state.core.theta_copy()
    again = state.core.commit_record(Commit(worker, 0, PayloadKind.GRADIENT, gradient(), request_id="r1"))
    assert again.duplicate and not first.duplicate
    assert (again.snapshot.version, again.staleness, again.stats) == (1, first.staleness, first.stats)
    np.testing.assert_array_equal(state.core.theta_copy(), theta)
    assert state.core.commits_applied == 1
    # Even from a new registration of the same client (lease expired, server restarted).
    state.leave(worker)
    other = register(state)
    assert state.core.commit_record(Commit(other, 0, PayloadKind.GRADIENT, gradient(), request_id="r1")).duplicate
    assert not state.core.commit_record(Commit(other, 1, PayloadKind.GRADIENT, gradient(), request_id="r2")).duplicate
    with pytest.raises(InvalidArgument, match="request_id has 129 characters"):
        state.core.commit_record(Commit(other, 2, PayloadKind.GRADIENT, gradient(), request_id="x" * 129))


@pytest.mark.parametrize("rule", ["gem", "momentum"])
def test_restore_continues_exactly_where_the_checkpoint_was(rule: str) -> None:
    live = new_state(rule)
    worker = register(live)
    for version in range(3):
        live.core.commit_record(
            Commit(worker, version, PayloadKind.GRADIENT, gradient(version + 1.0), request_id=f"r{version}")
        )
    snapshot = images.checkpoint(live)
    restored = new_state(rule)
    assert images.restore(restored, snapshot) == []
    assert (restored.core.version, restored.core.commits_applied) == (3, 3)
    np.testing.assert_array_equal(restored.core.theta_copy(), live.core.theta_copy())
    again = register(restored)  # the same client, registered again
    assert restored.core.commit_record(Commit(again, 0, PayloadKind.GRADIENT, gradient(), request_id="r2")).duplicate
    # The same next commit moves both identically (GEM: a new worker's first commit in both).
    fresh = register(live)
    a = live.core.commit_record(Commit(fresh, 3, PayloadKind.GRADIENT, gradient(0.5), request_id="n"))
    b = restored.core.commit_record(Commit(again, 3, PayloadKind.GRADIENT, gradient(0.5), request_id="n"))
    assert a.snapshot == b.snapshot


def test_restore_into_another_rule_drops_the_rule_state_with_a_warning() -> None:
    live = new_state("momentum")
    register(live)
    warnings = images.restore(new_state("gem"), images.checkpoint(live))
    assert warnings and "not restored" in warnings[0]


# -- security pieces -------------------------------------------------------------------------------


def test_token_check() -> None:
    token = BearerToken("s3cret")
    assert token.authorized((("authorization", "Bearer s3cret"),))
    for metadata in (
        (),
        (("authorization", "Bearer s3cre"),),
        (("authorization", "bearer s3cret"),),
        (("authorization", "s3cret"),),
        (("authorization", "Bearer s3cret"), ("authorization", "Bearer s3cret")),
        (("x-token", "Bearer s3cret"),),
    ):
        assert not token.authorized(metadata), metadata


def test_rate_limiter_refills_over_time() -> None:
    now = [0.0]
    limiter = RateLimiter(3, period=60.0, clock=lambda: now[0])
    assert [limiter.allow() for _ in range(4)] == [True, True, True, False]
    now[0] = 20.0  # a third of the period: one token back
    assert [limiter.allow() for _ in range(2)] == [True, False]
    assert all(RateLimiter(0).allow() for _ in range(1000))  # 0: no limit


def test_exposure_warnings() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    assert exposure_warnings("127.0.0.1", tls=False, token=False) == []
    assert "NEITHER TLS NOR a token" in exposure_warnings("0.0.0.0", tls=False, token=False)[0]
    assert "clear text" in exposure_warnings("0.0.0.0", tls=False, token=True)[0]
    assert exposure_warnings("0.0.0.0", tls=True, token=True) == []


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"tls_cert": "/nonexistent.pem"}, "tls_cert and tls_key go together"),
        ({"tls_client_ca": "x"}, "needs tls_cert"),
        ({"auth_token": "has space"}, "auth_token must be printable ASCII"),
        ({"auth_token": "a", "auth_token_file": "b"}, "not both"),
        ({"checkpoint_keep": 0}, r"checkpoint_keep 0 is outside \[1, "),
        ({"auth_token_file": "/nonexistent/token"}, "is not a readable file"),
    ],
)
def test_invalid_security_and_checkpoint_options(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        server_config(**overrides)


def test_evaluation_dataset_labels_are_bounded() -> None:
    from prometheus_client import generate_latest

    from gemps_server.metrics import MAX_DATASET_LABELS, ServerMetrics

    metrics = ServerMetrics()
    for index in range(100):  # a hostile evaluator naming a new dataset every time
        metrics.evaluated(f"set-{index}", 1, 0.5, 0.5)
    text = generate_latest(metrics.registry).decode()
    labels = {line.split('dataset="')[1].split('"')[0] for line in text.splitlines() if "gemps_heldout_loss{" in line}
    assert len(labels) == MAX_DATASET_LABELS + 1 and "other" in labels


def test_client_connection_from_arguments_and_environment(tmp_path: Path) -> None:
    from gemps.channel_security import ChannelSecurity

    ca = tmp_path / "ca.pem"
    ca.write_bytes(b"-----BEGIN CERTIFICATE-----\n")
    assert ChannelSecurity.resolve(environ={}) == ChannelSecurity()
    env = {"GEMPS_AUTH_TOKEN": "t0k", "GEMPS_TLS_CA": str(ca)}
    resolved = ChannelSecurity.resolve(environ=env)
    assert (resolved.token, resolved.tls, resolved.ca_cert) == ("t0k", True, ca.read_bytes())
    assert resolved.metadata == (("authorization", "Bearer t0k"),)
    assert ChannelSecurity.resolve(token="arg", environ=env).token == "arg"  # an argument beats the environment
    assert not ChannelSecurity.resolve(tls=False, environ=env).tls  # plaintext asked for: env certificates ignored
    assert ChannelSecurity.resolve(environ={"GEMPS_TLS": "1"}) == ChannelSecurity(tls=True)  # system roots
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    assert ChannelSecurity.resolve(environ={"GEMPS_AUTH_TOKEN_FILE": str(token_file)}).token == "from-file"
    with pytest.raises(ValueError, match="go together"):
        ChannelSecurity.resolve(client_cert=b"cert", environ={})
    with pytest.raises(ValueError, match="tls=False"):
        ChannelSecurity.resolve(tls=False, ca_cert=str(ca), environ={})
