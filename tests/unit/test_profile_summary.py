"""scripts/profile_server.py's reading of py-spy's raw samples, with and without `--subprocesses`."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from tests.script_modules import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "profile_server.py"


def load_profile_script() -> ModuleType:
    return load_script(SCRIPT, "profile_server")


SUPERVISOR = 'process 100:"python -m gemps_cli server --partitions 2"'
PARTITION = 'process 101:"python -m gemps_cli server"'
RAW = "\n".join(
    [
        # one process: the thread comes first
        "thread (7): MainThread;run (gemps_cli/server.py:10);sendmsg (libc.so.6) 5",
        "thread (7): MainThread;run (gemps_cli/server.py:10);epoll_wait (libc.so.6) 9",
        # under --subprocesses: the process chain, then the thread
        f"{SUPERVISOR};{PARTITION};thread (101): MainThread;run (gemps_cli/server.py:10);sendmsg (libc.so.6) 3",
        f"{SUPERVISOR};{PARTITION};thread (102): gemps-applier;gem_update (gemps_server/_native.c:1) 4",
        f"{SUPERVISOR};thread (100): MainThread;wait (gemps_cli/partitions.py:5);futex (libc.so.6) 2",
    ]
)


def test_samples_are_counted_per_thread_and_named_by_their_process(tmp_path: Path) -> None:
    raw = tmp_path / "server.txt"
    raw.write_text(RAW + "\n")
    summary = load_profile_script().summarize(raw, {100: "server", 101: "partition 1"})
    headers = [line for line in summary.splitlines() if line.startswith("== thread")]
    assert headers == [
        "== thread MainThread: 14 samples, 5 busy",
        "== thread partition 1 gemps-applier: 4 samples, 4 busy",
        "== thread partition 1 MainThread: 3 samples, 3 busy",
        "== thread server MainThread: 2 samples, 0 busy",
    ]
    assert "self      4  gem_update" in summary


def test_a_process_missing_from_the_names_is_named_by_its_pid(tmp_path: Path) -> None:
    raw = tmp_path / "server.txt"
    raw.write_text(RAW + "\n")
    summary = load_profile_script().summarize(raw)
    assert "== thread process 101 MainThread: 3 samples, 3 busy" in summary


def test_calls_are_read_per_commit_from_the_process_whose_data_plane_applied_them(tmp_path: Path) -> None:
    """--count-calls: the process that counted commits is read (a client's file, none), its calls a
    commit in all and of Python, most first; the hook is on the server's PYTHONPATH first."""
    script = load_profile_script()
    environment = {"PYTHONPATH": "/elsewhere"}
    counts = script.count_calls(environment)
    assert environment["GEMPS_COUNT_CALLS"] == str(counts)
    assert environment["PYTHONPATH"].split(":") == [str(SCRIPT.parent / "call_counts"), "/elsewhere"]
    assert (SCRIPT.parent / "call_counts" / "sitecustomize.py").exists()
    assert script.calls_per_commit(counts).startswith("no process counted a commit")
    Path(f"{counts}.1").write_text("40\tC\tlen\n")  # a process that applied nothing
    Path(f"{counts}.2").write_text(
        "60\tC\tisinstance\n30\t/x/server/gemps_server/wire/data_plane_calls.py\trequest\n"
        "10\t/x/server/gemps_server/domain/core.py\tcommit_and_reply\n"
    )
    summary = script.calls_per_commit(counts).splitlines()
    assert summary[0] == "10 commits on the data plane's thread: 10.0 calls a commit, 4.0 of Python"
    assert summary[1].split() == ["6.00", "C", "isinstance"]
    assert summary[2].split()[0] == "3.00" and summary[2].endswith("request")
