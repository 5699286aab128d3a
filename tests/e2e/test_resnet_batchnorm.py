"""The batch-norm example, reduced: several workers train a ResNet with batch norm, the export
reloads with strict=True and evaluates exactly as the evaluator measured the central variable."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "resnet_batchnorm.py"


def test_the_strict_reload_of_the_export_evaluates_as_the_evaluator_reported(tmp_path: Path) -> None:
    out = tmp_path / "resnet"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--workers", "2", "--epochs", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    figures = json.loads((out / "result.json").read_text())
    assert figures["version"] == 2 * 22  # every worker's commits applied and checkpointed
    assert figures["reloaded_strict_accuracy"] == figures["evaluator_accuracy"] > 0.5
    # Without the server's running statistics the same parameters are far worse: they matter.
    assert figures["parameters_only_default_statistics_accuracy"] < figures["evaluator_accuracy"] - 0.2
