"""The trainer's control surface: `Control` on its own, checkpoint writes refused part-way by the kernel (a
full disk), and `TrainerService` against a real job on CPU over the real mesh (the embedded services, the
example Task App, an inference worker process, the trainer's own gRPC server)."""

from __future__ import annotations

import asyncio
import json
import resource
import secrets
import signal
import subprocess
import sys
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from tandem.events.v1 import events_service_pb2 as epb
from tandem.trainer.v1 import checkpoint_pb2, status_pb2, trainer_service_pb2_grpc
from tandem.trainer.v1 import trainer_service_pb2 as pb
from transformers import AutoModelForCausalLM

from mesh import paging
from mesh.clients import open_channel
from mesh.errors import TandemError
from mesh.identity import TokenSigner, load_signing_key
from mesh.settings import Settings
from mesh.status import RpcError
from tandem_jobs.config import Job, parse_job
from trainer import checkpoints
from trainer.checkpoints import CheckpointInfo, Trigger
from trainer.control import Control, State
from trainer.launch import local_environment
from trainer.models import build_tiny_model
from trainer.service import ADDRESS_FILE
from trainer.train import Environment, Trainer

ROOT = Path(__file__).resolve().parents[2]
S = status_pb2.TrainerStatus
C = checkpoint_pb2.Checkpoint


def job_config(model_dir: Path, steps: int, interval: int) -> Job:
    return Job(
        parse_job(
            {
                "seed": 5,
                "checkpoint_interval": interval,
                "model": {"dir": str(model_dir)},
                "task_app": {"name": "orgs/demo/taskApps/single-turn"},
                "data": {"train": {"seeds": [{"start": 0, "end": 1000}]}},
                "algorithm": {"group_size": 2, "prompts_per_step": 2, "steps": steps, "max_staleness": 1},
                "optimizer": {"learning_rate": 1e-3},
                "sampling": {"max_tokens": 3},
            }
        )
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


async def refused(call: Awaitable[Any]) -> RpcError:
    with pytest.raises(RpcError) as caught:
        await call
    return caught.value


def domain_refusal(error: BaseException | None) -> tuple[str, str]:
    assert isinstance(error, TandemError), error
    return error.code, error.reason_name


def state(control: Control) -> State:
    return control.state  # read afresh: each call on the control may have moved it


def saved_at(step: int) -> CheckpointInfo:
    return CheckpointInfo(step, step, Trigger.INTERVAL, Path(f"step-{step:06d}"), 0.0)


# ---- Control: the loop's side, no gRPC -----------------------------------------------------------


async def test_a_save_waits_for_the_next_boundary_unless_the_last_step_has_a_checkpoint() -> None:
    control = Control()
    with pytest.raises(TandemError) as starting:
        await control.save()
    assert domain_refusal(starting.value) == ("FAILED_PRECONDITION", "JOB_STATE_CONFLICT")

    control.training(step=0, weight_version=0, total_steps=10)
    first = asyncio.create_task(control.save("a"))
    again = asyncio.create_task(control.save("a"))
    other = asyncio.create_task(control.save())
    await asyncio.sleep(0)
    assert control.save_wanted and not first.done()
    control.stepped(1, 1, {"staleness/on_policy": 3, "staleness/dropped": 1, "loss": float("nan")})
    control.checkpointing()
    assert state(control) is State.CHECKPOINTING
    control.checkpointed(saved_at(1))
    assert state(control) is State.TRAINING and not control.save_wanted
    assert (await first).step == (await again).step == (await other).step == 1
    assert control.staleness["staleness/on_policy"] == 3 and "loss" not in control.metrics

    # The last completed step has a checkpoint: returned at once. A used request id keeps its checkpoint.
    assert (await control.save()).step == 1
    control.stepped(2, 2, {})
    assert (await control.save("a")).step == 1
    pending = asyncio.create_task(control.save("b"))
    await asyncio.sleep(0)
    control.checkpoint_failed(2, OSError(27, "File too large"))
    assert domain_refusal((await asyncio.gather(pending, return_exceptions=True))[0]) == (
        "UNAVAILABLE",
        "DEPENDENCY_UNAVAILABLE",
    )
    retry = asyncio.create_task(control.save("b"))  # the failure is not remembered for the id
    await asyncio.sleep(0)
    control.ended()
    assert domain_refusal((await asyncio.gather(retry, return_exceptions=True))[0]) == (
        "FAILED_PRECONDITION",
        "JOB_STATE_CONFLICT",
    )
    assert control.state is State.STOPPED


def test_a_stop_is_idempotent_and_refused_once_the_trainer_failed() -> None:
    control = Control()
    control.stop(request_id="s1")  # while starting: the loop never begins a step
    assert control.state is State.STOPPING and control.stop_requested
    control.stop(skip_checkpoint=True)  # a second stop changes nothing
    assert not control.skip_final_checkpoint
    control.stop(request_id="s1")
    with pytest.raises(TandemError) as reused:
        control.stop(skip_checkpoint=True, request_id="s1")
    assert domain_refusal(reused.value) == ("ALREADY_EXISTS", "REQUEST_ID_REUSED")
    control.ended()
    control.stop()
    assert state(control) is State.STOPPED

    broken = Control()
    broken.failed(RuntimeError("the producer died"))
    broken.ended()
    assert broken.state is State.FAILED and broken.error == "RuntimeError: the producer died"
    with pytest.raises(TandemError) as failed:
        broken.stop()
    assert domain_refusal(failed.value) == ("FAILED_PRECONDITION", "JOB_STATE_CONFLICT")


# ---- a full disk while checkpointing --------------------------------------------------------------


def full_disk_child(model_dir: str, output: str) -> None:
    """Runs in a child process, whose file size limit stands in for a full disk: a checkpoint at step 2,
    then writes the kernel refuses part-way (EFBIG; SIGXFSZ ignored so the write fails instead of killing
    the process), then room again. Prints what it saw as JSON."""

    async def main() -> dict[str, Any]:
        job = job_config(Path(model_dir), steps=10, interval=2)
        env = Environment(
            proxy=None,
            workers=[],
            task_app="orgs/demo/taskApps/a",
            job="orgs/demo/jobs/j",
            output_dir=Path(output),
        )
        trainer = Trainer(job, env)
        control = trainer.control
        control.training(0, 0, 10)
        trainer.step = trainer.version = 2
        first = await trainer.save_checkpoint(Trigger.INTERVAL)
        with torch.no_grad():
            for parameter in trainer.policy.parameters():
                parameter.add_(1.0)  # weights that must not reach the disk
        trainer.step = trainer.version = 4

        weights = (Path(model_dir) / "model.safetensors").stat().st_size
        _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (weights // 2, hard))
        waiting = asyncio.create_task(control.save("on-demand"))
        await asyncio.sleep(0)
        interval = await trainer.save_checkpoint(Trigger.REQUESTED)
        (waiting_error,) = await asyncio.gather(waiting, return_exceptions=True)
        assert isinstance(waiting_error, TandemError)
        final_error = ""
        try:
            await trainer.save_checkpoint(Trigger.FINAL)
        except RuntimeError as exc:
            final_error = str(exc)
        state_after = control.state.value

        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
        retried = asyncio.create_task(control.save("on-demand"))
        await asyncio.sleep(0)
        trainer.step = trainer.version = 5
        await trainer.save_checkpoint(Trigger.REQUESTED)
        return {
            "first": first is not None and first.id,
            "refused": interval is None,
            "waiting": [waiting_error.code, waiting_error.reason_name, waiting_error.message],
            "final_error": final_error,
            "state_after": state_after,
            "retried": (await retried).step,
        }

    print(json.dumps(asyncio.run(main())))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_write_refused_part_way_leaves_the_previous_checkpoint_and_training_goes_on(
    model_dir: Path, tmp_path: Path
) -> None:

    code = "import sys; from tests.trainer.test_trainer_service import full_disk_child as f; f(*sys.argv[1:])"
    done = subprocess.run(
        [sys.executable, "-c", code, str(model_dir), str(tmp_path / "out")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["first"] == "step-2" and seen["refused"]
    assert seen["waiting"][:2] == ["UNAVAILABLE", "DEPENDENCY_UNAVAILABLE"]
    assert "File too large" in seen["waiting"][2]
    assert seen["final_error"].startswith("the final checkpoint (step 4) could not be written")
    assert seen["state_after"] == "training"  # a failed write does not stop the job
    assert seen["retried"] == 5  # the same request id, after the failure, gets the next checkpoint

    root = tmp_path / "out" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step-000002", "step-000005"]  # no partial left
    kept = checkpoints.read(root / "step-000002")
    assert kept is not None and kept.trigger is Trigger.INTERVAL and kept.resumable
    loaded = AutoModelForCausalLM.from_pretrained(root / "step-000002")
    original = AutoModelForCausalLM.from_pretrained(model_dir)
    for (name, mine), (_, theirs) in zip(
        loaded.state_dict().items(), original.state_dict().items(), strict=True
    ):
        assert torch.equal(mine, theirs), name
    assert torch.load(root / "step-000002" / checkpoints.STATE_FILE, weights_only=False)["step"] == 2


# ---- TrainerService over the mesh -----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_trainer_service_on_a_running_job(model_dir: Path, tmp_path: Path) -> None:

    key = secrets.token_hex(32)
    output = tmp_path / "run"
    job = job_config(model_dir, steps=60, interval=0)  # checkpoints only on request and at the end
    async with local_environment(job, output, mesh_key=key) as env:
        found = json.loads((output / ADDRESS_FILE).read_text())
        assert found["job"] == env.job and found["service"] == "tandem.trainer.v1.TrainerService"
        settings = Settings(state_dir=tmp_path / "client", mesh_key=key)
        signer = TokenSigner(load_signing_key(key, settings.state_dir))
        org = env.job.split("/")[1]
        channels = [
            open_channel(found["address"], settings, token=signer.issue("user", "ada", org=org)),
            open_channel(found["address"], settings, token=signer.issue("user", "eve", org="globex")),
            open_channel(found["address"], settings),
        ]
        stub, stranger, anonymous = (trainer_service_pb2_grpc.TrainerServiceStub(c) for c in channels)
        try:
            status = (await stub.GetTrainerStatus(pb.GetTrainerStatusRequest(job=env.job))).status
            assert status.state == S.STATE_STARTING and status.job == env.job
            error = await refused(stub.SaveCheckpoint(pb.SaveCheckpointRequest(job=env.job)))
            assert (error.code, error.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "JOB_STATE_CONFLICT")

            trainer = Trainer(job, env)
            running = asyncio.create_task(trainer.run())
            while status.step < 2:
                if running.done():
                    running.result()  # a failed loop fails the test with its error
                await asyncio.sleep(0.2)
                status = (await stub.GetTrainerStatus(pb.GetTrainerStatusRequest(job=env.job))).status
            assert status.state in (S.STATE_TRAINING, S.STATE_CHECKPOINTING)
            assert status.total_steps == 60 and status.weight_version >= 1
            assert "reward/mean" in status.last_metrics and "step_s" in status.last_metrics
            counts = status.staleness
            assert counts.used + counts.importance_corrected + counts.dropped >= 8  # two steps of 4 episodes
            assert status.start_time.seconds > 0 and status.update_time.seconds >= status.start_time.seconds

            # SaveCheckpoint: written at the next step boundary; the same request id returns it again.
            before = status.step
            request = pb.SaveCheckpointRequest(job=env.job, request_id="s-1")
            saved = (await stub.SaveCheckpoint(request)).checkpoint
            assert saved.step > before and saved.name == f"{env.job}/checkpoints/step-{saved.step}"
            assert saved.trigger == C.TRIGGER_ON_DEMAND
            assert saved.resumable and saved.size_bytes > 0 and saved.uri.startswith("file:///")
            assert saved.format == C.FORMAT_HF_SAFETENSORS and "reward/mean" in saved.metrics
            assert saved.policy_version.job == env.job and saved.policy_version.weight_version >= 1
            again = await stub.SaveCheckpoint(pb.SaveCheckpointRequest(job=env.job, request_id="s-1"))
            assert again.checkpoint == saved
            got = await stub.GetCheckpoint(pb.GetCheckpointRequest(name=saved.name))
            assert got.checkpoint == saved
            while status.step <= saved.step:
                await asyncio.sleep(0.2)
                status = (await stub.GetTrainerStatus(pb.GetTrainerStatusRequest(job=env.job))).status
            assert status.last_checkpoint == saved.name
            request = pb.SaveCheckpointRequest(job=env.job, request_id="s-2")
            second = (await stub.SaveCheckpoint(request)).checkpoint
            assert second.step > saved.step and second.trigger == C.TRIGGER_ON_DEMAND

            # ListCheckpoints, one per page, newest step first.
            listed: list[C] = []
            token = ""
            while True:
                page = await stub.ListCheckpoints(
                    pb.ListCheckpointsRequest(parent=env.job, page_size=1, page_token=token)
                )
                listed += page.checkpoints
                token = page.next_page_token
                if not token:
                    break
            assert listed == [second, saved]

            # Bad input.
            for call in (
                stranger.GetTrainerStatus(pb.GetTrainerStatusRequest(job=env.job)),
                stranger.StopTraining(pb.StopTrainingRequest(job=env.job)),
                stranger.GetCheckpoint(pb.GetCheckpointRequest(name=saved.name)),
                stub.GetTrainerStatus(pb.GetTrainerStatusRequest(job=f"orgs/{org}/jobs/another")),
                stub.ListCheckpoints(pb.ListCheckpointsRequest(parent="orgs/globex/jobs/another")),
                stub.SaveCheckpoint(pb.SaveCheckpointRequest(job=f"orgs/{org}/jobs/another")),
                stub.GetCheckpoint(
                    pb.GetCheckpointRequest(name=f"orgs/{org}/jobs/another/checkpoints/step-3")
                ),
            ):
                error = await refused(call)
                assert (error.code, error.reason) == (grpc.StatusCode.NOT_FOUND, "JOB_NOT_FOUND"), error
            for call in (
                stub.GetTrainerStatus(pb.GetTrainerStatusRequest(job="jobs/x")),
                stub.GetCheckpoint(pb.GetCheckpointRequest(name=env.job)),
                stub.SaveCheckpoint(pb.SaveCheckpointRequest(job=env.job, request_id="not a valid id")),
            ):
                error = await refused(call)
                assert (error.code, error.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT")
            for bad_token in ("not-a-token!", paging.encode(paging.fingerprint("another query"))):
                error = await refused(
                    stub.ListCheckpoints(pb.ListCheckpointsRequest(parent=env.job, page_token=bad_token))
                )
                assert (error.code, error.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_PAGE_TOKEN")
            error = await refused(anonymous.GetTrainerStatus(pb.GetTrainerStatusRequest(job=env.job)))
            assert (error.code, error.reason) == (grpc.StatusCode.UNAUTHENTICATED, "MISSING_CREDENTIALS")
            for missing in ("step-99999", f"step-{saved.step:06d}", "final"):
                error = await refused(
                    stub.GetCheckpoint(pb.GetCheckpointRequest(name=f"{env.job}/checkpoints/{missing}"))
                )
                assert (error.code, error.reason) == (grpc.StatusCode.NOT_FOUND, "CHECKPOINT_NOT_FOUND")

            # StopTraining: STOPPING at once, the loop ends after its step with a final checkpoint.
            stopping = await stub.StopTraining(pb.StopTrainingRequest(job=env.job, request_id="stop-1"))
            assert stopping.status.state == S.STATE_STOPPING
            repeat = await stub.StopTraining(pb.StopTrainingRequest(job=env.job, request_id="stop-1"))
            assert repeat.status.state in (S.STATE_STOPPING, S.STATE_STOPPED)
            reports = await running
            assert 2 <= trainer.step == reports[-1].step < 60
            status = (await stub.GetTrainerStatus(pb.GetTrainerStatusRequest(job=env.job))).status
            assert (
                status.state == S.STATE_STOPPED and status.step == trainer.step and not status.error_message
            )
            newest = (await stub.ListCheckpoints(pb.ListCheckpointsRequest(parent=env.job))).checkpoints[0]
            assert newest.step == trainer.step and newest.trigger == C.TRIGGER_FINAL
            assert status.last_checkpoint == newest.name
            error = await refused(stub.SaveCheckpoint(pb.SaveCheckpointRequest(job=env.job)))
            assert (error.code, error.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "JOB_STATE_CONFLICT")
            stopped = await stub.StopTraining(pb.StopTrainingRequest(job=env.job))
            assert stopped.status.state == S.STATE_STOPPED

            # The events service indexes the same checkpoints under the same names.
            assert env.events is not None
            events = await env.events.ListEvents(
                epb.ListEventsRequest(job=env.job, types=["checkpoint.saved"])
            )
            announced = {e.checkpoint_saved.checkpoint for e in events.events}
            listed = list((await stub.ListCheckpoints(pb.ListCheckpointsRequest(parent=env.job))).checkpoints)
            assert announced == {c.name for c in listed}
        finally:
            for channel in channels:
                await channel.close()
    assert not (output / ADDRESS_FILE).exists()
