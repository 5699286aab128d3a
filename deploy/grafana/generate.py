"""Generate the gemps Grafana dashboards (deploy/grafana/dashboards/*.json) with grafana-foundation-sdk.

    python deploy/grafana/generate.py           # rewrite the JSON files
    python deploy/grafana/generate.py --check   # exit 1 when the committed files differ

The dashboards are code: edit them (this folder's dashboard_*.py), regenerate, commit both (a
test fails when the JSON differs from a fresh generation). Every panel queries the datasource that
provisioning/datasources/prometheus.yml provisions, by its fixed uid, so Grafana needs no
import step and no `${DS_...}` placeholder. Every PromQL expression here is evaluated against a
real Prometheus scraping a training run in tests/e2e/test_observability.py.

The panels' building blocks are in dashboard_panels.py; each dashboard is a module of its own
(dashboard_training.py; dashboard_server.py, with replication's row in dashboard_replication.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from dashboard_server import server_dashboard
from dashboard_training import training_dashboard
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as dashboard_models

HERE = Path(__file__).resolve().parent
OUTPUT_DIR = HERE / "dashboards"


def dashboards() -> dict[str, dashboard_models.Dashboard]:
    """File name -> dashboard model."""
    built = {"gemps-training.json": training_dashboard().build(), "gemps-server.json": server_dashboard().build()}
    for model in built.values():
        # A collapsed row holds its panels: they are numbered after it, in order.
        every = [inner for panel in model.panels or [] for inner in (panel, *(getattr(panel, "panels", None) or []))]
        for number, panel in enumerate(every, start=1):
            panel.id_val = number  # stable ids: Grafana keys panel links and state on them
    return built


def render(model: dashboard_models.Dashboard) -> str:
    return json.dumps(model, cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed JSON differs")
    parser.add_argument("--out", type=Path, default=OUTPUT_DIR, help="output folder")
    args = parser.parse_args(argv)
    stale = []
    for name, model in dashboards().items():
        path = args.out / name
        text = render(model)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print("out of date (run python deploy/grafana/generate.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
