"""A state's images: what checkpoints and replicas carry of a ServerState, taken and installed here.

One image is taken (`take`, on the applier, a copy consistent at one version); a checkpoint is
that image without what lives only as long as the workers' registrations (`checkpoint`: no
workers, no per-worker rule state, no noise estimate, no bound on θ; see DESIGN: workers
register again after a restart, with fresh per-worker state), and a backup is seeded with all of
it. Installing differs by what the image is for: `restore` serves a checkpoint's central
variable in a server not serving yet (a rule state that does not fit is a warning: the training
goes on without it), `adopt` replaces a backup's whole state by its primary's (anything that
does not fit is a ValueError, with nothing changed: a backup that cannot take over must not
pretend it can). A concern every image carries is added here, beside StateImage's field and
the codecs.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from gemps_proto.jobs import new_job
from gemps_proto.schema import Buffers
from gemps_server.domain import validation
from gemps_server.domain.errors import ServiceError
from gemps_server.domain.ledger import LEGACY_SCOPE, CommitLedger, LedgerImage, Receipt, receipt_key
from gemps_server.domain.noise import NoiseEstimator
from gemps_server.domain.records import Held, StateImage
from gemps_server.domain.replica_image import ReplicaImage
from gemps_server.domain.rules import CommitRule
from gemps_server.domain.state import ServerState


def take(state: ServerState, *, workers: bool = True) -> ReplicaImage:
    """Everything `state` holds at this version (run on the applier: a copy, so later operations
    leave it as it is). `workers` False: without the registered workers and what is theirs
    (their rule state, the noise estimate, the bound on θ), which a checkpoint does not keep and
    whose copy would cost the applier (per-worker state is P-sized per worker)."""
    rule = state.core.rule
    if rule is None:
        return ReplicaImage(state.history, state.partition)
    central = StateImage(
        version=state.core.version,
        commits_applied=state.core.commits_applied,
        spec=state.spec,
        theta=state.core.theta_copy(),
        rule=state.rule_name,
        rule_state=rule.global_state(workers=workers),
        buffer_spec=state.core.buffer_spec,
        buffers=state.core.buffers,  # never changed in place: no copy needed
        partition=state.partition,
        job=state.job,
    )
    if not workers:
        return ReplicaImage(state.history, state.partition, central, ledger=state.core.ledger.export())
    registry = state.registry.export()
    per_worker = {worker.worker_id: rule.worker_state(worker.worker_id) for worker in registry.workers}
    return ReplicaImage(
        history=state.history,
        partition=state.partition,
        state=central,
        workers=registry,
        worker_rule_state={worker_id: held for worker_id, held in per_worker.items() if held},
        ledger=state.core.ledger.export(),
        noise=state.core.noise.export(),
        theta_bound=state.theta_bound(),
    )


def checkpoint(state: ServerState) -> StateImage:
    """Everything a restarted server needs, consistent at one version (run on the applier: the
    rule's global state and the ledger change with every commit): `take`'s image without the
    workers, its ledger's receipts by receipt_key. FailedPrecondition while θ is not initialised."""
    state.require_initialized()
    image = take(state, workers=False)
    assert image.state is not None  # initialised: checked above
    return dataclasses.replace(image.state, receipts=_receipts(image.ledger))


def restore(state: ServerState, image: StateImage) -> list[str]:
    """Serve `image`'s central variable (before any worker registers); returns warnings.

    Workers are not restored: they register again, with fresh per-worker rule state.
    """
    if state.core.rule is not None:
        raise RuntimeError("restore() needs a server that is not initialised yet")
    if image.partition != state.partition:
        raise ValueError(f"the checkpoint holds {image.partition}; this server serves {state.partition}")
    warnings = []
    theta, buffers, rule = _central(state, image)
    if image.rule_state:
        if image.rule == state.rule_name:
            try:
                rule.load_global_state(dict(image.rule_state))
            except ValueError as error:
                warnings.append(f"rule state not restored: {error}")
        else:
            warnings.append(f"rule state of {image.rule!r} not restored into rule {state.rule_name!r}")
    state.core.ledger.restore(dict(image.receipts))  # the ledger of a server not initialised: empty
    if not image.job:  # a checkpoint from before jobs: this θ is a job of its own from now on
        image = dataclasses.replace(image, job=new_job())
    state.install(_held(image, theta, buffers, rule, state.core.ledger, state.core.noise, state.history))
    return warnings


def adopt(state: ServerState, image: ReplicaImage) -> None:
    """Replace everything `state` holds, initialised or not, by `image` (on a backup, as its
    primary seeds it; run on the applier); the rule is rebuilt with this server's training
    config and kernel. A ValueError naming the problem, with nothing changed, when the image
    is not this partition's, of another rule, or does not fit this server."""
    if image.partition != state.partition:
        raise ValueError(f"the image holds {image.partition}; this server serves {state.partition}")
    state.registry.check(image.workers)
    ledger = CommitLedger(capacity=state.registry.max_workers)
    noise = state.new_noise()
    central = image.state
    if central is None:
        empty = StateImage(0, 0, (), np.empty(0, dtype=np.float32), partition=state.partition)
        held = _held(empty, empty.theta, empty.buffers, None, ledger, noise, image.history)
    else:
        if central.rule != state.rule_name:
            raise ValueError(f"the image holds rule {central.rule!r}'s state; this server runs {state.rule_name!r}")
        try:
            validation.check_spec(central.spec, central.buffer_spec)
            validation.check_size(central.spec, central.buffer_spec, state.partition, state.max_parameters)
        except ServiceError as error:
            raise ValueError(f"the image's model does not fit this server: {error.message}") from None
        theta, buffers, rule = _central(state, central)
        rule.load_global_state(dict(central.rule_state))
        for worker in image.workers.workers:
            rule.add_worker(worker.worker_id, theta)
            rule.load_worker_state(worker.worker_id, dict(image.worker_rule_state.get(worker.worker_id, {})))
        if image.theta_bound is not None:
            rule.load_theta_bound(theta, image.theta_bound)
        if image.noise is not None:
            noise.adopt(image.noise, theta.size)
        held = _held(central, theta, buffers, rule, ledger, noise, image.history)
    ledger.adopt(image.ledger)
    state.registry.adopt(image.workers)  # checked above: nothing fails from here on
    state.install(held)


def _central(state: ServerState, image: StateImage) -> tuple[np.ndarray, Buffers, CommitRule]:
    """Copies of `image`'s θ and buffers, and a fresh rule of `state`'s for that θ (no state loaded)."""
    theta = np.array(image.theta, dtype=np.float32, copy=True).reshape(-1)
    buffers = Buffers(
        np.array(image.buffers.floats, dtype=np.float32, copy=True).reshape(-1),
        np.array(image.buffers.integers, dtype=np.int64, copy=True).reshape(-1),
    )
    return theta, buffers, state.new_rule(theta.size)


def _held(
    image: StateImage,
    theta: np.ndarray,
    buffers: Buffers,
    rule: CommitRule | None,
    ledger: CommitLedger,
    noise: NoiseEstimator,
    history: str,
) -> Held:
    """What a state holds once it installed `image` (θ and buffers: copies of `image`'s)."""
    bounds = image.partition.bounds(image.total_parameters) if rule is not None else (0, 0)
    return Held(
        rule=rule,
        theta=theta,
        spec=tuple(image.spec),
        buffer_spec=tuple(image.buffer_spec),
        buffers=buffers,
        version=image.version,
        commits_applied=image.commits_applied,
        bounds=bounds,
        ledger=ledger,
        noise=noise,
        history=history,
        job=image.job,
    )


def _receipts(ledger: LedgerImage) -> dict[str, Receipt]:
    """A ledger's receipts by receipt_key, as CommitLedger.entries gives them (old checkpoints' first)."""
    found = {receipt_key(LEGACY_SCOPE, request_id): receipt for request_id, receipt in ledger.legacy}
    found.update({receipt_key(scope, request_id): receipt for scope, request_id, receipt in ledger.last})
    return found
