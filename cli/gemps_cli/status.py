"""`gemps status`: a running server's state, for humans.

What a server says is shown, never obeyed: with `--server 'A|B'` (a replicated partition) each
address given is tried in order until one answers; the primary a backup names is asked only when
it is one of the addresses the user gave for that partition (another partition's: those partition
0's layout announces, which the client reaches anyway), so the token goes nowhere else; and every
line is printed with its control characters (terminal escape sequences among them) removed, as a
server's strings are its own to choose (issue 41, item 7).
"""

from __future__ import annotations

import argparse
import re
import sys

from gemps.client import Client
from gemps.errors import GempsError
from gemps.records import ReplicationStatus, ServerStatus, WorkerStatus
from gemps.resolver import REPLICA_SEPARATOR
from gemps.retry import NO_RETRY
from gemps.router import resolve_address
from gemps_cli.connection import add_connection_flags, connect
from gemps_proto import rule_options, schedules, versions
from gemps_proto.status import PRIMARY, RecentCommits, Rounds, most_damped, slowest


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--server",
        default="127.0.0.1:50051",
        help="HOST:PORT (default 127.0.0.1:50051); a replicated partition's replicas as 'HOST:PORT|HOST:PORT' "
        "(each tried in order until one answers)",
    )
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the server")
    add_connection_flags(parser)
    parser.set_defaults(run=run)


# Workers listed at most: the quietest first, which are the ones a reader looks for.
MAX_WORKERS_LISTED = 20
# Stragglers named at most, in each ranking (most damped, slowest): the few an operator looks at.
STRAGGLERS_NAMED = 3

# An escape sequence (CSI, OSC/DCS/SOS/PM/APC strings, in their 7- or 8-bit form, up to their terminator, or ESC and one
# character), then any other C0 or C1 control character or DEL: none of it reaches the terminal.
_CONTROL = re.compile(
    r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]?"
    r"|(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f]).*?(?:\x07|\x1b\\|\x9c|$)"
    r"|\x1b.?"
    r"|[\x00-\x1f\x7f-\x9f]",
    re.DOTALL,
)


def printable(text: str) -> str:
    """`text` without control characters: a server's strings cannot move the cursor, retitle
    the terminal or hide what is printed after them."""
    return _CONTROL.sub("", text)


def say(line: str = "", *, error: bool = False) -> None:
    """Print one line, stripped of control characters (printable)."""
    print(printable(line), file=sys.stderr if error else sys.stdout)


def schedule_line(status: ServerStatus) -> str:
    """The schedule and the settings it reads: 'cosine schedule: lr_total_commits=10000 lr_min=0',
    never a setting of another schedule (lr_gamma under cosine)."""
    settings = schedules.schedule_settings(status.config)
    listed = " ".join(f"{name}={schedules.setting_text(value)}" for name, value in settings.items())
    return f"{status.config.lr_schedule or schedules.CONSTANT} schedule" + (f": {listed}" if listed else "")


def rate_use_line(status: ServerStatus) -> str:
    """What η scales: every rule turns a gradient g into -η·g and takes an update commit as given
    (gemps_server.domain.rules.base), so under DOWNPOUR an update of +1 moves θ by 1 whatever η;
    a rule of rounds (adamw) takes AdamW's step at η on each round's mean, or with an outer rate
    closes its rounds of updates at that rate, η unused."""
    options, rule = status.config.rule_options, status.config.rule
    if options.get(rule_options.OUTER_RATE, 0.0) > 0:
        outer = options[rule_options.OUTER_RATE]
        return (
            f"unused: rule {rule} takes update commits alone, each round's mean moved by its outer step "
            f"(outer_rate {outer:g}), and refuses gradients"
        )
    if rule_options.ROUND_SIZE in options:
        return (
            f"AdamW's rate in rule {rule}: one step on the mean of each round's commits (a gradient as it is, "
            "an update commit as its pseudo-gradient -update)"
        )
    return (
        "multiplies gradient commits only: an update commit (LocalSteps, a worker's local steps) reaches rule "
        f"{rule} without it"
    )


def rounds_line(rounds: Rounds, recent: RecentCommits) -> str:
    """A rule of rounds' progress: its steps (the rounds closed), the open round, and the share of
    the recent commits that came after their round closed (a straggler's, whose place a backup took)."""
    late = recent.scaling_at_zero if recent.commits else 0.0  # each such commit is scaled by 0 throughout
    dropped = (
        f"; {late:.0%} of the commits of the last {_age(recent.seconds)} came after their round closed and were "
        "dropped (a backup's place)"
        if late
        else ""
    )
    return f"{rounds.closed} closed, a step each; the open one holds {rounds.held} of {rounds.size} commits{dropped}"


def reach(args: argparse.Namespace) -> tuple[Client, ServerStatus, str]:
    """A client of the first address given that answers Status, that Status and the address;
    GempsError naming each address's failure when none answers."""
    failures = []
    for address in args.server.split(REPLICA_SEPARATOR):
        client = connect(argparse.Namespace(**{**vars(args), "server": address}), args.timeout, NO_RETRY)
        try:
            return client, client.status(), address
        except GempsError as error:
            failures.append(f"{address}: {error}")
            client.close()
    raise GempsError("; ".join(failures))


def run(args: argparse.Namespace) -> int:
    unreachable = ""
    try:
        client, first, reached = reach(args)
    except GempsError as error:
        say(f"gemps status: {error}", error=True)
        return 1
    try:
        try:
            statuses = client.statuses() if first.layout is not None else [first]
        except GempsError as error:  # e.g. through a port-forward to partition 0 alone
            statuses, unreachable = [first], str(error)
    finally:
        client.close()
    statuses, asked = primaries_views(args, statuses, given_replicas(args.server, reached, first))
    status = statuses[0]
    config = status.config.as_dict().items()  # the schedule's own settings are on the learning rate's line
    settings = " ".join(f"{k}={v:g}" for k, v in config if type(v) is float and k not in schedules.ALL_FIELDS)
    answered = f" (answered: {reached})" if reached != args.server else ""
    say(f"server          {args.server}{answered}")
    say(f"software        {(status.versions or versions.LEGACY).describe()}")
    say(f"initialized     {status.initialized}")
    if status.job:  # which job's θ: a worker follows only servers that name it (DESIGN §3)
        say(f"job             {status.job}")
    say(f"version         {status.version}")
    if status.restored is not None:  # a stack started over an old checkpoints volume trains on from it
        say(f"restored        version {status.restored.version} from {status.restored.path}, when this server started")
    lease = f" (each evicted after {status.lease_ttl_seconds:g}s unseen)" if status.lease_ttl_seconds else ""
    say(f"active workers  {status.active_workers}{lease}")
    parameters = status.layout.num_parameters if status.layout is not None else status.num_parameters
    say(f"parameters      {parameters} in {len(status.spec)} tensors")
    if status.buffer_spec:
        say(f"buffers         {sum(entry.size for entry in status.buffer_spec)} in {len(status.buffer_spec)} tensors")
    say(f"commits         {status.commits_applied} applied, {status.commits_rejected} rejected")
    say(f"commit rate     {rate_line(status)}")
    say(f"training loss   {status.recent.describe_loss()}")
    say(f"held-out        {held_out_line(status)}")
    say(f"rule state      {memory_line(status)}")
    if status.gem_state:
        say(f"GEM state       {gem_state_line(status)}")
    say(f"rule            {status.config.rule} ({settings})")
    say(f"learning rate   {status.learning_rate:g} now ({schedule_line(status)})")
    say(f"                {rate_use_line(status)}")
    if status.rounds is not None:
        say(f"rounds          {rounds_line(status.rounds, status.recent)}")
    # Partitions' sums add up to the whole of θ's; with some partitions unreachable, partition 0's slice only.
    noise = client.gradient_noise(statuses).describe(status.active_workers)
    what = noise.removeprefix("noise scale").lstrip(":").strip()
    say(f"noise scale     {what}" + (" (partition 0's slice)" if unreachable else ""))
    say(f"uptime          {status.uptime_seconds:.0f}s")
    if unreachable:
        say(
            f"partitions      {len(status.layout.partitions) if status.layout else 1}, not all reachable from "
            f"here ({unreachable}): the figures above are partition 0's"
        )
    elif status.layout is not None:  # θ is partitioned: the figures above are partition 0's
        say(f"partitions      {len(statuses)} (figures above: partition 0's)")
        for index, (part, where) in enumerate(zip(statuses, client.targets, strict=True)):
            assert part.layout is not None
            share = part.layout.partitions[index]
            say(
                f"  {index}  {where:<21} values {share.start}..{share.stop - 1}  version {part.version}  "
                f"workers {part.active_workers}  commits {part.commits_applied} applied, "
                f"{part.commits_rejected} rejected"
            )
    print_replication(statuses, asked)
    print_stragglers(status.workers, partitioned=status.layout is not None)
    print_workers(status.workers, partitioned=status.layout is not None)
    return 0


def rate_line(status: ServerStatus) -> str:
    """The server's commits of the last minute: "12.5/s over the last 60s (400 samples/s)"."""
    recent = status.recent
    if recent.seconds <= 0:
        return "not reported (a server older than this client)"
    samples = f" ({_figure(recent.samples / recent.seconds)} samples/s)" if recent.samples else ""
    staleness = _figure(recent.staleness)
    return f"{_figure(recent.rate)}/s over the last {_age(recent.seconds)}{samples}, mean staleness {staleness}"


def held_out_line(status: ServerStatus) -> str:
    """The last evaluation an evaluator reported: its loss, accuracy and the version it measured."""
    evaluation = status.last_evaluation
    if evaluation is None:
        return "none reported (an evaluator reports them: gemps evaluate)"
    dataset = f" of {evaluation.dataset}" if evaluation.dataset else ""
    return (
        f"loss {evaluation.loss:.4g}, accuracy {100 * evaluation.accuracy:.1f}% at version {evaluation.version} "
        f"({status.version - evaluation.version} commits ago), on {evaluation.num_samples} samples{dataset}"
    )


def memory_line(status: ServerStatus) -> str:
    """The workers' rule state against the memory budget: "1.0 GiB of a 4.0 GiB budget (25%)"."""
    used = _bytes(status.rule_state_bytes)
    budget = status.memory_budget_bytes
    if not budget:
        return f"{used} (no memory budget: not initialised, or no limit found)"
    share = f"{100 * status.rule_state_bytes / budget:.0f}%"
    return f"{used} of a {_bytes(budget)} memory budget ({share}; raise it with --memory-budget-mb)"


#: the fleet `gemps status` says the memory of, beside the one registered now
FLEET = 100


def gem_state_line(status: ServerStatus) -> str:
    """How GEM keeps each worker's state and what it costs: "compact, 2.25 bytes per worker per
    parameter (20.0 MiB a worker; 80.0 MiB shared); 100 workers: 2.0 GiB"."""
    each, shared = status.worker_state_bytes, status.shared_rule_state_bytes
    if not status.num_parameters:
        return f"{status.gem_state} (no model yet)"
    per_parameter = f"{each / status.num_parameters:.2f} bytes per worker per parameter"
    besides = f"; {_bytes(shared)} shared" if shared else ""
    fleet = f"{FLEET} workers: {_bytes(FLEET * each + shared)}"
    return f"{status.gem_state}, {per_parameter} ({_bytes(each)} a worker{besides}); {fleet}"


def _bytes(count: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"


def given_replicas(given: str, reached: str, first: ServerStatus) -> list[set[str]]:
    """The addresses of each partition's replicas the status may send credentials to: partition
    0's, those the user gave; another's, those partition 0's layout announces (the client reaches
    that partition there anyway; a backup's word is never enough)."""
    trusted = [set(given.split(REPLICA_SEPARATOR))]
    if first.layout is not None:
        for partition in first.layout.partitions[1:]:
            try:
                trusted.append(set(resolve_address(partition.address, reached).split(REPLICA_SEPARATOR)))
            except ValueError:
                trusted.append(set())
    return trusted


def primaries_views(
    args: argparse.Namespace, statuses: list[ServerStatus], trusted: list[set[str]]
) -> tuple[list[ServerStatus], list[str]]:
    """Each replicated partition as its primary sees it (its backups' lag, under-replication):
    where the address given reached a backup that names its primary, the primary is asked, if it
    is one of that partition's `trusted` addresses. With the primary's address for each partition
    it asked ("": none asked, or it did not answer)."""
    views, asked = list(statuses), [""] * len(statuses)
    for index, status in enumerate(statuses):
        replication = status.replication
        if replication is None or replication.role == PRIMARY or not replication.primary:
            continue
        if index >= len(trusted) or replication.primary not in trusted[index]:
            continue  # an address no one gave: the backup's own view, which names it
        there = argparse.Namespace(**{**vars(args), "server": replication.primary})
        try:
            with connect(there, args.timeout, NO_RETRY) as primary:
                view = primary.status()
        except GempsError:
            continue  # the backup's own view, which names the primary it follows
        if view.replication is not None and view.replication.role == PRIMARY:
            views[index], asked[index] = view, replication.primary
    return views, asked


def print_replication(statuses: list[ServerStatus], asked: list[str]) -> None:
    """Each replicated partition's replica that answered (its primary, when `asked` names it): its
    role and epoch; on a primary, the live replicas against R and each backup's lag; on a backup,
    the primary it follows."""
    if all(status.replication is None for status in statuses):
        return
    if len(statuses) == 1:
        head, *backups = replication_lines(statuses[0].replication)
        say(f"replication     {head}{_asked(asked[0])}")
        for line in backups:
            say(f"  {line}")
        return
    say("replication     by partition (the replica each partition's address reached, or its primary)")
    for index, status in enumerate(statuses):
        head, *backups = replication_lines(status.replication)
        say(f"  {index}  {head}{_asked(asked[index])}")
        for line in backups:
            say(f"       {line}")


def _asked(primary: str) -> str:
    return f" (at {primary}: the address given reached a backup)" if primary else ""


def replication_lines(replication: ReplicationStatus | None) -> list[str]:
    """A head line for the replica, then one line per backup (a primary's)."""
    if replication is None:
        return ["not replicated"]
    r = replication
    if r.role != PRIMARY:
        follows = f"follows {r.primary}" if r.primary else "no primary known"
        head = f"{r.role} {r.name}, epoch {r.epoch}, {follows} ({r.replicas} replicas configured)"
        return [head, f"UNAVAILABLE: {r.unavailable}"] if r.unavailable else [head]
    under = " UNDER-REPLICATED" if r.under_replicated else ""
    head = f"primary {r.name}, epoch {r.epoch}, {r.live}/{r.replicas} replicas live{under}"
    stalled = [f"UNAVAILABLE: {r.unavailable}"] if r.unavailable else []  # the in-sync set's floor
    return [head, *stalled] + [
        f"backup {backup.name:<16} {'in sync' if backup.in_sync else 'OUT OF SYNC':<11}  "
        f"lag {backup.lag_commits} commits, {_age(backup.lag_seconds)}"
        for backup in r.backups
    ]


def print_workers(workers: tuple[WorkerStatus, ...], *, partitioned: bool = False) -> None:
    """One line per registered worker, the longest unseen first: a worker that ended without
    leaving stays registered until its lease expires, and shows here as not seen for a while."""
    if not workers:
        return
    say("workers         the longest unseen first" + (" (partition 0's)" if partitioned else ""))
    quietest = sorted(workers, key=lambda worker: -worker.seconds_since_seen)
    for worker in quietest[:MAX_WORKERS_LISTED]:
        recent = worker.recent
        say(
            f"  shard {worker.shard:<4} {worker.name or '(no name)':<16} last seen {_age(worker.seconds_since_seen)} "
            f"ago, last commit {_age(worker.seconds_since_commit)} ago, {worker.commits} commits, "
            f"{_figure(recent.rate)}/s, staleness {_figure(recent.staleness)}, {scaling_line(recent)} "
            f"(last {_age(recent.seconds)})"
        )
    if len(quietest) > MAX_WORKERS_LISTED:
        rest = quietest[MAX_WORKERS_LISTED:]
        say(f"  and {len(rest)} more, each seen within {_age(rest[0].seconds_since_seen)}")


def print_stragglers(workers: tuple[WorkerStatus, ...], *, partitioned: bool = False) -> None:
    """The workers the rule scaled down most and those committing least over the last minute:
    a straggler whose commits GEM damps to π near 0 learns nothing and shows first here."""
    damped, slow = most_damped(workers, STRAGGLERS_NAMED), slowest(workers, STRAGGLERS_NAMED)
    if not slow:
        return
    whose = " (partition 0's π)" if partitioned else ""
    if damped:
        named = "; ".join(f"{w.name or '(no name)'} {straggler_line(w.recent)}" for w in damped)
        say(f"most damped     {named}{whose}")
    named = "; ".join(f"{w.name or '(no name)'} {_figure(w.recent.rate)}/s" for w in slow)
    say(f"slowest         {named}")


def straggler_line(recent: RecentCommits) -> str:
    """A damped worker as the stragglers line names it: "π 0.02 (96% at 0, 0% at max), staleness 41"."""
    return f"{scaling_line(recent)}, staleness {_figure(recent.staleness)}"


def scaling_line(recent: RecentCommits) -> str:
    """How the rule scaled a worker's commits of the last minute: "π 0.02 (96% at 0, 0% at max)"."""
    if not recent.commits:
        return "π -"
    zero, most = 100 * recent.scaling_at_zero, 100 * recent.scaling_at_max
    return f"π {_figure(recent.scaling_mean)} ({zero:.0f}% at 0, {most:.0f}% at max)"


def _figure(value: float) -> str:
    """Three significant digits, without an exponent below a million: "0.25", "12.5", "1234"."""
    return f"{value:.3g}" if value < 1000 else f"{value:.0f}"


def _age(seconds: float) -> str:
    return f"{seconds:.1f}s" if seconds < 10 else f"{seconds:.0f}s"
