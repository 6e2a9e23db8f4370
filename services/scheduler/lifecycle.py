"""The scheduler's rules as pure functions: states and their transitions, failure classes, restart
decisions, a group's outcome, queue order, gang admission and preemption. No I/O, no protobuf, no clock
(every function that needs the time takes `now`), so each rule is tested on hand-computed cases and the
engine (`engine.py`) only carries the decisions out.

Job states (the numbers are `tandem.scheduler.v1.Job.State`'s):

    PENDING ──admit──> STARTING ──all started──> RUNNING ──primaries exit 0──> SUCCEEDED
       │                  │  ▲                      │
       │                  │  └──backoff, admitted── RECOVERING <── failure the policy covers (PREEMPTED too)
       │                  └────────────┬────────────┘
       │                       failure beyond the policy ──> FAILED
       └── CancelJob ──> CANCELLED       any non-terminal ── CancelJob ──> CANCELLING ──all ended──> CANCELLED

Tasks mirror it with STOPPED added: an AUXILIARY task stopped after the primaries ended.
"""

from __future__ import annotations

import enum
import itertools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field


class JobState(enum.IntEnum):
    PENDING = 1
    STARTING = 2
    RUNNING = 3
    RECOVERING = 4
    CANCELLING = 5
    SUCCEEDED = 6
    FAILED = 7
    CANCELLED = 8


class TaskState(enum.IntEnum):
    PENDING = 1
    STARTING = 2
    RUNNING = 3
    RECOVERING = 4
    SUCCEEDED = 5
    FAILED = 6
    CANCELLED = 7
    STOPPED = 8


class FailureClass(enum.IntEnum):
    USER = 1  # the user's code or config: a non-zero exit, running over max_duration
    INFRA = 2  # the platform: node lost, backend error, a Tandem service failing the task
    PRECHECK = 3  # before `run`: setup failed, secret not opened, service never ready; never recovered
    PREEMPTED = 4  # the backend (or a higher-priority job) took the nodes back; always recovered


JOB_TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
TASK_TERMINAL = frozenset({TaskState.SUCCEEDED, TaskState.FAILED, TaskState.CANCELLED, TaskState.STOPPED})

JOB_TRANSITIONS: Mapping[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.STARTING, JobState.CANCELLED, JobState.FAILED}),
    JobState.STARTING: frozenset(
        {JobState.RUNNING, JobState.RECOVERING, JobState.FAILED, JobState.CANCELLING}
    ),
    JobState.RUNNING: frozenset(
        {JobState.SUCCEEDED, JobState.FAILED, JobState.RECOVERING, JobState.CANCELLING}
    ),
    JobState.RECOVERING: frozenset(
        {JobState.STARTING, JobState.FAILED, JobState.CANCELLING, JobState.CANCELLED}
    ),
    JobState.CANCELLING: frozenset({JobState.CANCELLED}),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}

TASK_TRANSITIONS: Mapping[TaskState, frozenset[TaskState]] = {
    TaskState.PENDING: frozenset({TaskState.STARTING, TaskState.CANCELLED, TaskState.FAILED}),
    TaskState.STARTING: frozenset(
        {
            TaskState.RUNNING,
            TaskState.RECOVERING,
            TaskState.SUCCEEDED,  # exited 0 before a poll saw it running
            TaskState.FAILED,
            TaskState.CANCELLED,
            TaskState.STOPPED,
        }
    ),
    TaskState.RUNNING: frozenset(
        {TaskState.SUCCEEDED, TaskState.FAILED, TaskState.RECOVERING, TaskState.CANCELLED, TaskState.STOPPED}
    ),
    TaskState.RECOVERING: frozenset({TaskState.STARTING, TaskState.FAILED, TaskState.CANCELLED}),
    # A group restart relaunches members that had already finished.
    TaskState.SUCCEEDED: frozenset({TaskState.RECOVERING}),
    TaskState.FAILED: frozenset(),
    TaskState.CANCELLED: frozenset(),
    TaskState.STOPPED: frozenset({TaskState.RECOVERING}),
}


class TransitionError(ValueError):
    """A state change the state machine does not allow: a bug in the caller, never a user error."""


def check_job_transition(old: JobState, new: JobState) -> None:
    if new not in JOB_TRANSITIONS[old]:
        raise TransitionError(f"job {old.name} -> {new.name} is not a transition")


def check_task_transition(old: TaskState, new: TaskState) -> None:
    if new not in TASK_TRANSITIONS[old]:
        raise TransitionError(f"task {old.name} -> {new.name} is not a transition")


# ---- failures and restarts --------------------------------------------------------------------------


def classify_exit(exit_code: int | None, *, lost: bool = False, preempted: bool = False) -> FailureClass:
    """Whose fault an ended attempt is: preemption, then a lost node or no exit code (INFRA), then the
    user's non-zero exit (a signal death too: the user's process was killed)."""
    if preempted:
        return FailureClass.PREEMPTED
    if lost or exit_code is None:
        return FailureClass.INFRA
    return FailureClass.USER


@dataclass(frozen=True)
class RecoveryPolicy:
    """The spec's RecoveryPolicy, parsed (durations in seconds, defaults filled in)."""

    max_restarts_on_errors: int = 0
    recover_on_exit_codes: frozenset[int] = frozenset()
    initial_backoff_s: float = 10.0
    max_backoff_s: float = 300.0
    group_scope: bool = True  # SCOPE_GROUP (default) restarts every task; SCOPE_TASK only the failed one


@dataclass(frozen=True)
class RestartDecision:
    restart: bool
    counts_against_budget: bool = False
    delay_s: float = 0.0
    why: str = ""


def backoff_s(policy: RecoveryPolicy, earlier_restarts: int) -> float:
    """`initial_backoff` before the first restart, doubled for each further one, capped at `max_backoff`."""
    if policy.initial_backoff_s <= 0:
        return 0.0
    exponent = min(earlier_restarts, 62)
    return float(min(policy.max_backoff_s, policy.initial_backoff_s * math.pow(2, exponent)))


def decide_restart(
    policy: RecoveryPolicy,
    failure: FailureClass,
    exit_code: int | None,
    budget_used: int,
    earlier_restarts: int,
) -> RestartDecision:
    """What the RecoveryPolicy says about one failure. PREEMPTED is always recovered, outside the budget
    and without backoff (the group waits for admission again); PRECHECK never; USER and INFRA are
    recovered outside the budget when the exit code is listed in `recover_on_exit_codes`, else while
    `budget_used < max_restarts_on_errors` (consuming one). `earlier_restarts` counts every restart so far
    (the backoff doubles per restart)."""
    if failure is FailureClass.PREEMPTED:
        return RestartDecision(True, False, 0.0, "preempted: always recovered")
    if failure is FailureClass.PRECHECK:
        return RestartDecision(False, why="precheck failures are never recovered")
    delay = backoff_s(policy, earlier_restarts)
    if exit_code is not None and exit_code in policy.recover_on_exit_codes:
        return RestartDecision(True, False, delay, f"exit code {exit_code} is in recover_on_exit_codes")
    if budget_used < policy.max_restarts_on_errors:
        used = budget_used + 1
        return RestartDecision(
            True, True, delay, f"restart {used} of max_restarts_on_errors {policy.max_restarts_on_errors}"
        )
    return RestartDecision(False, why=f"max_restarts_on_errors ({policy.max_restarts_on_errors}) is spent")


# ---- a group's outcome ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskView:
    name: str
    state: TaskState
    primary: bool = True


class GroupVerdict(enum.Enum):
    RUNNING = "running"  # keep going
    STOP_AUXILIARIES = "stop_auxiliaries"  # every primary ended well; stop helpers after their delay
    SUCCEEDED = "succeeded"  # every primary succeeded and every auxiliary ended
    FAILED = "failed"  # a primary failed (or an auxiliary while a primary still ran)


def group_verdict(tasks: Sequence[TaskView]) -> GroupVerdict:
    """Primaries decide: any failed primary fails the group; an auxiliary's failure counts only while a
    primary is still running; once every primary succeeded the auxiliaries are stopped, and the group
    succeeds when they have all ended."""
    primaries = [t for t in tasks if t.primary]
    auxiliaries = [t for t in tasks if not t.primary]
    if any(t.state is TaskState.FAILED for t in primaries):
        return GroupVerdict.FAILED
    primaries_done = all(t.state is TaskState.SUCCEEDED for t in primaries)
    if not primaries_done and any(t.state is TaskState.FAILED for t in auxiliaries):
        return GroupVerdict.FAILED
    if not primaries_done:
        return GroupVerdict.RUNNING
    if all(t.state in TASK_TERMINAL for t in auxiliaries):
        return GroupVerdict.SUCCEEDED
    return GroupVerdict.STOP_AUXILIARIES


def job_state_for_tasks(states: Iterable[TaskState]) -> JobState:
    """STARTING until every task has started, then RUNNING (used while the group is live)."""
    live = [s for s in states if s not in TASK_TERMINAL]
    if any(s in (TaskState.PENDING, TaskState.STARTING, TaskState.RECOVERING) for s in live):
        return JobState.STARTING
    return JobState.RUNNING


# ---- queue order ------------------------------------------------------------------------------------

AGING_S_PER_POINT = 30.0  # a waiting job gains one priority point per 30 s, so nothing starves
# The most combinations of GPU alternatives one placement tries (a pass stays short for any group).
MAX_CHOICE_COMBINATIONS = 256


def effective_priority(
    priority: int, waiting_since: float, now: float, aging_s: float = AGING_S_PER_POINT
) -> float:
    """The priority a queued job is ordered by: its own plus one point per `aging_s` of waiting."""
    if aging_s <= 0:
        return float(priority)
    return priority + max(0.0, now - waiting_since) / aging_s


@dataclass(frozen=True)
class Demand:
    """What one task of a group needs: `num_nodes` distinct nodes with these resources each."""

    task: str
    num_nodes: int = 1
    gpus: int = 0
    cpus: float = 0.0
    memory_gib: float = 0.0
    gpu_type: str = ""
    # SkyPilot's accelerator alternatives after the first (`gpus`, `gpu_type`), in order of preference:
    # (count, type) each. Placement takes the first choice the free nodes satisfy.
    alternatives: tuple[tuple[int, str], ...] = ()

    def choices(self) -> list[Demand]:
        """This demand, then one per alternative (its GPUs and type, the same CPUs and memory)."""
        return [self] + [
            Demand(self.task, self.num_nodes, gpus, self.cpus, self.memory_gib, gpu_type)
            for gpus, gpu_type in self.alternatives
        ]


def gpu_type_matches(wanted: str, node_type: str) -> bool:
    """True when a node's GPU model is the requested one, SkyPilot's meaning of an accelerator name:
    case-insensitive, and the request's words appear in order in the node's (`H100` matches
    `NVIDIA-H100-80GB-HBM3`; `H100-80GB` matches it too; `H10` does not). An empty request matches any."""
    if not wanted:
        return True
    want, have = _words(wanted), _words(node_type)
    return any(have[i : i + len(want)] == want for i in range(len(have) - len(want) + 1))


def _words(text: str) -> list[str]:
    return [w for w in re.split(r"[^a-z0-9]+", text.lower()) if w]


@dataclass(frozen=True)
class QueuedGroup:
    """A job waiting for admission (PENDING, or RECOVERING with its backoff over)."""

    job: str
    priority: int
    waiting_since: float
    seq: int  # creation order, the FIFO tie-break
    demands: tuple[Demand, ...]
    preemptible: bool = False  # SkyPilot's use_spot: after every group that is not, whatever its age


def queue_order(
    queue: Iterable[QueuedGroup], now: float, aging_s: float = AGING_S_PER_POINT
) -> list[QueuedGroup]:
    """Groups that are not preemptible first; then highest effective priority first; FIFO (creation order)
    within a priority. Aging orders preemptible groups among themselves, never past another group."""
    return sorted(
        queue,
        key=lambda g: (g.preemptible, -effective_priority(g.priority, g.waiting_since, now, aging_s), g.seq),
    )


# ---- gang admission ---------------------------------------------------------------------------------


@dataclass
class NodeFree:
    """What the scheduler may still place on one node: free GPU indices, CPUs and memory."""

    name: str
    address: str = ""
    gpu_indices: list[int] = field(default_factory=list)
    cpus: float = 0.0
    memory_gib: float = 0.0
    gpu_type: str = ""
    up: bool = True

    def fits(self, demand: Demand) -> bool:
        return (
            self.up
            and len(self.gpu_indices) >= demand.gpus
            and self.cpus + 1e-9 >= demand.cpus
            and self.memory_gib + 1e-9 >= demand.memory_gib
            and (not demand.gpus or gpu_type_matches(demand.gpu_type, self.gpu_type))
        )

    def copy(self) -> NodeFree:
        return NodeFree(
            self.name,
            self.address,
            list(self.gpu_indices),
            self.cpus,
            self.memory_gib,
            self.gpu_type,
            self.up,
        )


@dataclass(frozen=True)
class Slot:
    """One node rank of a task as placed: the node and the GPU indices it gets there."""

    rank: int
    node: str
    address: str
    gpu_indices: tuple[int, ...]
    gpu_type: str = ""  # the GPU type of the accelerator choice placed ("" when the task named none)


Placement = dict[str, tuple[Slot, ...]]  # task -> its slots by rank


def place_group(demands: Sequence[Demand], nodes: Sequence[NodeFree]) -> Placement | None:
    """Place every task of a group at once or not at all. Each task takes `num_nodes` distinct nodes
    (tasks may share nodes); the biggest demands go first, each on the nodes that fit it most tightly
    (fewest GPUs left over), which leaves whole nodes free for later gangs. Tasks with GPU alternatives
    take the first choices, in their order, with which the whole group fits: the combinations are tried
    from every task's first choice on, the group's earlier tasks changing last, at most
    `MAX_CHOICE_COMBINATIONS` of them (the slots say what was taken: their GPU count and `gpu_type`).
    `nodes` is left unchanged; None when the group does not fit now."""
    choices = [d.choices() for d in demands]
    for chosen in itertools.islice(itertools.product(*choices), MAX_CHOICE_COMBINATIONS):
        placement = _place_chosen(chosen, nodes)
        if placement is not None:
            return placement
    return None


def _place_chosen(demands: Sequence[Demand], nodes: Sequence[NodeFree]) -> Placement | None:
    free = {n.name: n.copy() for n in nodes}
    placement: Placement = {}
    order = sorted(
        demands, key=lambda d: (-(d.gpus * max(d.num_nodes, 1)), -d.cpus * max(d.num_nodes, 1), d.task)
    )
    for demand in order:
        count = max(demand.num_nodes, 1)
        candidates = [n for n in free.values() if n.fits(demand)]
        if len(candidates) < count:
            return None
        candidates.sort(key=lambda n: (len(n.gpu_indices) - demand.gpus, n.cpus - demand.cpus, n.name))
        slots = []
        for rank, node in enumerate(candidates[:count]):
            taken = tuple(sorted(node.gpu_indices)[: demand.gpus])
            node.gpu_indices = [i for i in node.gpu_indices if i not in taken]
            node.cpus -= demand.cpus
            node.memory_gib -= demand.memory_gib
            slots.append(Slot(rank, node.name, node.address, taken, demand.gpu_type))
        placement[demand.task] = tuple(slots)
    return placement


def take(nodes: Sequence[NodeFree], placement: Placement, demands: Sequence[Demand]) -> None:
    """Subtract a placement from `nodes` in place."""
    by_name = {n.name: n for n in nodes}
    by_task = {d.task: d for d in demands}
    for task, slots in placement.items():
        demand = by_task[task]
        for slot in slots:
            node = by_name[slot.node]
            node.gpu_indices = [i for i in node.gpu_indices if i not in slot.gpu_indices]
            node.cpus -= demand.cpus
            node.memory_gib -= demand.memory_gib


def give_back(nodes: Sequence[NodeFree], placement: Placement, demands: Sequence[Demand]) -> None:
    """Add a placement's resources back to `nodes` in place (a released job)."""
    by_name = {n.name: n for n in nodes}
    by_task = {d.task: d for d in demands}
    for task, slots in placement.items():
        demand = by_task.get(task)
        if demand is None:
            continue
        for slot in slots:
            node = by_name.get(slot.node)
            if node is None:
                continue
            node.gpu_indices = sorted({*node.gpu_indices, *slot.gpu_indices})
            node.cpus += demand.cpus
            node.memory_gib += demand.memory_gib


@dataclass(frozen=True)
class Admission:
    admitted: list[tuple[QueuedGroup, Placement]]
    blocked: QueuedGroup | None  # the first group that did not fit: everything behind it waits


def admit(
    queue: Iterable[QueuedGroup], nodes: Sequence[NodeFree], now: float, aging_s: float = AGING_S_PER_POINT
) -> Admission:
    """One admission pass: groups in queue order, each admitted whole when it fits what is left. The first
    group that does not fit stops the pass (strict order: a big group is never starved by small ones
    slipping past it; aging keeps low priorities from starving behind a stream of high ones). `nodes` is
    updated in place with what the admitted groups took."""
    admitted: list[tuple[QueuedGroup, Placement]] = []
    for group in queue_order(queue, now, aging_s):
        placement = place_group(group.demands, nodes)
        if placement is None:
            return Admission(admitted, group)
        take(nodes, placement, group.demands)
        admitted.append((group, placement))
    return Admission(admitted, None)


# ---- preemption -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunningGroup:
    """A live job holding resources, as a preemption candidate."""

    job: str
    priority: int
    start_time: float
    placement: Placement
    demands: tuple[Demand, ...]
    preemptible: bool = False  # SkyPilot's use_spot: any group that is not may preempt it

    @property
    def gpus(self) -> int:
        return sum(len(s.gpu_indices) for slots in self.placement.values() for s in slots)


def _below(running: RunningGroup, group: QueuedGroup) -> bool:
    if running.preemptible != group.preemptible:
        return running.preemptible
    return running.priority < group.priority


def choose_preemption(
    group: QueuedGroup,
    nodes: Sequence[NodeFree],
    running: Sequence[RunningGroup],
    releasing: Sequence[RunningGroup] = (),
) -> list[RunningGroup] | None:
    """The cheapest set of running groups below `group` whose release lets it fit, or None. Below means a
    strictly lower priority, or preemptible where `group` is not (SkyPilot's spot placement).
    Cheapest means lowest priorities first, then the fewest GPUs, then the most recently started (the
    least work lost); after the greedy pick, victims not needed for the fit are spared again. What the
    `releasing` groups (already being stopped) hold counts as free: when that is enough the answer is no
    victim at all, so a group waiting for its victims to exit never preempts more of them."""
    if releasing:
        freed = [n.copy() for n in nodes]
        for other in releasing:
            give_back(freed, other.placement, other.demands)
        if place_group(group.demands, freed) is not None:
            return []
        nodes = freed
    candidates = sorted(
        (r for r in running if _below(r, group)),
        key=lambda r: (not r.preemptible, r.priority, r.gpus, -r.start_time, r.job),
    )
    if not candidates:
        return None
    trial = [n.copy() for n in nodes]
    chosen: list[RunningGroup] = []
    for victim in candidates:
        give_back(trial, victim.placement, victim.demands)
        chosen.append(victim)
        if place_group(group.demands, trial) is not None:
            break
    else:
        return None
    for victim in sorted(chosen, key=lambda r: (-r.priority, -r.gpus, r.start_time)):
        rest = [r for r in chosen if r is not victim]
        spared = [n.copy() for n in nodes]
        for other in rest:
            give_back(spared, other.placement, other.demands)
        if place_group(group.demands, spared) is not None:
            chosen = rest
    return chosen
