"""A job's identity in the domain (issue 77, item 1; DESIGN §3d, "One job, one θ"): fixed when θ is
initialised, refused to another job's clients before anything changes, and carried by every copy
of θ there is: the journal a backup replays, the image it is seeded with, the checkpoint a server
restarts from (one from before jobs becomes a job of its own)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gemps_proto.jobs import valid_job
from gemps_proto.reasons import Reason
from gemps_server import snapshot_codec
from gemps_server.domain import images
from gemps_server.domain.errors import FailedPrecondition, InvalidArgument
from gemps_server.replication import entries, image_codec
from tests.helpers import encoded
from tests.unit.test_journal_replay import SPEC, Clock, ListJournal, new_state, replay_all

P = SPEC[0].size


def test_the_first_registration_names_the_job_and_another_jobs_client_is_refused_untouched() -> None:
    state = new_state("downpour", Clock())
    first = state.register("a", SPEC, encoded(np.ones(P, np.float32)), client_id="ca")
    assert valid_job(state.job)
    with pytest.raises(FailedPrecondition) as refused:
        state.register("b", SPEC, None, client_id="cb", job="someone-elses")
    assert refused.value.reason == Reason.OTHER_JOB
    with pytest.raises(InvalidArgument) as malformed:
        state.register("b", SPEC, None, client_id="cb", job="x" * 65)
    assert malformed.value.reason == Reason.BAD_JOB
    assert list(state.registry._workers) == [first.worker.worker_id]
    assert state.register("b", SPEC, None, client_id="cb", job=state.job).worker.worker_id in state.registry


def test_a_server_initialised_by_a_client_of_a_job_takes_that_job() -> None:
    state = new_state("downpour", Clock())
    state.register("a", SPEC, encoded(np.zeros(P, np.float32)), job="ours")
    assert state.job == "ours"


def test_a_backup_replaying_the_journal_and_one_seeded_with_an_image_hold_the_primarys_job() -> None:
    primary, replayed, seeded = (new_state("gem", Clock()) for _ in range(3))
    journal = ListJournal()
    primary.core.journal = journal
    primary.register("a", SPEC, encoded(np.zeros(P, np.float32)))
    replay_all(primary, replayed, journal)
    images.adopt(seeded, image_codec.decode(image_codec.encode(images.take(primary))))
    assert primary.job == replayed.job == seeded.job != ""


def test_a_checkpoint_keeps_the_job_and_one_from_before_jobs_becomes_a_job_of_its_own() -> None:
    state = new_state("downpour", Clock())
    state.register("a", SPEC, encoded(np.zeros(P, np.float32)), job="ours")
    tensors, metadata = snapshot_codec.state_parts(images.checkpoint(state))
    assert metadata["job"] == "ours"
    restored = new_state("downpour", Clock())
    images.restore(restored, snapshot_codec.take_state(metadata, dict(tensors)))
    assert restored.job == "ours"
    older = {key: value for key, value in metadata.items() if key != "job"}
    legacy = new_state("downpour", Clock())
    images.restore(legacy, snapshot_codec.take_state(older, dict(tensors)))
    assert valid_job(legacy.job) and legacy.job != "ours"
    with pytest.raises(snapshot_codec.SnapshotError, match="bad job"):
        snapshot_codec.take_state({**metadata, "job": "../etc"}, dict(tensors))


def test_a_journal_entry_naming_no_job_identity_is_refused() -> None:
    state = new_state("downpour", Clock())
    journal = ListJournal()
    state.core.journal = journal
    state.register("a", SPEC, encoded(np.zeros(P, np.float32)))
    frame = journal.frames[0]
    joined = {**frame.header["joined"], "job": "a job"}
    broken = dataclasses.replace(frame, header={**frame.header, "joined": joined})
    with pytest.raises(entries.BadEntry, match="bad job"):
        entries.decode(broken)
