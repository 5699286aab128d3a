"""Structured logs: key=value text and JSON lines, the formats' option, and the flood throttle."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
from gemps_cli.server import parse_config

from gemps_server import logs
from gemps_server.config import ServerConfig


@pytest.fixture
def root_logging() -> Iterator[None]:
    """Leave the root logger as the test found it."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


def capture(fmt: str, level: str = "info") -> io.StringIO:
    stream = io.StringIO()
    logs.configure(level, fmt, stream=stream)
    return stream


def test_text_lines_carry_the_event_and_its_fields(root_logging: None) -> None:
    stream = capture("text")
    logs.event(logging.getLogger("gemps.server"), "worker joined", worker_id="ab12", name="w 1", active=3, loss=0.5)
    line = stream.getvalue().strip()
    assert line.endswith('INFO gemps.server: worker joined worker_id=ab12 name="w 1" active=3 loss=0.5'), line


def test_render_text_quotes_what_would_break_key_value_parsing() -> None:
    text = logs.render_text("e", {"a": "", "b": 'say "hi"', "c": "x=y", "d": None, "e": True, "f": 1 / 3})
    assert text == 'e a="" b="say \\"hi\\"" c="x=y" d=- e=true f=0.333333'


def test_render_text_escapes_every_control_a_client_could_send() -> None:
    hostile: dict[str, logs.FieldValue] = {
        "cr": "a\rb",
        "ansi": "\x1b[31mred",
        "nul": "a\x00b",
        "bidi": "abc\u202edcba",
        "delete": "a\x7fb",
    }
    text = logs.render_text("e", hostile)
    assert text.isprintable() and text.isascii()  # one line, nothing a terminal would act on
    assert text == ('e cr="a\\rb" ansi="\\u001b[31mred" nul="a\\u0000b" bidi="abc\\u202edcba" delete="a\\u007fb"')
    assert logs.render_text("e", {"w": "wörker"}) == "e w=wörker"  # plain printable text stays as it is


def test_long_fields_are_clipped_in_both_formats(root_logging: None) -> None:
    long = "x" * (logs.MAX_FIELD_CHARS + 5000)
    clipped = "x" * logs.MAX_FIELD_CHARS + "... (5000 more characters)"
    assert logs.render_text("e", {"name": long}) == f'e name="{clipped}"'
    stream = capture("json")
    logs.event(logging.getLogger("gemps.server"), "e", name=long)
    assert len(json.loads(stream.getvalue())["name"]) < logs.MAX_FIELD_CHARS + 40


def test_json_lines_have_the_event_and_typed_fields(root_logging: None) -> None:
    stream = capture("json")
    log = logging.getLogger("gemps.server")
    logs.event(log, "worker evicted", level=logging.WARNING, worker_id="ab12", commits=7, lease_ttl_seconds=60.0)
    logs.event(log, "odd", message="clash", value=float("nan"), name=None)
    log.info("plain %s", "record")
    first, second, third = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["event"] == "worker evicted" and first["level"] == "warning" and first["logger"] == "gemps.server"
    assert (first["worker_id"], first["commits"], first["lease_ttl_seconds"]) == ("ab12", 7, 60.0)
    assert first["message"] == "worker evicted worker_id=ab12 commits=7 lease_ttl_seconds=60"
    assert first["time"].endswith("Z") and "T" in first["time"]
    # A field named like a reserved key is renamed, never overwrites it; NaN becomes null.
    assert second["field_message"] == "clash" and second["value"] is None and second["name"] is None
    assert second["message"].startswith("odd ")
    assert third == {"time": third["time"], "level": "info", "logger": "gemps.server", "message": "plain record"}


def test_json_lines_include_exceptions(root_logging: None) -> None:
    stream = capture("json")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger("gemps.server").exception("failed")
    record = json.loads(stream.getvalue())
    assert record["level"] == "error" and "RuntimeError: boom" in record["exception"]


def test_configure_replaces_handlers_and_sets_the_level(root_logging: None) -> None:
    logging.getLogger().addHandler(logging.StreamHandler(io.StringIO()))
    stream = capture("text", level="warning")
    assert len(logging.getLogger().handlers) == 1
    log = logging.getLogger("gemps.server")
    logs.event(log, "quiet")
    logs.event(log, "loud", level=logging.ERROR)
    assert "quiet" not in stream.getvalue() and "loud" in stream.getvalue()


def test_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown log format 'xml'"):
        logs.formatter("xml")


def test_log_format_is_a_server_option() -> None:
    assert parse_config([], environ={}).log_format == "text"
    assert parse_config([], environ={"GEMPS_LOG_FORMAT": "json"}).log_format == "json"
    assert parse_config(["--log-format", "text"], environ={"GEMPS_LOG_FORMAT": "json"}).log_format == "text"
    with pytest.raises(ValueError, match="unknown log_format 'xml'"):
        ServerConfig(log_format="xml")


def test_throttle_lets_one_line_per_interval_through_and_counts_the_rest() -> None:
    now = [0.0]
    throttle = logs.Throttle(interval=1.0, clock=lambda: now[0])
    assert throttle.allow("a") == 0
    assert throttle.allow("a") is None
    assert throttle.allow("a") is None
    assert throttle.allow("b") == 0  # keys are independent
    now[0] = 1.5
    assert throttle.allow("a") == 2  # two dropped since the last line
    assert throttle.allow("a") is None
    now[0] = 3.0
    assert throttle.allow("a") == 1
