"""How the driver of a Ray job asks its actors: waiting, with a deadline (`get_within`,
`answers`), or without waiting (`Looks`), so that one actor restarting on another node never
holds up the driver's loop."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import ray
import ray.exceptions

from gemps_worker.on_ray.faults import JobFailed, why

log = logging.getLogger("gemps.ray")


def alive_nodes() -> list[dict[str, Any]]:
    return [node for node in ray.nodes() if node.get("Alive")]


def get_within(calls: list[Any], timeout: float) -> list[Any]:
    """Every call's result; JobFailed when one failed or they did not answer within `timeout`."""
    try:
        return list(ray.get(calls, timeout=timeout))
    except ray.exceptions.GetTimeoutError:
        raise JobFailed(f"no answer from the actors within {timeout:g}s") from None
    except ray.exceptions.RayError as error:
        raise JobFailed(str(error)) from error


def answers(calls: list[Any], timeout: float) -> list[Any]:
    """Each call's result, or None where it failed or did not answer within `timeout`."""
    ready, _ = ray.wait(calls, num_returns=len(calls), timeout=timeout)
    answered = set(ready)
    results: list[Any] = []
    for call in calls:
        try:
            results.append(ray.get(call) if call in answered else None)
        except ray.exceptions.RayError:
            results.append(None)
    return results


class Looks:
    """Questions the driver asks again and again without waiting for the answers."""

    def __init__(self) -> None:
        self._asked: dict[str, Any] = {}  # key -> the call not yet answered
        self._errors: dict[str, ray.exceptions.RayError] = {}  # key -> how its last failed question failed

    def look(self, key: str, ask: Callable[[], Any]) -> Any:
        """The answer of the last `ask()` made under `key` if it has come (then the next look
        asks again), else None; one question at a time per key. A failure (the actor gone for
        good, or not answering while it restarts) is logged once, and kept until an answer."""
        call = self._asked.get(key)
        if call is None:
            call = self._asked[key] = ask()
        ready, _ = ray.wait([call], timeout=0)
        if not ready:
            return None
        del self._asked[key]
        try:
            answer = ray.get(call)
        except ray.exceptions.RayError as error:
            if key not in self._errors:
                log.warning("no answer from %s: %s", key, why(error))
            self._errors[key] = error
            return None
        self._errors.pop(key, None)
        return answer

    def error(self, key: str) -> ray.exceptions.RayError | None:
        """How the last question under `key` failed (None: it was answered, or is not yet)."""
        return self._errors.get(key)
