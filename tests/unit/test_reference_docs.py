"""The documentation site's generated reference pages (gemps_cli.reference_docs, added by
docs/hooks/reference.py) hold every flag of every command, every GEMPS_* variable and every
metric family, each checked against the parsers, option dataclasses and registries themselves."""

from __future__ import annotations

import argparse
import html
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from gemps_cli import environment, reference_docs
from gemps_cli import server as server_command
from gemps_cli.main import COMMANDS, build_parser
from prometheus_client import CollectorRegistry

from gemps import options
from gemps_proto.ranges import DEFAULT_TEXT
from gemps_server.config import ServerConfig
from gemps_server.domain.rules import rule_catalog
from gemps_worker.metrics import EvaluatorMetrics, WorkerMetrics
from tests.unit.test_metrics import busy_registry

ROOT = Path(__file__).resolve().parents[2]
HOOK = ROOT / "docs" / "hooks" / "reference.py"
CELL = re.compile(r"(?<!\\)\|")  # a table's cell separator: a pipe not escaped


@pytest.fixture(scope="module")
def cli_page() -> str:
    return reference_docs.commands_markdown()


@pytest.fixture(scope="module")
def metrics_page() -> str:
    return reference_docs.metrics_markdown()


def sections(page: str) -> dict[str, str]:
    """Each `## ` section's heading -> its text."""
    return {part.split("\n", 1)[0]: part for part in page.split("\n## ")[1:]}


def table_rows(text: str) -> list[list[str]]:
    """The cells of each body row of every table in `text`."""
    return [
        [cell.strip() for cell in CELL.split(line)[1:-1]]
        for line in text.splitlines()
        if line.startswith("| ") and not line.startswith(("| Flag |", "| Metric |", "| Variable |", "| Command |"))
    ]


def plain(cell: str) -> str:
    """A cell's text as it renders: links, emphasis and code spans' marks gone, escapes undone."""
    text = re.sub(r"(?<!\\)\[(.*?)(?<!\\)\]\([^)]*\)", r"\1", cell)
    text = re.sub(r"(?<!\\)[*`]", "", text)
    return html.unescape(re.sub(r"\\(.)", r"\1", text))


def command_section(page: str, name: str) -> str:
    return sections(page)[f"`gemps {name}`" if name else "`gemps`"]


def flag_rows(page: str, name: str) -> dict[str, list[str]]:
    """A command's rows by each option string (or positional name) its Flag cell shows."""
    rows: dict[str, list[str]] = {}
    for cells in table_rows(command_section(page, name)):
        invocation = plain(cells[0])
        names = re.findall(r"(?<![\w-])--?[A-Za-z][\w-]*", invocation) or [invocation]
        rows.update((found, cells) for found in names)
    return rows


def subcommand(name: str) -> argparse.ArgumentParser:
    """`gemps NAME`'s parser, reached through the top parser's own subparsers group."""
    parser = build_parser([name])
    assert parser._subparsers is not None
    (group,) = [
        action for action in parser._subparsers._group_actions if isinstance(action, argparse._SubParsersAction)
    ]
    chosen: argparse.ArgumentParser = group.choices[name]
    return chosen


# -- commands ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_argument_of_every_command_has_its_row(cli_page: str, name: str) -> None:
    """Walked here from the parser `gemps NAME --help` prints: a flag added and left off the page
    (or one on the page that the command lacks) fails."""
    expected = set()
    for action in subcommand(name)._actions:
        if not isinstance(action, argparse._HelpAction):
            expected |= set(action.option_strings) or {action.dest}
    assert expected, name
    assert set(flag_rows(cli_page, name)) == expected


def test_gemps_itself_and_every_command_have_a_section(cli_page: str) -> None:
    assert list(sections(cli_page)) == ["`gemps`", *(f"`gemps {name}`" for name in COMMANDS), "Environment variables"]
    assert "--version" in flag_rows(cli_page, "")
    summary = table_rows(cli_page.split("\n## ", 1)[0])
    assert [plain(cells[0]) for cells in summary] == [f"gemps {name}" for name in COMMANDS]


def test_a_flag_a_command_gains_is_on_the_page(cli_page: str, monkeypatch: pytest.MonkeyPatch) -> None:
    real = server_command.add_arguments

    def with_one_more(parser: argparse.ArgumentParser) -> None:
        real(parser)
        parser.add_argument("--brand-new", type=int, help="a new knob (env GEMPS_BRAND_NEW; default 3; range [0, 9])")

    monkeypatch.setattr(server_command, "add_arguments", with_one_more)
    row = flag_rows(reference_docs.commands_markdown(), "server")["--brand-new"]
    assert row == ["`--brand-new BRAND_NEW`", "`GEMPS_BRAND_NEW`", "`3`", "a new knob (range `[0, 9]`)"]


def test_every_server_option_has_its_variable_and_default(cli_page: str) -> None:
    """From ServerConfig's fields, not from the parser: flag, variable and default of each."""
    rows = flag_rows(cli_page, "server")
    for field in options.options_of(ServerConfig, rule_catalog().fields):
        _flag, variable, default, _description = rows[options.flag(field.name)]
        assert variable == f"`{options.env_var(field.name)}`", field.name
        if DEFAULT_TEXT in field.metadata:
            assert plain(default) == field.metadata[DEFAULT_TEXT], field.name
        elif isinstance(field.default, str):
            assert default == (f"`{field.default}`" if field.default else ""), field.name
        else:
            assert default == f"`{field.default!r}`", field.name


def test_every_option_variable_is_a_flags_variable(cli_page: str) -> None:
    """Each GEMPS_* option (environment.known_options: what --strict-env accepts) is named in the
    Variable column of some command's flags."""
    named = {
        plain(cells[1])
        for heading, text in sections(cli_page).items()
        if heading.startswith("`gemps")
        for cells in table_rows(text)
        if cells[1]
    }
    assert environment.known_options() <= named
    assert environment.STRICT_VARIABLE in named


def test_the_variables_section_lists_every_known_name_and_who_reads_it(cli_page: str) -> None:
    rows = {plain(cells[0]): cells[1] for cells in table_rows(sections(cli_page)["Environment variables"])}
    assert set(rows) == environment.known_options() | set(environment.NOT_OPTIONS)
    for name, reader in environment.NOT_OPTIONS.items():
        assert reader in plain(rows[name]), name
    assert "`gemps server`" in rows["GEMPS_PORT"] and "`gemps demo`" not in rows["GEMPS_PORT"]
    assert {f"`gemps {name}`" for name in ("server", "worker", "evaluate", "demo", "ray")} <= set(
        rows[environment.STRICT_VARIABLE].split(", ")
    )


def test_help_text_survives_markdown(cli_page: str) -> None:
    """Pipes, angle brackets, stars and braces in help lines stay text, in one cell each."""
    status = flag_rows(cli_page, "status")["--server"]
    assert "'HOST:PORT|HOST:PORT'" in plain(status[3])
    work_dir = flag_rows(cli_page, "ray")["--work-dir"]
    assert "partition-&lt;i&gt;/" in work_dir[3] and "partition-<i>/" in plain(work_dir[3])
    addresses = flag_rows(cli_page, "server")["--partition-addresses"][3]
    assert r"\{index\}" in addresses  # attr_list would take `{index}` for an attribute
    learning_rate = flag_rows(cli_page, "server")["--learning-rate"][3]
    assert learning_rate.startswith(r"eta: a gradient g is applied as -eta\*g; an update commit (a worker's own steps)")


def test_every_table_row_has_its_headers_cell_count(cli_page: str, metrics_page: str) -> None:
    for page in (cli_page, metrics_page):
        width = 0
        for line in page.splitlines():
            if not line.startswith("|"):
                width = 0
                continue
            cells = len(CELL.split(line)) - 2
            width = width or cells
            assert cells == width, line


def test_a_command_without_its_extras_stops_the_page(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its parser would have no flags (main._explain_missing): the page must not silently lose them."""
    monkeypatch.setattr("gemps_cli.extras.missing", lambda needed: list(needed))
    with pytest.raises(RuntimeError, match="flags cannot be listed: gemps server needs the server extra"):
        reference_docs.command_parsers()


def test_the_pages_are_the_same_every_build(cli_page: str, metrics_page: str) -> None:
    assert reference_docs.commands_markdown() == cli_page
    assert reference_docs.metrics_markdown() == metrics_page


# -- metrics --------------------------------------------------------------------------------------


def documented(page: str, section: str) -> dict[str, tuple[str, set[str], str]]:
    """One section's rows: name -> (type, labels, help as it renders)."""
    rows = {}
    for name, kind, labels, help_text in table_rows(sections(page)[section]):
        rows[plain(name)] = (kind, set(re.findall(r"`(\w+)`", labels)), plain(help_text))
    return rows


@pytest.mark.parametrize(
    ("section", "registry"),
    [
        ("Parameter server", busy_registry),
        ("Partition supervisor", reference_docs.supervisor_registry),
        ("SDK (opt-in)", reference_docs.client_registry),
        ("Reference worker", lambda: WorkerMetrics().registry),
        ("Evaluator", lambda: EvaluatorMetrics().registry),
    ],
)
def test_every_family_is_documented_with_its_type_labels_and_help(
    metrics_page: str, section: str, registry: Callable[[], CollectorRegistry]
) -> None:
    """Registries built here as the tests build them, with every concern's event counted (so
    every label has a series): each family, in its section (replication's in its own)."""
    page = documented(metrics_page, section)
    if section == "Parameter server":
        page |= documented(metrics_page, "Replicated partition")
    families = list(registry().collect())
    assert families
    for family in families:
        name = reference_docs.exposed_name(family.name, family.type)
        assert name in page, name
        kind, labels, help_text = page[name]
        assert kind == family.type, name
        assert help_text.removeprefix("primary only: ") == family.documentation, name
        assert {key for sample in family.samples for key in sample.labels} - {"le", "quantile"} <= labels, name


def test_labels_a_family_has_before_any_series_are_listed(metrics_page: str) -> None:
    """Families that have no series until an event (an evaluator's report, a worker's commit)
    still list the labels they declare."""
    server = documented(metrics_page, "Parameter server")
    assert server["gemps_heldout_loss"][1] == {"dataset"}
    assert server["gemps_damped_worker_scaling"][1] == {"rank", "worker"}
    assert server["gemps_commit_duration_seconds"][1] == {"phase"}  # no `le`
    assert documented(metrics_page, "Partition supervisor")["gemps_partition_up"][1] == {"partition", "replica"}


def test_what_only_a_primary_exports_is_marked(metrics_page: str) -> None:
    replication = documented(metrics_page, "Replicated partition")
    marked = {name for name, (_kind, _labels, text) in replication.items() if text.startswith("primary only: ")}
    assert "gemps_replication_lag_seconds" in marked and "gemps_replicas_live" in marked
    assert "gemps_replica_role" in replication and "gemps_replica_role" not in marked


def test_every_metric_a_help_text_names_exists(metrics_page: str) -> None:
    """A help text pointing at another family names one that is there (gemps_wire_bytes_total's
    pointed at a gemps_samples_total no registry has)."""
    rows = [row for row in table_rows(metrics_page) if row[0].startswith("`gemps_")]

    def family(name: str) -> str:  # a series' family: counters are listed with _total, histograms without
        return re.sub(r"_(total|bucket|count|sum)$", "", name)

    families = {family(row[0].strip("` ")) for row in rows}
    named = {name for row in rows for name in re.findall(r"\bgemps_[a-z_]*[a-z]\b", plain(row[-1]))}
    assert named  # help texts do name other families: the check is not vacuous
    assert {name for name in named if family(name) not in families} == set()


def test_histograms_are_listed_once_by_family_name(metrics_page: str) -> None:
    names = [plain(cells[0]) for cells in table_rows(metrics_page)]
    assert "gemps_commit_staleness" in names
    assert not [name for name in names if name.endswith(("_bucket", "_sum", "_count", "_created"))]
    assert len(names) == len(set(names))


# -- the MkDocs hook -------------------------------------------------------------------------------


def mkdocs_config(tmp_path: Path, **settings: object) -> Any:
    """A validated MkDocs configuration with the hook (mkdocs loads it from its path, as a build does)."""
    from mkdocs.config import defaults

    (tmp_path / "docs").mkdir(exist_ok=True)
    config = defaults.MkDocsConfig(config_file_path=str(tmp_path / "mkdocs.yml"))
    config.load_dict({"site_name": "test", "docs_dir": str(tmp_path / "docs"), "hooks": [str(HOOK)], **settings})
    errors, _warnings = config.validate()
    assert not errors
    return config


def test_the_hook_adds_both_pages(tmp_path: Path) -> None:
    config = mkdocs_config(tmp_path)
    from mkdocs.structure.files import Files

    files = config.plugins.on_files(Files([]), config=config)
    pages = {file.src_uri: file.content_string for file in files}
    assert set(pages) == {"reference/cli.md", "reference/metrics.md"}
    assert pages["reference/cli.md"].startswith("# Command-line reference\n")
    assert "| `--port PORT` | `GEMPS_PORT` | `50051` |" in pages["reference/cli.md"]
    assert "| `gemps_commits_total` | counter | `outcome`, `reason` |" in pages["reference/metrics.md"]


def test_the_hook_refuses_a_written_page_of_the_same_name(tmp_path: Path) -> None:
    config = mkdocs_config(tmp_path)
    from mkdocs.exceptions import PluginError
    from mkdocs.structure.files import File, Files

    written = File("reference/cli.md", config.docs_dir, config.site_dir, use_directory_urls=True)
    with pytest.raises(PluginError, match=r"reference/cli\.md is generated"):
        config.plugins.on_files(Files([written]), config=config)


def test_a_strict_build_of_the_pages_has_no_warnings(tmp_path: Path) -> None:
    """Their links to commands' anchors resolve and nothing in them warns (strict: a warning fails)."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Reference\n\n[Commands](reference/cli.md#gemps-server)\n")
    (tmp_path / "mkdocs.yml").write_text(
        f"site_name: test\nstrict: true\nhooks: [{HOOK}]\nmarkdown_extensions: [tables, toc, attr_list]\n"
        "validation: {links: {anchors: warn, not_found: warn, unrecognized_links: warn}}\n"
        "nav: [index.md, reference/cli.md, reference/metrics.md]\n"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "-q",
            "-f",
            str(tmp_path / "mkdocs.yml"),
            "-d",
            str(tmp_path / "site"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "WARNING" not in result.stderr
    assert (tmp_path / "site" / "reference" / "metrics" / "index.html").is_file()


def test_the_stated_defaults_read_as_the_help_states_them() -> None:
    assert reference_docs._stated_default("'gem'") == "`gem`"
    assert reference_docs._stated_default("''") == ""
    assert reference_docs._stated_default("0.05") == "`0.05`"
    assert reference_docs._stated_default("9109 + (--port - 50051)") == "9109 + (--port - 50051)"
    assert reference_docs._stated_default("True") == "`True`"  # a bool as --help writes it


def test_open_ranges_read_as_users_read_them(cli_page: str) -> None:
    """Issue 60, item 6: no range printed with float32's largest value in seventeen digits."""
    assert "3.4028234663852886e+38" not in cli_page
    assert "(range `(0, 3.4e+38]`)" in cli_page
