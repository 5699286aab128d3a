"""gemps.pytorch.overlap.InFlightCommitError: an overlapped commit's failure, named by its step,
still of the failure's class and with its attributes (issue 77, item 3)."""

from __future__ import annotations

import numpy as np

import gemps
from gemps.errors import PartiallyAppliedError
from gemps.pytorch import InFlightCommitError
from gemps.records import CentralVariable


def test_a_partial_refusal_in_flight_keeps_its_class_and_what_the_partitions_did() -> None:
    central = CentralVariable(7, np.zeros(3, np.float32), ())
    refusal = gemps.InvalidArgumentError("payload contains NaN or Inf", reason=gemps.Reason.NON_FINITE)
    partial = PartiallyAppliedError.of(refusal, [0], [1], central)
    error = InFlightCommitError.of(partial, 4, 3, (5, 4))
    assert isinstance(error, gemps.InvalidArgumentError) and isinstance(error, PartiallyAppliedError)
    assert (error.applied, error.refused) == ((0,), (1,)) and error.central is central
    assert (error.code, error.reason) == (refusal.code, gemps.Reason.NON_FINITE)
    assert (error.step, error.base_version, error.sent_step, error.sent_base_version) == (4, 3, 5, 4)
    assert str(error) == (
        "step 4's commit (its gradients computed at version 3) failed: commit applied by partition 0 of 2 and "
        "refused by partition 1: payload contains NaN or Inf; step 5's gradients (computed at version 4) were sent "
        "after it all the same"
    )
    assert type(InFlightCommitError.of(partial, 6, 5)) is type(error)  # one class per failure's class


def test_raised_where_no_later_step_was_gathered_it_says_so() -> None:
    error = InFlightCommitError.of(gemps.ServerUnavailableError("UNAVAILABLE: gone"), 2, 1)
    assert isinstance(error, gemps.ServerUnavailableError) and error.sent_step is None
    assert str(error).endswith("failed: UNAVAILABLE: gone; no later step's gradients were sent")
