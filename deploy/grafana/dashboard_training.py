"""The training dashboard (gemps-training.json): is training converging, and how is GEM scaling
the workers' updates? The paper's figures, live."""

from __future__ import annotations

from dashboard_panels import RATE, Query, heatmap_panel, mean_over_commits, new_dashboard, quantile, timeseries
from grafana_foundation_sdk.builders import dashboard as dashboard_builders

# A straggler gauge's legend: the worker's name and its rank (metrics/stragglers.py).
STRAGGLER = "{{worker}} (rank {{rank}})"


def training_dashboard() -> dashboard_builders.Dashboard:
    """The paper's figures, live: loss (Fig. 1), median pi (Fig. 3), staleness, energies."""
    d = new_dashboard(
        "gemps-training",
        "gemps - training",
        "Is training converging, and how is GEM scaling the workers' updates? The paper's figures, live.",
    )
    d.with_row(dashboard_builders.Row("Loss and accuracy (paper Figure 1)"))
    d.with_panel(
        timeseries(
            "Training and held-out loss",
            "Training: mean mini-batch loss that workers report with their commits, over the rate window. "
            "Held-out: the evaluator's loss of the central variable on data no worker trains on.",
            [
                Query(mean_over_commits("gemps_training_loss"), "training (mean over commits)"),
                Query("gemps_heldout_loss", "held-out ({{dataset}})"),
            ],
            minimum=0,
        )
    )
    d.with_panel(
        timeseries(
            "Held-out accuracy",
            "Accuracy of the central variable on the evaluator's held-out data.",
            [Query("gemps_heldout_accuracy_ratio", "{{dataset}}")],
            unit="percentunit",
            maximum=1,
        )
    )
    d.with_panel(
        timeseries(
            "Learning rate eta",
            "eta at the current central version, from the server's learning-rate schedule (--lr-schedule, "
            "--lr-warmup-commits): what the next gradient commit is scaled by. Flat under the constant schedule.",
            [Query("gemps_learning_rate", "eta")],
            width=24,
            minimum=0,
        )
    )
    d.with_row(dashboard_builders.Row("GEM scaling factor pi (paper Figure 3)"))
    d.with_panel(
        timeseries(
            "Median pi",
            "GEM's per-parameter scaling pi: the median over parameters of each commit, averaged over "
            "the commits in the window (the paper's Figure 3), their median, and the mean pi. The median "
            "falls as workers are added; past ~10 workers it often reads 0, because pi is bimodal: see "
            "the next panel.",
            [
                Query(mean_over_commits("gemps_commit_median_scaling_factor"), "median pi (mean over commits)"),
                Query(quantile(0.5, "gemps_commit_median_scaling_factor"), "median pi (median over commits)"),
                Query(mean_over_commits("gemps_scaling_factor"), "mean pi"),
            ],
            minimum=0,
        )
    )
    d.with_panel(
        timeseries(
            "Parameters with pi at 0 and at pi_max",
            "Fraction of each commit's parameters whose pi sits at a clamp, averaged over commits: at 0 the "
            "other workers already moved that parameter by the proxy's energy, so this update is dropped; "
            "at pi_max (default 5) the update is amplified as far as allowed.",
            [Query(mean_over_commits("gemps_commit_clamped_ratio", "bound"), "pi at {{bound}}")],
            unit="percentunit",
            minimum=0,
            maximum=1,
        )
    )
    d.with_panel(
        timeseries(
            "Proxy vs central energy",
            "The two sides of GEM's compliance condition, mean over parameters and commits: proxy = "
            "kappa*|m_i|, the movement a single momentum-SGD worker would make; central = |theta - s_i| + "
            "pi*|Delta|, how far the central variable moved over the committing worker's round trip. GEM "
            "keeps central at proxy wherever pi is not clamped; central above proxy means the other "
            "workers already overshot. Empty for rules other than gem.",
            [Query(mean_over_commits("gemps_gem_energy", "side"), "{{side}}")],
            minimum=0,
        )
    )
    d.with_panel(
        heatmap_panel(
            "Mean pi per commit, distribution over time",
            "How many commits fell in each bucket of mean pi, per rate window.",
            Query(f"sum by (le) (increase(gemps_scaling_factor_bucket[{RATE}]))", "{{le}}", heatmap=True),
            unit="short",
        )
    )
    d.with_row(dashboard_builders.Row("Staleness"))
    d.with_panel(
        heatmap_panel(
            "Staleness distribution over time",
            "Commits per staleness bucket (tau: commits applied between the version a worker computed "
            "on and its own), per rate window. It grows with the number of workers.",
            Query(f"sum by (le) (increase(gemps_commit_staleness_bucket[{RATE}]))", "{{le}}", heatmap=True),
            unit="short",
        )
    )
    d.with_panel(
        timeseries(
            "Staleness: mean, p50, p99",
            "Staleness tau of applied commits, in updates.",
            [
                Query(mean_over_commits("gemps_commit_staleness"), "mean"),
                Query(quantile(0.5, "gemps_commit_staleness"), "p50"),
                Query(quantile(0.99, "gemps_commit_staleness"), "p99"),
            ],
            minimum=0,
        )
    )
    d.with_row(dashboard_builders.Row("Stragglers: the workers GEM damps"))
    damped = "The 5 workers whose commits the rule scaled down most over the last minute (rank 1: the lowest mean pi)"
    for title, description, metric in (
        (
            "Most damped workers: mean pi",
            f"{damped}: each one's mean pi. A worker whose commits arrive after the others moved theta many "
            "steps (a straggler: slow, far, or overloaded) finds the central movement above its proxy's "
            "energy, and GEM scales its updates to pi near 0: it computes, but barely trains.",
            "gemps_damped_worker_scaling",
        ),
        (
            "Most damped workers: staleness",
            f"{damped}: each one's mean staleness (commits applied between the version it computed on and "
            "its own). High staleness beside low pi is the straggler's signature.",
            "gemps_damped_worker_staleness",
        ),
        (
            "Slowest workers: commits per second",
            "The 5 workers with the fewest commits a second over the last minute (rank 1: the slowest; 0 for "
            "one registered but silent).",
            "gemps_slowest_worker_commits_per_second",
        ),
    ):
        d.with_panel(timeseries(title, description, [Query(metric, STRAGGLER)], width=8, minimum=0))
    rounds_row(d)
    return d


def rounds_row(d: dashboard_builders.Dashboard) -> None:
    """A rule of rounds' progress (adamw: metrics/rounds.py). Empty under the other rules (nothing
    exported): the row is collapsed and last, as the server dashboard's Replication row, so a stack
    of another rule shows no panel reading "No data"; a click on it opens it."""
    row = dashboard_builders.Row("Rounds (--rule adamw)")
    row.with_panel(
        timeseries(
            "Rounds closed per second",
            "A rule of rounds (adamw) closes a round at K commits and takes one AdamW step on their mean "
            "(one outer step on rounds of updates): the model's steps a second, where the central version counts "
            "commits.",
            [Query(f"rate(gemps_rounds_closed_total[{RATE}])", "rounds (steps) / s")],
            minimum=0,
        )
    )
    row.with_panel(
        timeseries(
            "Round size K and the commits the open round holds",
            "K: the commits a round closes at (--round-size, else the workers registered less --backup-workers, "
            "never more than those still committing; after a restart from a checkpoint the K it kept, until as "
            "many workers registered again), and the commits the open round holds. A gradient that "
            "arrives after its round closed (a straggler's, whose place a backup took) is dropped: pi at 0 in the "
            "row above.",
            [Query("gemps_round_size", "K"), Query("gemps_round_held", "held")],
            minimum=0,
        )
    )
    d.with_row(row)  # last: every panel is inside it, collapsed
