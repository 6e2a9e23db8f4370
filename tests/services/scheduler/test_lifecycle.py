"""The scheduler's pure rules on hand-computed cases: transitions, restart decisions and backoff, group
outcomes, queue order with aging, gang admission and preemption."""

from __future__ import annotations

import itertools

import pytest

from services.scheduler.lifecycle import (
    Demand,
    FailureClass,
    GroupVerdict,
    JobState,
    NodeFree,
    QueuedGroup,
    RecoveryPolicy,
    RunningGroup,
    Slot,
    TaskState,
    TaskView,
    TransitionError,
    admit,
    backoff_s,
    check_job_transition,
    check_task_transition,
    choose_preemption,
    classify_exit,
    decide_restart,
    effective_priority,
    gpu_type_matches,
    group_verdict,
    place_group,
    queue_order,
)


def test_job_transitions_follow_the_contract() -> None:
    path = [JobState.PENDING, JobState.STARTING, JobState.RUNNING, JobState.RECOVERING, JobState.STARTING]
    for old, new in itertools.pairwise(path):
        check_job_transition(old, new)
    check_job_transition(JobState.PENDING, JobState.CANCELLED)
    check_job_transition(JobState.RUNNING, JobState.CANCELLING)
    check_job_transition(JobState.CANCELLING, JobState.CANCELLED)
    for old, new in [
        (JobState.PENDING, JobState.RUNNING),
        (JobState.SUCCEEDED, JobState.RUNNING),
        (JobState.CANCELLING, JobState.RUNNING),
        (JobState.FAILED, JobState.CANCELLED),
    ]:
        with pytest.raises(TransitionError):
            check_job_transition(old, new)
    check_task_transition(TaskState.RUNNING, TaskState.STOPPED)
    with pytest.raises(TransitionError):
        check_task_transition(TaskState.CANCELLED, TaskState.RUNNING)


def test_failure_classes() -> None:
    assert classify_exit(3) is FailureClass.USER
    assert classify_exit(137) is FailureClass.USER
    assert classify_exit(None) is FailureClass.INFRA
    assert classify_exit(0, lost=True) is FailureClass.INFRA
    assert classify_exit(1, preempted=True) is FailureClass.PREEMPTED


def test_backoff_doubles_up_to_the_cap() -> None:
    policy = RecoveryPolicy(initial_backoff_s=10, max_backoff_s=35)
    assert [backoff_s(policy, n) for n in range(4)] == [10, 20, 35, 35]
    assert backoff_s(RecoveryPolicy(initial_backoff_s=0), 5) == 0


def test_restart_decisions_follow_the_recovery_policy() -> None:
    policy = RecoveryPolicy(
        max_restarts_on_errors=2, recover_on_exit_codes=frozenset({42}), initial_backoff_s=1
    )
    first = decide_restart(policy, FailureClass.USER, 1, budget_used=0, earlier_restarts=0)
    assert (first.restart, first.counts_against_budget, first.delay_s) == (True, True, 1)
    second = decide_restart(policy, FailureClass.INFRA, None, budget_used=1, earlier_restarts=1)
    assert (second.restart, second.counts_against_budget, second.delay_s) == (True, True, 2)
    spent = decide_restart(policy, FailureClass.USER, 1, budget_used=2, earlier_restarts=2)
    assert not spent.restart
    listed = decide_restart(policy, FailureClass.USER, 42, budget_used=2, earlier_restarts=5)
    assert (listed.restart, listed.counts_against_budget, listed.delay_s) == (True, False, 32)
    preempted = decide_restart(
        RecoveryPolicy(), FailureClass.PREEMPTED, None, budget_used=0, earlier_restarts=3
    )
    assert (preempted.restart, preempted.counts_against_budget, preempted.delay_s) == (True, False, 0)
    assert not decide_restart(policy, FailureClass.PRECHECK, 42, budget_used=0, earlier_restarts=0).restart
    assert not decide_restart(
        RecoveryPolicy(), FailureClass.USER, 1, budget_used=0, earlier_restarts=0
    ).restart


def test_primaries_decide_the_group() -> None:
    run, ok, bad = TaskState.RUNNING, TaskState.SUCCEEDED, TaskState.FAILED
    assert group_verdict([TaskView("a", run), TaskView("app", run, primary=False)]) is GroupVerdict.RUNNING
    assert group_verdict([TaskView("a", ok), TaskView("app", run, False)]) is GroupVerdict.STOP_AUXILIARIES
    assert (
        group_verdict([TaskView("a", ok), TaskView("app", TaskState.STOPPED, False)])
        is GroupVerdict.SUCCEEDED
    )
    assert group_verdict([TaskView("a", ok), TaskView("app", bad, False)]) is GroupVerdict.SUCCEEDED
    assert group_verdict([TaskView("a", run), TaskView("app", bad, False)]) is GroupVerdict.FAILED
    assert group_verdict([TaskView("a", bad), TaskView("b", ok)]) is GroupVerdict.FAILED


def group(
    job: str, priority: int, seq: int, gpus: int = 1, nodes: int = 1, since: float = 0.0
) -> QueuedGroup:
    return QueuedGroup(job, priority, since, seq, (Demand("main", nodes, gpus),))


def test_queue_order_priority_then_fifo_then_aging() -> None:
    queue = [group("low-old", 0, 1), group("high", 10, 3, since=100), group("high-older", 10, 2, since=100)]
    assert [g.job for g in queue_order(queue, now=100)] == ["high-older", "high", "low-old"]
    # After 400 s of waiting the priority-0 job has gained 400/30 > 10 points over jobs that just arrived.
    fresh = [group("low-old", 0, 1, since=0), group("high", 10, 3, since=400)]
    assert effective_priority(0, 0, 400) == pytest.approx(13.333, abs=1e-3)
    assert [g.job for g in queue_order(fresh, now=400)] == ["low-old", "high"]


def two_nodes() -> list[NodeFree]:
    return [NodeFree("n1", "10.0.0.1", [0, 1, 2, 3], 16, 64), NodeFree("n2", "10.0.0.2", [0, 1], 8, 32)]


def test_gang_placement_is_all_or_nothing_on_distinct_nodes() -> None:
    nodes = two_nodes()
    placement = place_group([Demand("trainer", 2, 2), Demand("app", 1, 0, cpus=4)], nodes)
    assert placement is not None
    assert {s.node for s in placement["trainer"]} == {"n1", "n2"}
    assert [s.rank for s in placement["trainer"]] == [0, 1]
    assert all(len(s.gpu_indices) == 2 for s in placement["trainer"])
    assert place_group([Demand("big", 2, 3)], nodes) is None  # n2 has only 2 GPUs
    assert place_group([Demand("many", 3, 0)], nodes) is None  # 3 distinct nodes needed
    assert place_group([Demand("a", 1, 4), Demand("b", 1, 4)], nodes) is None  # both want n1
    assert nodes[0].gpu_indices == [0, 1, 2, 3]  # the input is untouched


def test_a_gpu_type_matches_the_nodes_model_by_words_in_placement_as_in_the_check() -> None:
    # Nodes report the full model (nvidia-smi, GPU feature discovery); a spec names it as SkyPilot does.
    nodes = [NodeFree("h", "", list(range(8)), 64, 512, "NVIDIA-H100-80GB-HBM3")]
    placement = place_group([Demand("train", 1, 8, gpu_type="H100")], nodes)
    assert placement is not None and placement["train"][0].gpu_type == "H100"
    assert place_group([Demand("train", 1, 8, gpu_type="h100-80gb")], nodes) is not None
    assert place_group([Demand("train", 1, 8, gpu_type="H10")], nodes) is None
    assert place_group([Demand("train", 1, 8, gpu_type="A100")], nodes) is None
    assert place_group([Demand("cpu", 1, 0, gpu_type="")], nodes) is not None
    assert gpu_type_matches("H100", "NVIDIA-H100-80GB-HBM3") and not gpu_type_matches("H100", "A100")


def test_gpu_alternatives_take_the_first_choice_the_free_nodes_satisfy() -> None:
    nodes = [
        NodeFree("a", "", [0, 1, 2, 3], 32, 256, "NVIDIA-A100-SXM4-80GB"),
        NodeFree("l", "", [0, 1], 32, 256, "NVIDIA-L4"),
    ]
    # H100 first: no node has it, so A100:4 (the second) is taken, before L4:2 (the third).
    want = Demand("train", 1, 8, 8, 16, "H100", ((4, "A100"), (2, "L4")))
    placement = place_group([want], nodes)
    assert placement is not None
    (slot,) = placement["train"]
    assert (slot.node, slot.gpu_indices, slot.gpu_type) == ("a", (0, 1, 2, 3), "A100")
    # Two nodes wanted: only one node of each type, so no choice fits.
    assert place_group([Demand("train", 2, 8, 0, 0, "H100", ((4, "A100"), (2, "L4")))], nodes) is None
    # With the A100s taken by another task of the group, the same task falls to its L4 choice.
    group = [Demand("first", 1, 4, gpu_type="A100"), want]
    both = place_group(group, nodes)
    assert both is not None and both["train"][0].gpu_type == "L4" and both["train"][0].node == "l"
    # The first choice wins when it fits, even when a later one would fit more tightly.
    roomy = [NodeFree("big", "", list(range(8)), 64, 512, "H100"), *nodes]
    first = place_group([want], roomy)
    assert (
        first is not None and first["train"][0].gpu_type == "H100" and len(first["train"][0].gpu_indices) == 8
    )


def test_admission_takes_whole_groups_and_stops_at_the_first_that_waits() -> None:
    nodes = two_nodes()
    queue = [group("a", 5, 1, gpus=2), group("b", 5, 2, gpus=4), group("c", 0, 3, gpus=1)]
    result = admit(queue, nodes, now=0)
    assert [g.job for g, _ in result.admitted] == ["a", "b"]
    assert result.admitted[0][1]["main"][0].node == "n2"  # tightest fit leaves n1 whole for b
    assert result.blocked is not None and result.blocked.job == "c"
    assert nodes[0].gpu_indices == [] and nodes[1].gpu_indices == []
    again = admit([group("d", 9, 4, gpus=8), group("e", 0, 5, gpus=1)], two_nodes(), now=0)
    assert again.admitted == [] and again.blocked is not None and again.blocked.job == "d"


def running(job: str, priority: int, node: str, gpus: tuple[int, ...], start: float) -> RunningGroup:
    return RunningGroup(
        job, priority, start, {"main": (Slot(0, node, "", gpus),)}, (Demand("main", 1, len(gpus)),)
    )


def test_preemption_picks_the_cheapest_lower_priority_set() -> None:
    nodes = [NodeFree("n1", "", [], 16, 64), NodeFree("n2", "", [], 8, 32)]
    victims = [
        running("p0-n1", 0, "n1", (0, 1, 2, 3), start=1),
        running("p1-n2", 1, "n2", (0, 1), start=2),
        running("p9-n2", 9, "n2", (), start=3),
    ]
    chosen = choose_preemption(group("urgent", 5, 9, gpus=2), nodes, victims)
    assert chosen is not None and [v.job for v in chosen] == ["p0-n1"]
    assert choose_preemption(group("too-low", 0, 9, gpus=2), nodes, victims) is None
    assert choose_preemption(group("too-big", 5, 9, gpus=8), nodes, victims) is None
    both = choose_preemption(group("wide", 5, 9, gpus=2, nodes=2), nodes, victims)
    assert both is not None and sorted(v.job for v in both) == ["p0-n1", "p1-n2"]

    # While the chosen victim is still stopping, what it releases counts: nobody else is preempted.
    assert choose_preemption(group("urgent", 5, 9, gpus=2), nodes, victims[1:], releasing=victims[:1]) == []
    without = choose_preemption(group("urgent", 5, 9, gpus=2), nodes, victims[1:])  # would take one more
    assert without is not None and [v.job for v in without] == ["p1-n2"]


def test_preemptible_groups_come_after_every_other_whatever_their_priority_and_age() -> None:
    spot = QueuedGroup("spot-old-high", 900, 0.0, 1, (Demand("main", 1, 1),), preemptible=True)
    young = QueuedGroup("spot-young", 900, 500.0, 2, (Demand("main", 1, 1),), preemptible=True)
    queue = [spot, young, group("plain-low", 0, 3, since=1000)]
    assert [g.job for g in queue_order(queue, now=1000)] == ["plain-low", "spot-old-high", "spot-young"]
    result = admit(queue, [NodeFree("n1", "", [0], 8, 32)], now=1000)
    assert [g.job for g, _ in result.admitted] == ["plain-low"] and result.blocked is spot


def test_a_preemptible_group_is_preempted_first_even_by_a_lower_priority() -> None:
    nodes = [NodeFree("n1", "", [], 16, 64)]
    spot = RunningGroup(
        "spot", 900, 1.0, {"main": (Slot(0, "n1", "", (0, 1)),)}, (Demand("main", 1, 2),), preemptible=True
    )
    plain = running("plain-p0", 0, "n1", (2, 3), start=2)
    chosen = choose_preemption(group("needs-two", 1, 9, gpus=2), nodes, [spot, plain])
    assert chosen is not None and [v.job for v in chosen] == ["spot"]
    waiting_spot = QueuedGroup("other-spot", 1000, 0.0, 9, (Demand("main", 1, 2),), preemptible=True)
    among_spot = choose_preemption(waiting_spot, nodes, [spot])  # among spot groups, priorities rule
    assert among_spot is not None and [v.job for v in among_spot] == ["spot"]
    assert choose_preemption(waiting_spot, nodes, [plain]) is None  # never a group that is not preemptible
