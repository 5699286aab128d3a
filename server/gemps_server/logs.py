"""Structured logs: one line per significant event, as text (`key=value`) or as JSON.

`event(log, "worker joined", worker_id=..., active=3)` writes one record whose message is the
event name followed by its fields in logfmt style (`worker joined worker_id=ab12 active=3`), so
any formatter shows them; the JSON formatter instead writes one object per line with the event
name and every field as its own key (`{"time": ..., "level": "info", "logger": "gemps.server",
"event": "worker joined", "worker_id": "ab12", "active": 3, "message": ...}`), ready for a log
collector. `configure(level, fmt)` installs the chosen formatter on the root logger.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable, Hashable
from datetime import datetime, timezone
from typing import IO, Any

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Keys every JSON line has; an event field with one of these names is written as `field_<name>`.
RESERVED_KEYS = frozenset({"time", "level", "logger", "event", "message", "exception"})
_EVENT_ATTR = "gemps_event"
_FIELDS_ATTR = "gemps_fields"

FieldValue = str | int | float | bool | None


# The most characters of one field a log line keeps (a refusal can quote megabytes of request).
MAX_FIELD_CHARS = 1000


def _clipped(text: str) -> str:
    if len(text) <= MAX_FIELD_CHARS:
        return text
    return f"{text[:MAX_FIELD_CHARS]}... ({len(text) - MAX_FIELD_CHARS} more characters)"


def _text_value(value: FieldValue) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.6g}"
    text = _clipped(str(value))
    # Quoted and escaped (ASCII only) whenever it holds anything but plain printable text: a
    # client's string must not end the line, move the cursor, recolour or reorder the terminal
    # (CR, ANSI escapes, NUL, bidi controls are all not printable).
    if text == "" or not text.isprintable() or any(c in text for c in ' ="\\'):
        return json.dumps(text).replace("\x7f", "\\u007f")
    return text


def render_text(name: str, fields: dict[str, FieldValue]) -> str:
    """`name k=v k=v`: values with spaces, quotes or `=` are quoted (logfmt)."""
    return " ".join([name, *(f"{key}={_text_value(value)}" for key, value in fields.items())])


def event(logger: logging.Logger, name: str, /, *, level: int = logging.INFO, **fields: FieldValue) -> None:
    """Log one significant event with structured fields (no-op below the logger's level)."""
    if not logger.isEnabledFor(level):
        return
    logger.log(level, "%s", render_text(name, fields), extra={_EVENT_ATTR: name, _FIELDS_ATTR: fields})


def _json_value(value: Any) -> Any:
    if isinstance(value, float) and value != value:  # NaN is not JSON
        return None
    if isinstance(value, str):
        return _clipped(value)
    if value is None or isinstance(value, int | float | bool):
        return value
    return _clipped(str(value))


class JsonFormatter(logging.Formatter):
    """One JSON object per line; event fields become top-level keys."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = datetime.fromtimestamp(record.created, tz=timezone.utc)
        line: dict[str, Any] = {
            "time": stamp.strftime("%Y-%m-%dT%H:%M:%S.") + f"{stamp.microsecond // 1000:03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        name = getattr(record, _EVENT_ATTR, None)
        if name is not None:
            line["event"] = name
            for key, value in getattr(record, _FIELDS_ATTR, {}).items():
                line[f"field_{key}" if key in RESERVED_KEYS else key] = _json_value(value)
        line["message"] = record.getMessage()
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def formatter(fmt: str) -> logging.Formatter:
    if fmt == "json":
        return JsonFormatter()
    if fmt == "text":
        return logging.Formatter(TEXT_FORMAT)
    raise ValueError(f"unknown log format {fmt!r} (choose from {', '.join(LOG_FORMATS)})")


def configure(level: str = "info", fmt: str = "text", stream: IO[str] | None = None, origin: str = "") -> None:
    """Send every log record to `stream` (stderr) in `fmt`, replacing the root logger's handlers.
    `origin` tags each line's logger name (`gemps.server[partition 1]`): several processes of one
    service writing to one terminal stay apart."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(formatter(fmt))
    if origin:
        handler.addFilter(_Tag(origin))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))


class _Tag(logging.Filter):
    def __init__(self, origin: str) -> None:
        super().__init__()
        self.origin = origin

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.endswith("]"):
            record.name = f"{record.name}[{self.origin}]"
        return True


class Throttle:
    """At most one line per key every `interval` seconds, for events that can come in floods.

    `allow(key)` returns None when the line should be dropped, else how many were dropped for
    this key since the last line that went out (log it, so nothing disappears silently).
    """

    def __init__(self, interval: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self._clock = clock
        self._last: dict[Hashable, float] = {}
        self._dropped: dict[Hashable, int] = {}
        self._lock = threading.Lock()

    def allow(self, key: Hashable) -> int | None:
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval:
                self._dropped[key] = self._dropped.get(key, 0) + 1
                return None
            self._last[key] = now
            return self._dropped.pop(key, 0)
