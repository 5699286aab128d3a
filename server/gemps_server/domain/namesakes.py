"""Names that more than one live process registers under, found out when one of them comes back.

A process started again registers under its dead one's name, and a registration of that name
silent past its pace is taken for the dead one and superseded (workers.py). Before its pace shows
(fewer than two requests since it registered: killed in its set-up or at its first step, as an
out-of-memory kill ends a big model's worker) a silence of SUPERSEDED_FLOOR_SECONDS is enough,
since only a process of the same name can supersede it and a name is one process's. When a client
superseded so registers again it was alive: its name is shared by live processes (the same
`--name` given to several workers). From then on a registration of that name whose pace is not
known waits out the lease again, and the registration that found it out says so (a WARNING), so a
shared name costs one refused request per process at most, once.

Kept by the server that decides (a lone server, a primary); bounded: the last REMEMBERED
superseded clients and shared names. A new primary starts with none, as it starts without paces.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TypeVar

#: superseded clients, and shared names, remembered at most
REMEMBERED = 1024

Value = TypeVar("Value")


class SharedNames:
    """The clients superseded under their name, and the names found shared by live processes."""

    def __init__(self, remembered: int = REMEMBERED) -> None:
        self._remembered = remembered
        self._superseded: OrderedDict[str, str] = OrderedDict()  # client id -> the name it was superseded under
        self._shared: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, name: object) -> bool:
        return name in self._shared

    def superseded(self, client_id: str, name: str) -> None:
        """`client_id`'s registration under `name` was superseded (taken for a dead process's)."""
        if client_id and name:
            self._superseded[client_id] = name
            self._superseded.move_to_end(client_id)
            _bound(self._superseded, self._remembered)

    def returned(self, client_id: str) -> str:
        """The name `client_id` was superseded under, now found shared, when it registers again
        (else ""): it was alive, so another live process registers under that name too."""
        name = self._superseded.pop(client_id, "") if client_id else ""
        if name and name not in self._shared:
            self._shared[name] = None
            _bound(self._shared, self._remembered)
            return name
        return ""


def _bound(remembered: OrderedDict[str, Value], most: int) -> None:
    while len(remembered) > most:
        remembered.popitem(last=False)
