"""One OpenTelemetry trace follows a step's rollouts across processes: `python -m trainer` → the embedded mesh's
taskapp-proxy (a process of its own) → the example Task App's own process → its policy calls to the inference
worker's process. With no collector configured the trainer's process, its mesh and the Task App it starts write
their spans to TANDEM_TRACE_FILE, the worker to the traces.jsonl of its state folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

JOB = """
seed = 1
checkpoint_interval = 100
[model]
dir = "{model}"
[model.build]
layers = 1
[task_app]
name = "orgs/demo/taskApps/single-turn"
[data.train]
seeds = [{{start = 0, end = 100}}]
[algorithm]
group_size = 2
prompts_per_step = 2
steps = 1
[optimizer]
learning_rate = 1e-3
[sampling]
max_tokens = 1
"""


SERVICES = {
    "tandem-trainer": "trainer",
    "tandem-events+vault+taskapp_proxy": "mesh",
    "taskapp-copy-letter": "taskapp",
    "tandem-inference": "worker",
}


def spans_in(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_rollout_is_one_trace_from_the_trainer_to_the_worker(tmp_path: Path) -> None:
    config = tmp_path / "job.toml"
    config.write_text(JOB.format(model=tmp_path / "model"))
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "OTEL_"))}
    # The trainer's process, its mesh and the Task App it starts share this file; each inference worker writes
    # the one in its own state folder.
    env["TANDEM_TRACE_FILE"] = str(tmp_path / "traces.jsonl")
    done = subprocess.run(
        [sys.executable, "-m", "trainer", "--config", str(config), "--output", str(out), "--gpus", "0"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr

    by_process: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(tmp_path.glob("**/traces.jsonl")):
        for span in spans_in(path):
            service = span["resource"]["attributes"]["service.name"]
            by_process.setdefault(SERVICES.get(service, service), []).append(span)
    assert set(SERVICES.values()) <= set(by_process), sorted(by_process)
    roots = [s for s in by_process["trainer"] if s["name"] == "trainer.rollouts"]
    assert len(roots) == 1, [s["name"] for s in by_process["trainer"]]
    trace_id = roots[0]["context"]["trace_id"]
    chain = {
        name: [s for s in spans if s["context"]["trace_id"] == trace_id] for name, spans in by_process.items()
    }
    every = [s for spans in chain.values() for s in spans]
    ids = {s["context"]["span_id"] for s in every}
    orphans = [s["name"] for s in every if s["parent_id"] is not None and s["parent_id"] not in ids]
    assert not orphans, orphans
    assert [s["name"] for s in every if s["parent_id"] is None] == ["trainer.rollouts"]

    names = {name: {s["name"] for s in spans} for name, spans in chain.items()}
    assert {"trainer.rollouts", "/tandem.taskapp.v1.TaskAppService/StreamRollouts"} <= names["trainer"]
    assert {"/tandem.taskapp.v1.TaskAppService/StreamRollouts", "taskapp.rollout"} <= names["mesh"]
    assert {"taskapp.rollout", "policy.chat_completions"} <= names["taskapp"]
    assert "openai.chat_completions" in names["worker"]
    # All four episodes (2 prompts x 2) joined the step's trace in the Task App and in the worker; the
    # worker answered no completion outside it. (The Task App's other spans are the proxy's conformance
    # check at registration, a trace of its own.)
    served = [s for s in chain["taskapp"] if s["name"] == "taskapp.rollout"]
    assert len(served) == 4 and all(s["kind"] == "SpanKind.SERVER" for s in served)
    generated = [s for s in by_process["worker"] if s["name"] == "openai.chat_completions"]
    assert len(generated) == 4 and all(s["context"]["trace_id"] == trace_id for s in generated)
