"""`gemps worker`'s options refused before anything registers (issue 77, item 5): a float that is
NaN, infinite or negative (and counts below their least) where no such value means anything, and
an option the chosen mode does not read, which it took silently; the help names every mode that
reads each local-steps option."""

from __future__ import annotations

import logging
import math
import re

import pytest
from gemps_cli.main import main as gemps_main

from gemps_worker.training import WorkerOptions


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"mode": "dylu", "local_learning_rate": math.nan}, "local_learning_rate nan is outside [0, 3.4e+38]"),
        ({"mode": "agn", "local_learning_rate": -0.1}, "local_learning_rate -0.1 is outside [0, "),
        ({"mode": "easgd", "local_learning_rate": math.inf}, "local_learning_rate inf is outside [0, "),
        ({"mode": "dynsgd", "outer_learning_rate": math.nan}, "outer_learning_rate nan is outside [0, "),
        ({"patience": math.nan}, "patience nan is outside (0, 2147483.647] seconds"),
        ({"patience": 0.0}, "patience 0.0 is outside (0, "),
        ({"log_every": -1.0}, "log_every -1.0 is outside [0, "),
        ({"log_every": math.nan}, "log_every nan is outside [0, "),
        ({"epochs": 0}, "epochs 0 is outside [1, "),
        ({"max_steps": -1}, "max_steps -1 is outside [0, "),
        ({"threads": 0}, "threads 0 is outside [1, 1024]"),
        ({"seed": -1}, "seed -1 is outside [0, "),
    ],
)
def test_a_value_no_option_means_is_refused_naming_the_option(options: dict[str, object], message: str) -> None:
    assert message in "; ".join(WorkerOptions(**options).problems())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"outer_learning_rate": 0.5},
            "outer_learning_rate 0.5: the factor of a window's accumulated update, read by modes agn, dynsgd, dylu "
            "only; mode gradient commits each mini-batch's gradient and takes no local steps: drop it, or choose "
            "one of those modes",
        ),
        ({"mode": "easgd", "outer_learning_rate": 0.5}, "mode easgd commits alpha(x - θ) every easgd_period"),
        ({"local_learning_rate": 0.01}, "local_learning_rate 0.01: the learning rate of local steps, read by modes "),
        ({"local_optimizer": "adam"}, "local_optimizer 'adam': the optimizer of local steps, read by modes agn, "),
    ],
)
def test_an_option_the_mode_does_not_read_is_refused_saying_why(options: dict[str, object], message: str) -> None:
    assert message in "; ".join(WorkerOptions(**options).problems())  # type: ignore[arg-type]


def test_the_modes_that_read_an_option_take_it() -> None:
    for mode in ("agn", "dynsgd", "dylu"):
        assert not WorkerOptions(mode=mode, outer_learning_rate=0.5, local_learning_rate=0.01).problems()
    assert not WorkerOptions(mode="easgd", local_optimizer="adam", local_learning_rate=0.01).problems()
    assert not WorkerOptions().problems()  # the defaults of every mode's options, in mode gradient


def test_gemps_worker_refuses_a_nan_learning_rate_and_exits_2(caplog: pytest.LogCaptureFixture) -> None:
    # Taken before (it then tried to register at port 1 for --patience): a second, not 300.
    argv = ["worker", "--server", "127.0.0.1:1", "--patience", "1", "--mode", "dylu", "--local-learning-rate", "nan"]
    with caplog.at_level(logging.ERROR, logger="gemps.worker"):
        assert gemps_main(argv) == 2
    assert "local_learning_rate nan is outside [0, 3.4e+38]" in caplog.text


def test_the_help_names_every_mode_that_reads_a_local_steps_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        gemps_main(["worker", "--help"])
    text = re.sub(r"\s+", " ", capsys.readouterr().out)
    for option in ("--local-optimizer", "--local-learning-rate"):
        assert re.search(re.escape(option) + r" \S+ agn, dynsgd, dylu, easgd: ", text), option
    assert re.search(r"--outer-learning-rate \S+ agn, dynsgd, dylu: ", text)
