"""The loop each replica runs against its election (election.py): renew while primary, else
watch who is primary and campaign when nobody is."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from gemps_server.replication.election import Election, Member
from gemps_server.replication.epoch_record import EpochRecordError
from gemps_server.replication.etcd_client import CoordinationUnavailable

log = logging.getLogger("gemps.server")


class Coordinator:
    """The loop a replica runs in a daemon thread, every `interval` (default lease_seconds / 4):

    - primary: renew; when that fails for good (or holds() turns False) call on_demoted once; when
      `revoked()` says why (--tls-crl lists its certificate), resign, then on_demoted;
    - otherwise: read who is primary and report changes through on_primary(member, epoch) (None
      and 0 when there is none; the epoch recorded on disk first: epoch_record.py); when there is
      none, campaign, and on a win call on_promoted(epoch).

    etcd unreachable: it keeps looping, logging once per outage. Nothing raises out of the thread.
    """

    def __init__(
        self,
        election: Election,
        on_promoted: Callable[[int], None],
        on_demoted: Callable[[], None],
        on_primary: Callable[[Member | None, int], None],
        interval: float | None = None,
        unfit: Callable[[], str] = lambda: "",
        revoked: Callable[[], str] = lambda: "",
    ) -> None:
        self.election = election
        self.unfit = unfit  # why this replica must not campaign now ('' when it may)
        self.revoked = revoked  # why this replica, primary, must step down now ('' when it need not)
        self._unfit_said = ""
        self.on_promoted = on_promoted
        self.on_demoted = on_demoted
        self.on_primary = on_primary
        self.interval = election.lease_seconds / 4 if interval is None else interval
        self._epoch: int | None = None  # promoted and not yet demoted
        self._reported: tuple[Member | None, int] | None = None  # the last on_primary call
        self._outage = False
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def epoch(self) -> int | None:
        """The epoch this replica was promoted to and still holds (None: not primary)."""
        return self._epoch

    def step(self) -> None:
        """One tick, synchronously."""
        try:
            if self._epoch is not None:
                self._keep()
            else:
                self._follow_or_campaign()
            self.election.announce()
        except CoordinationUnavailable as error:
            if not self._outage:
                log.warning("%s: etcd unavailable: %s", self.election.me.name, error)
                self._outage = True
            if self._epoch is not None and not self.election.holds():
                self._demote()
            return
        if self._outage:
            log.info("%s: etcd reachable again", self.election.me.name)
            self._outage = False

    def _keep(self) -> None:
        revoked = self.revoked()
        if revoked:  # every backup refuses it now: one they accept is to lead (it does not campaign)
            log.error("%s steps down as its partition's primary: %s", self.election.me.name, revoked)
            self.election.resign()  # holds() turns False at once, if etcd cannot be told
            self._demote()
            return
        renewed = self.election.renew()
        # not renewed, or the epoch lost elsewhere (a fenced in-sync write, a resign)
        if not renewed or not self.election.holds() or self.election.epoch != self._epoch:
            self._demote()

    def _follow_or_campaign(self) -> None:
        current = self.election.primary()
        self._report(current or (None, 0))
        if current is None:
            why = self.unfit()
            if why != self._unfit_said:  # said once per reason, not at every tick
                self._unfit_said = why
                if why:
                    log.error("%s does not campaign to lead its partition: %s", self.election.me.name, why)
            if why:
                return
            epoch = self.election.campaign()
            if epoch is not None:
                self._epoch = epoch
                self._reported = (self.election.me, epoch)  # no on_primary for itself: on_promoted says it
                self.on_promoted(epoch)

    def _report(self, current: tuple[Member | None, int]) -> None:
        if current != self._reported:
            try:
                self.election.saw(current[1])  # on disk before this replica follows the epoch
            except EpochRecordError as error:
                log.error("%s: does not follow epoch %d: %s", self.election.me.name, current[1], error)
                return
            self._reported = current
            self.on_primary(*current)

    def _demote(self) -> None:
        self._epoch = None
        self.on_demoted()

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the coordinator is already started")
        self._thread = threading.Thread(target=self._run, name=f"coordinator-{self.election.me.name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping.is_set():
            started = time.monotonic()
            try:
                self.step()
            except Exception:  # a callback's bug: the replica must keep its election going
                log.exception("%s: coordinator step failed", self.election.me.name)
            self._stopping.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def stop(self, resign: bool = True) -> None:
        """Stop the loop; when primary and `resign`, step down so a backup takes over at once.
        on_demoted is not called: the caller is the one stopping."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if resign and self._epoch is not None:
            try:
                self.election.resign()
            except CoordinationUnavailable as error:
                log.warning("%s: could not resign (the lease runs out instead): %s", self.election.me.name, error)
        self.election.withdraw()
        self._epoch = None
