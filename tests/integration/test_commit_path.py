"""The path of one commit, walked for real: from `RemoteModel.step()` to the rule that moves θ.

docs/ARCHITECTURE.md lists the paths as numbered lists of files, one item per file in call
order: gRPC's, and the data plane's (the default), over TCP and through shared memory alike, and
a replicated partition's (from the primary's servicer to the rule on its backup).
This test captures the Python stack at the two ends of a real commit against a real in-process
server: on the worker's side where the SDK hands the request to gRPC, or writes its frame to
the data plane's socket, and on the server's side inside the rule while it applies the commit.
Each stack, reduced to the project's files, must cross each file once (no return into a file
it left, e.g. the servicer from the applier) and must be the list in the docs, so the docs
cannot drift from the code.
"""

from __future__ import annotations

import inspect
import os
import re
import sys
import threading
import traceback
from pathlib import Path
from types import FrameType
from typing import Any

import grpc
import pytest
import torch

from gemps.data_plane_connection import DataConnection
from gemps.pytorch import RemoteModel
from gemps_proto.data_plane_frames import Op, read_preamble
from gemps_server.replication import follower
from gemps_server.replication.forwarder import Done, Forwarder
from gemps_server.replication.local_etcd import LocalEtcd
from tests.helpers import wait_for
from tests.integration.conftest import StartServer
from tests.integration.test_replicas import replica_options, wait_replicated

REPO = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = ("client_sdk", "server", "proto")
GRPC_DIR = os.path.dirname(grpc.__file__)
DOCS = REPO / "docs" / "ARCHITECTURE.md"
SECTION = "## The path of one commit"
DATA_PLANE_SECTION = "## The path of one data-plane commit"
REPLICATED_SECTION = "## The path of one replicated commit"
# The path walked is the Python commit core's (domain/core.py), whose frames a stack shows: the
# compiled core (csrc/core.c) runs the common case from the same entry, in the same order, and is
# held to it bit for bit (tests/unit/test_commit_core.py).
PYTHON_CORE = "python"
# Past this many parameters the applier always runs a commit on its own thread (service.py).
LARGE_MODEL_FEATURES = 1024  # Linear(1024, 300): 307,500 parameters


def project_files(stack: traceback.StackSummary) -> list[str]:
    """The project's files on `stack`, outermost first, each run of frames in one file as one."""
    files: list[str] = []
    for frame in stack:
        path = Path(frame.filename).resolve()
        if not path.is_relative_to(REPO) or path.relative_to(REPO).parts[0] not in PACKAGE_DIRS:
            continue
        relative = path.relative_to(REPO).as_posix()
        if not files or files[-1] != relative:
            files.append(relative)
    return files


def documented_path(title: str = SECTION) -> list[str]:
    """The files of docs/ARCHITECTURE.md's commit path under `title`, in its order."""
    text = DOCS.read_text()
    section = text[text.index(title + "\n") :]
    section = section[: section.find("\n## ", len(title))]
    return re.findall(r"^\d+\. `([\w/.]+\.py)`", section, flags=re.MULTILINE)


@pytest.fixture(autouse=True)
def grpc_plane(monkeypatch: pytest.MonkeyPatch) -> None:
    """The documented path is the gRPC transport's: commits go there, not on the data plane."""
    monkeypatch.setenv("GEMPS_PLANE", "grpc")


class StackAtGrpc:
    """The caller's stack the first time this thread enters grpc's Python package (a profile hook)."""

    def __init__(self) -> None:
        self.stack: traceback.StackSummary | None = None

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if self.stack is None and event == "call" and frame.f_code.co_filename.startswith(GRPC_DIR):
            self.stack = traceback.extract_stack(frame)

    def __enter__(self) -> StackAtGrpc:
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)


class StackInRule:
    """The stack and thread where the server calls its rule's `step`, each time it applies a
    commit; `rule_file` is the file of the rule's class, which the path enters next."""

    def __init__(self) -> None:
        self.stacks: list[tuple[str, traceback.StackSummary]] = []
        self.rule_file = ""

    def watch(self, rule: Any) -> None:
        step = rule.step
        self.rule_file = Path(inspect.getfile(type(rule))).resolve().relative_to(REPO).as_posix()

        def recorded(*args: Any, **kwargs: Any) -> Any:
            self.stacks.append((threading.current_thread().name, traceback.extract_stack()))
            return step(*args, **kwargs)

        rule.step = recorded  # the instance's: only this server's rule


class StackAtDataPlane:
    """The caller's stack where the SDK writes a COMMIT frame to the data plane's socket."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.stack: traceback.StackSummary | None = None
        write = DataConnection._write

        def recorded(connection: DataConnection, views: list[memoryview]) -> None:
            if self.stack is None and read_preamble(views[0]).op == Op.COMMIT:
                self.stack = traceback.extract_stack()
            write(connection, views)

        monkeypatch.setattr(DataConnection, "_write", recorded)

    def __enter__(self) -> StackAtDataPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def one_step(
    target: str, features: int, recorder: StackInRule, server_state: Any, sdk: StackAtGrpc | StackAtDataPlane
) -> traceback.StackSummary:
    """Register a linear model, then one training step; the SDK's stack where it hands the
    commit to gRPC, or to the data plane's socket."""
    torch.manual_seed(0)
    model = torch.nn.Linear(features, 300 if features > 64 else 10)
    with RemoteModel(model, target) as remote:
        recorder.watch(server_state().core.rule)
        model(torch.randn(8, features)).square().mean().backward()
        with sdk:
            remote.step()
    assert sdk.stack is not None, "the commit never reached its plane"
    return sdk.stack


@pytest.mark.parametrize("title", [SECTION, DATA_PLANE_SECTION, REPLICATED_SECTION])
def test_docs_list_the_commit_path(title: str) -> None:
    path = documented_path(title)
    assert path, f"no numbered list of files under {title!r} in {DOCS}"
    assert len(path) == len(set(path)), f"the documented path crosses a file twice: {path}"
    for file in path:
        assert (REPO / file).is_file(), f"docs/ARCHITECTURE.md names {file}, which does not exist"


def test_a_small_commit_crosses_each_file_once_as_documented(start_server: StartServer) -> None:
    """A small model's commit runs inline on the server's event loop: the whole server path is
    one stack, from the servicer to the rule."""
    server = start_server(rule="gem", commit_core=PYTHON_CORE)
    recorder = StackInRule()
    sdk_stack = one_step(server.target, 64, recorder, lambda: server.server.state, StackAtGrpc())
    sdk_files = project_files(sdk_stack)
    assert len(recorder.stacks) == 1
    thread, server_stack = recorder.stacks[0]
    assert thread == "in-process-server", "a small commit on an idle applier runs on the event loop"
    server_files = [*project_files(server_stack), recorder.rule_file]
    walked = sdk_files + server_files
    assert len(walked) == len(set(walked)), f"the commit path crosses a file twice: {walked}"
    assert walked == documented_path()


def test_a_large_commit_crosses_the_applier_thread_the_same_way(start_server: StartServer) -> None:
    """Past the inline bound the applier's thread runs the commit: its stack is the tail of the
    documented path, from the applier to the rule."""
    server = start_server(rule="gem", commit_core=PYTHON_CORE)
    recorder = StackInRule()
    one_step(server.target, LARGE_MODEL_FEATURES, recorder, lambda: server.server.state, StackAtGrpc())
    assert len(recorder.stacks) == 1
    thread, server_stack = recorder.stacks[0]
    assert thread != "in-process-server", "a large commit runs on the applier's thread"
    server_files = [*project_files(server_stack), recorder.rule_file]
    documented = documented_path()
    assert server_files == documented[-len(server_files) :], (server_files, documented)
    assert any("applier" in file for file in server_files)


@pytest.mark.parametrize("shared_memory", ["off", "on"])
def test_a_data_plane_commit_crosses_each_file_once_as_documented(
    start_server: StartServer, monkeypatch: pytest.MonkeyPatch, shared_memory: str
) -> None:
    """The default path: over TCP (as between hosts), or through shared memory (the server's
    host). A small model's commit runs inline on the data plane's loop: from the loop's thread
    to the rule, one stack."""
    monkeypatch.setenv("GEMPS_PLANE", "data")
    monkeypatch.setenv("GEMPS_SHARED_MEMORY", shared_memory)
    server = start_server(rule="gem", commit_core=PYTHON_CORE)
    recorder = StackInRule()
    sdk_stack = one_step(server.target, 64, recorder, lambda: server.server.state, StackAtDataPlane(monkeypatch))
    assert len(recorder.stacks) == 1
    thread, server_stack = recorder.stacks[0]
    assert thread == "gemps-data-plane", "a small commit on an idle applier runs on the data plane's loop"
    walked = [*project_files(sdk_stack), *project_files(server_stack), recorder.rule_file]
    assert len(walked) == len(set(walked)), f"the commit path crosses a file twice: {walked}"
    assert walked == documented_path(DATA_PLANE_SECTION)


class StacksOfReplication:
    """On the primary, the stack where the port is asked to wait for a commit's position
    (`Forwarder.when_replicated`) and the one that answers it; on the backup, the follower's stack
    where it hands an entry to its applier."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.waiting: traceback.StackSummary | None = None
        self.acknowledged: traceback.StackSummary | None = None
        self.following: traceback.StackSummary | None = None
        when_replicated, on_applier = Forwarder.when_replicated, follower._on_applier

        def waits(forwarder: Forwarder, position: int, done: Done) -> None:
            if self.waiting is not None:
                when_replicated(forwarder, position, done)
                return
            self.waiting = traceback.extract_stack()

            def answered(error: BaseException | None) -> None:
                self.acknowledged = traceback.extract_stack()
                done(error)

            when_replicated(forwarder, position, answered)

        def applies(applier: Any, operation: Any, inline: bool = False) -> Any:
            if self.following is None and getattr(getattr(operation, "func", None), "__name__", "") == "replay":
                self.following = traceback.extract_stack()
            return on_applier(applier, operation, inline)

        monkeypatch.setattr(Forwarder, "when_replicated", waits)
        monkeypatch.setattr(follower, "_on_applier", applies)


def test_a_replicated_commit_crosses_each_file_once_as_documented(
    etcd: LocalEtcd, start_server: StartServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit to a replicated pair's primary: its servicer to the port that waits (the primary's
    stack), then the backup's follower to its rule (the follower's thread while its applier is
    idle, else the applier's, from the applier on); the acknowledgement comes back on the
    primary's forwarder."""
    # The Python core, as above: the compiled one (a primary's and a backup's too) runs no rule step to record.
    options = {"rule": "gem", "commit_core": PYTHON_CORE}
    servers = [start_server(**options, **replica_options(etcd, index, "path")) for index in range(2)]
    primary = wait_replicated(servers)
    backup = next(server for server in servers if server is not primary)
    stacks = StacksOfReplication(monkeypatch)
    recorder = StackInRule()
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 10)
    with RemoteModel(model, primary.target) as remote:
        recorder.watch(wait_for(lambda: backup.server.state.core.rule, 30, "the backup replayed the registration"))
        model(torch.randn(8, 64)).square().mean().backward()
        remote.step()
    assert stacks.waiting is not None and stacks.acknowledged is not None and stacks.following is not None
    assert len(recorder.stacks) == 1
    thread, backup_stack = recorder.stacks[0]
    following, applying = project_files(stacks.following), project_files(backup_stack)
    if thread == "gemps-replication-follow":  # replayed inline: the rule's stack runs through the follower's
        assert applying[: len(following)] == following
        applying = applying[len(following) :]
    else:  # the backup's applier was busy: queued for its thread
        assert thread == "gemps-applier", thread
    forwarder_file = Path(inspect.getfile(Forwarder)).resolve().relative_to(REPO).as_posix()
    walked = [*project_files(stacks.waiting), forwarder_file, *following, *applying, recorder.rule_file]
    assert len(walked) == len(set(walked)), f"the replicated commit path crosses a file twice: {walked}"
    assert walked == documented_path(REPLICATED_SECTION)
    assert project_files(stacks.acknowledged)[-1] == forwarder_file
