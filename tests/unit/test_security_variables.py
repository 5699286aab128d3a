"""The SDK's security variables (issue 61 item 5): a GEMPS_TLS it cannot read as on or off is
refused, naming it, rather than read as off (clear text, the token sent in it); a token file that
cannot be read is an error naming the variable and the file, not a bare traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from gemps.channel_security import ChannelSecurity
from gemps.client import Client
from gemps.wire_options import resolve_shared_memory


@pytest.mark.parametrize("raw", ["enabled", "2", "y", "tls", "ture"])
def test_a_tls_setting_that_is_neither_on_nor_off_is_refused_naming_it(raw: str) -> None:
    with pytest.raises(ValueError, match=rf"GEMPS_TLS.*{raw!r}"):
        ChannelSecurity.resolve(environ={"GEMPS_TLS": raw, "GEMPS_AUTH_TOKEN": "secret"})


SPELLINGS = [("1", True), ("true", True), ("ON", True), ("yes", True), ("0", False), ("false", False), ("off", False),
             ("no", False), ("", False)]  # fmt: skip


@pytest.mark.parametrize(("raw", "tls"), SPELLINGS)
def test_the_spellings_of_on_and_off_are_read_as_said(raw: str, tls: bool) -> None:
    assert ChannelSecurity.resolve(environ={"GEMPS_TLS": raw}).tls is tls


def test_a_client_does_not_start_in_clear_text_under_a_tls_setting_it_cannot_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GEMPS_TLS", "enabled")
    monkeypatch.setenv("GEMPS_AUTH_TOKEN", "secret")
    with pytest.raises(ValueError, match="GEMPS_TLS"):
        Client("127.0.0.1:1")


def test_a_token_file_that_is_not_there_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "no-token"
    with pytest.raises(ValueError, match=rf"GEMPS_AUTH_TOKEN_FILE.*{missing}") as refused:
        ChannelSecurity.resolve(environ={"GEMPS_AUTH_TOKEN_FILE": str(missing)})
    assert isinstance(refused.value.__cause__, FileNotFoundError)


def test_an_empty_token_file_is_refused_rather_than_sending_no_token(tmp_path: Path) -> None:
    empty = tmp_path / "token"
    empty.write_text("\n")
    with pytest.raises(ValueError, match=r"GEMPS_AUTH_TOKEN_FILE.*empty"):
        ChannelSecurity.resolve(environ={"GEMPS_AUTH_TOKEN_FILE": str(empty)})


def test_shared_memory_reads_its_switch_the_same_way() -> None:
    assert resolve_shared_memory(None, {"GEMPS_SHARED_MEMORY": "yes"}) is True
    assert resolve_shared_memory(None, {"GEMPS_SHARED_MEMORY": "Off"}) is False
    with pytest.raises(ValueError, match=r"GEMPS_SHARED_MEMORY.*'enabled'"):
        resolve_shared_memory(None, {"GEMPS_SHARED_MEMORY": "enabled"})
