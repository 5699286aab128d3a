"""Standard gRPC surfaces: health reports SERVING, reflection lists the service; --help."""

from __future__ import annotations

import re
import subprocess
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from gemps.options import flag, options_of
from gemps_server.config import ServerConfig
from gemps_server.domain.rules import rule_catalog
from gemps_worker.cluster import ServerProcess
from tests.helpers import InProcessServer

# `gemps server` with torch and scikit-learn unimportable: any import of them fails.
WITHOUT_EXTRAS = (  # neither the torch extra nor the ray extra importable
    "import sys\n"
    "sys.modules.update(torch=None, sklearn=None, ray=None)\n"
    "from gemps_cli.main import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def test_health_reports_serving(server: InProcessServer) -> None:
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(server.target))
    for service in ("", "gemps.v1.ParameterServer"):
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_service(server: InProcessServer) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(grpc.insecure_channel(server.target))
    replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    services = {s.name for reply in replies for s in reply.list_services_response.service}
    assert "gemps.v1.ParameterServer" in services
    assert "grpc.health.v1.Health" in services


def test_server_help_documents_every_option() -> None:
    help_text = subprocess.run(
        [sys.executable, "-m", "gemps_cli", "server", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for field in options_of(ServerConfig, rule_catalog().fields):
        assert flag(field.name) in help_text, field.name
        assert f"GEMPS_{field.name.upper()}" in help_text, field.name


def test_server_rejects_invalid_configuration_clearly() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gemps_cli", "server", "--momentum", "1.5"], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert "momentum 1.5 is outside [0, 1)" in result.stderr


def test_server_starts_without_torch_or_ray() -> None:
    with ServerProcess(command=(sys.executable, "-c", WITHOUT_EXTRAS)) as server:
        stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(server.target))
        assert stub.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING


def test_the_reference_documents_every_server_option() -> None:
    """The server options table, moved from the README to the site's generated reference (the
    `gemps server` section of docs/reference/cli.md), names every option and its variable."""
    from gemps_cli.reference_docs import commands_markdown

    section = commands_markdown().split("## `gemps server`", 1)[1].split("\n## ", 1)[0]
    for field in options_of(ServerConfig):
        assert re.search(rf"`{re.escape(flag(field.name))}[ `]", section), field.name
        assert f"`GEMPS_{field.name.upper()}`" in section, field.name


def test_worker_commands_without_torch_say_what_to_install() -> None:
    script = "import sys; sys.modules['torch'] = None; from gemps_cli.main import main; sys.exit(main(['worker']))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "needs the torch extra: pip install 'gemps[torch]'" in result.stderr


def test_gemps_ray_without_ray_says_what_to_install() -> None:
    result = subprocess.run([sys.executable, "-c", WITHOUT_EXTRAS, "ray"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "needs the ray, server and torch extras: pip install 'gemps[ray,server,torch]'" in result.stderr
