"""Run a whole online-RL job on this machine: `python -m trainer --config job.toml [--output DIR]`.

`local_environment` starts what the job needs on loopback and stops all of it on the way out (normal end,
error or Ctrl-C): the embedded mesh services the trainer uses (events, vault, taskapp-proxy, in a process
of their own: `trainer/mesh_process.py`), the Task App (an example app named by the config's `task_app.name`, e.g.
`orgs/demo/taskApps/single-turn` plays `examples/taskapps/single_turn.py`, or the app at `task_app.base_url`),
registered through the proxy with a fresh key sealed into the vault, and the inference workers the placement
plan asks for (`python -m trainer.inference.worker`, one per replica). The trainer then runs in this process,
serving its control surface (`trainer/service.py`) on loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from tandem.events.v1 import events_service_pb2_grpc
from tandem.inference.v1 import inference_service_pb2 as ipb
from tandem.inference.v1 import inference_service_pb2_grpc
from tandem.scheduler.v1 import scheduler_service_pb2, scheduler_service_pb2_grpc
from tandem.taskapp.v1 import task_app_pb2, taskapp_service_pb2, taskapp_service_pb2_grpc
from tandem.vault.v1 import vault_service_pb2, vault_service_pb2_grpc
from transformers.utils import logging as transformers_logging

from mesh.clients import open_channel
from mesh.errors import InvalidArgument
from mesh.identity import TokenSigner, load_signing_key
from mesh.observability import configure_logging
from mesh.secrets import seal_for_upload
from mesh.settings import Settings, Targets
from mesh.status import RpcError
from tandem_jobs.config import Job, load_job
from tandem_jobs.placement import GB, Memory, plan, read_parameters
from trainer.control import Control
from trainer.inference.process import ROOT, Worker, die_with_parent, start_worker, stop_process, stop_worker
from trainer.mesh_process import local_settings, mesh_process
from trainer.models import ensure_model
from trainer.ranks import Ranks, devices_for, start_ranks
from trainer.service import serving
from trainer.train import Environment, StepReport, Trainer, WorkerEndpoint

log = logging.getLogger("tandem.launch")
TASK_APP_WAIT_S = 120.0  # scheduled mode: how long an app of the job's organization may take to be registered
TORCH_START_S = 90.0  # how long an inference worker may take to load its model and serve
CPU_KV_CACHE_GIB = 2  # vLLM on a CPU, unless VLLM_CPU_KVCACHE_SPACE says otherwise
VLLM_START_S = 600.0  # vLLM: its engine core, the model and (unless eager) a torch.compile on a cold cache


def _example_script(app: str) -> Path:
    script = ROOT / "examples" / "taskapps" / (app.rsplit("/", 1)[-1].replace("-", "_") + ".py")
    if not script.is_file():
        raise FileNotFoundError(f"no example app for {app}: {script.name} is not in examples/taskapps")
    return script


def _free_port() -> int:
    import socket  # noqa: PLC0415

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _serve_command(script: Path, port: int) -> list[str]:
    """How an example app is served: through the SDK (`tandem taskapp serve`), or, for an app that does not
    use the SDK (hosted_copy_letter.py, written to the hosted contract on the standard library), as its own
    program, which takes `--port` and reads `ENVIRONMENT_API_KEY` as the SDK's server does."""
    if "tandem_taskapp" not in script.read_text(encoding="utf-8"):
        return [sys.executable, str(script), "--port", str(port)]
    return [sys.executable, "-m", "gateway.cli", "taskapp", "serve", str(script), "--port", str(port)]


@contextlib.contextmanager
def _task_app(script: Path, key: str) -> Iterator[str]:
    port = _free_port()
    env = {**os.environ, "ENVIRONMENT_API_KEY": key}
    proc = subprocess.Popen(
        _serve_command(script, port),
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=die_with_parent,  # noqa: PLW1509 - only sets the parent-death signal
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the Task App {script.name} did not start")
            time.sleep(0.1)
        yield url
    finally:
        stop_process(proc, 15)


async def _register(settings: Settings, org: str, app_id: str, url: str, key: str, concurrency: int) -> str:
    """Seal the app's key into the vault and register the app through the proxy, as the job's user would,
    with room for a whole batch in flight (`concurrency` episodes)."""
    signer = TokenSigner(load_signing_key(settings.mesh_key, settings.state_dir))
    user = signer.issue("user", "launcher", org=org, ttl_s=3600)
    async with open_channel(settings.target("vault"), settings, token=user) as channel:
        vault = vault_service_pb2_grpc.VaultServiceStub(channel)
        public = await vault.GetPublicKey(vault_service_pb2.GetPublicKeyRequest(parent=f"orgs/{org}"))
        await vault.PutSecret(
            vault_service_pb2.PutSecretRequest(
                parent=f"orgs/{org}",
                secret_id=f"{app_id}-key",
                key_id=public.key_id,
                ciphertext=seal_for_upload(public.public_key, key.encode()),
            )
        )
    async with open_channel(settings.target("taskapp_proxy"), settings, token=user) as channel:
        proxy = taskapp_service_pb2_grpc.TaskAppServiceStub(channel)
        name = f"orgs/{org}/taskApps/{app_id}"
        request = taskapp_service_pb2.RegisterTaskAppRequest(
            parent=f"orgs/{org}",
            task_app_id=app_id,
            task_app=task_app_pb2.TaskApp(
                base_url=url,
                secret_name=f"orgs/{org}/secrets/{app_id}-key",
                limits=task_app_pb2.TaskAppLimits(max_concurrency=min(concurrency, 4096)),
            ),
        )
        try:
            await proxy.RegisterTaskApp(request)
        except RpcError as error:
            if error.reason != "ALREADY_EXISTS":
                raise
            # A resumed job over the same folder: the app runs again on another port, with a new key.
            await proxy.DeleteTaskApp(taskapp_service_pb2.DeleteTaskAppRequest(name=name))
            await proxy.RegisterTaskApp(request)
    return name


def _prepare(folder: Path) -> Path:
    folder = folder.absolute()
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@dataclass
class ScheduledMesh:
    """The mesh that scheduled this job: its name, the task's job token (renewed by `_renew`) and the
    settings whose targets (`TANDEM_TARGETS__*`) reach the mesh's services."""

    job: str
    token: str
    settings: Settings

    def current_token(self) -> str:
        return self.token


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def scheduled_mesh(environ: Mapping[str, str] = os.environ) -> ScheduledMesh | None:
    """The one rule of the two modes: scheduled when the environment names a mesh (`TANDEM_JOB`,
    `TANDEM_JOB_TOKEN`, `TANDEM_TARGETS__EVENTS` and `TANDEM_TARGETS__TASKAPP_PROXY`, as the scheduler
    provides), embedded (every service on loopback) otherwise."""
    names = ("TANDEM_JOB", "TANDEM_JOB_TOKEN", "TANDEM_TARGETS__EVENTS", "TANDEM_TARGETS__TASKAPP_PROXY")
    if not all(environ.get(name) for name in names):
        return None
    targets = Targets(**{s: environ.get(f"TANDEM_TARGETS__{s.upper()}", "") for s in Targets.model_fields})
    return ScheduledMesh(environ["TANDEM_JOB"], environ["TANDEM_JOB_TOKEN"], Settings(targets=targets))


async def _renew(mesh: ScheduledMesh) -> None:
    """Keep the job token fresh for a job that outlives it: RefreshJobToken at half of each token's
    remaining life (and at start, which tells when the scheduler's token expires)."""
    if not mesh.settings.targets.scheduler:
        return
    async with open_channel(mesh.settings.target("scheduler"), mesh.settings) as channel:
        scheduler = scheduler_service_pb2_grpc.SchedulerServiceStub(channel)
        while True:
            try:
                reply = await scheduler.RefreshJobToken(
                    scheduler_service_pb2.RefreshJobTokenRequest(job_token=mesh.token)
                )
                mesh.token = reply.job_token
                wait = max(10.0, (reply.expire_time.ToSeconds() - time.time()) / 2)
            except RpcError as error:
                log.warning("could not renew the job token (%s); trying again in a minute", error.reason)
                wait = 60.0
            await asyncio.sleep(wait)


async def _registered(proxy: Any, name: str, job: str) -> bool:
    """Whether the scheduler's mesh has the Task App `name` for this job's organization. An app of the job's
    own organization may be a managed Task App of its job group, which the scheduler registers once it is
    healthy while this task is starting: it is waited for, up to `TASK_APP_WAIT_S`."""
    same_org = name.split("/")[1] == job.split("/")[1]
    deadline = time.monotonic() + (TASK_APP_WAIT_S if same_org else 0.0)
    while True:
        try:
            await proxy.GetTaskApp(taskapp_service_pb2.GetTaskAppRequest(name=name))
        except RpcError as error:
            if error.reason != "TASK_APP_NOT_FOUND":
                raise
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(1.0)
        else:
            return True


async def _embedded(
    stack: contextlib.AsyncExitStack, job: Job, output_dir: Path, mesh_key: str
) -> tuple[Settings, str]:
    """The embedded events, vault and taskapp-proxy on loopback, with the config's Task App registered there
    (its `base_url`, else the example app it names, played from examples/taskapps); stopped with `stack`.
    Answers their settings and the app's name."""
    target = job.config.task_app
    org = target.name.split("/")[1] if target.name else "local"
    app_id = target.name.rsplit("/", 1)[-1] if target.name else "app"
    key = secrets.token_hex(16)
    if target.base_url:
        # The app already runs with its own key. Here no vault holds `secret_name` (a job submitted through
        # the gateway registers the app with that secret instead), so the key comes from the environment.
        key = os.environ.get("ENVIRONMENT_API_KEY", "").strip()
        if not key:
            raise RuntimeError(
                "task_app.base_url: set ENVIRONMENT_API_KEY to the app's key for a run on this machine "
                "(a job submitted through the gateway opens task_app.secret_name instead)"
            )
    url = target.base_url or stack.enter_context(_task_app(_example_script(target.name), key))
    settings = await stack.enter_async_context(mesh_process(output_dir / "mesh", mesh_key))
    algorithm = job.config.algorithm
    batch = algorithm.prompts_per_step * algorithm.group_size * (job.max_staleness + 1)
    return settings, await _register(settings, org, app_id, url, key, batch)


async def _start_workers(
    job: Job, replicas: Sequence[Sequence[int]], output_dir: Path, mesh_key: str, workers: list[Worker]
) -> None:
    """The inference workers of the placement plan, one per replica (its GPUs), added to `workers` as each
    starts, so that the caller stops the ones started when a later one fails."""
    inference = job.config.inference
    vllm = inference.engine == "vllm"
    for index, gpus in enumerate(replicas):
        extra = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))} if gpus else {}
        extra["TANDEM_WORKER_MODEL_PATH"] = job.config.model.dir
        if job.config.model.dtype:
            extra["TANDEM_WORKER_DTYPE"] = job.config.model.dtype
        if inference.max_batch:
            extra["TANDEM_WORKER_MAX_BATCH"] = str(inference.max_batch)
        if vllm:
            extra["TANDEM_WORKER_ENGINE"] = "vllm"
            extra["TANDEM_WORKER_ENFORCE_EAGER"] = "true" if inference.enforce_eager else "false"
            if len(gpus) > 1:
                extra["TANDEM_WORKER_TENSOR_PARALLEL_SIZE"] = str(len(gpus))
            if job.weights_mode == "lora":  # vLLM loads each update as an adapter of at most this rank
                from trainer import lora  # noqa: PLC0415 - peft, for LoRA jobs only

                extra["TANDEM_WORKER_MAX_LORA_RANK"] = str(lora.spec_of(job.config.weights.lora).rank)
            if not gpus and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
                # vLLM's CPU build otherwise takes most of the machine's memory for its KV cache (GiB).
                extra["VLLM_CPU_KVCACHE_SPACE"] = str(CPU_KV_CACHE_GIB)
        folder = output_dir / f"worker-{index}"
        workers.append(
            await asyncio.to_thread(
                start_worker,
                Path(job.config.model.dir),
                folder,
                mesh_key,
                extra,
                VLLM_START_S if vllm else TORCH_START_S,
            )
        )


async def _endpoint(worker: Worker, channel: Any) -> WorkerEndpoint:
    stub = inference_service_pb2_grpc.InferenceServiceStub(channel)
    info = await stub.GetWorkerInfo(ipb.GetWorkerInfoRequest())
    return WorkerEndpoint(stub, worker.openai_base_url, info.worker_info.model)


def _memory(job: Job) -> Memory | None:
    """What the planner checks a GPU job's memory against: the job's parameter count or its model folder's,
    and the job's GPU memory or the first visible GPU's. None on CPU, or when no GPU can be seen to ask."""
    topology = job.config.topology
    if not topology.gpus:
        return None
    if topology.HasField("gpu_memory_gb"):
        gpu_bytes = topology.gpu_memory_gb * GB
    else:
        import torch  # noqa: PLC0415 - only a GPU job asks its device

        if not torch.cuda.is_available():
            log.warning("no GPU visible to read its memory: the plan's memory is not checked")
            return None
        gpu_bytes = float(torch.cuda.get_device_properties(0).total_memory)
    if topology.HasField("model_parameters"):
        parameters = topology.model_parameters
    else:
        try:
            parameters = read_parameters(Path(job.config.model.dir))
        except (OSError, ValueError) as exc:
            raise InvalidArgument(
                f"cannot count the policy's parameters for the placement plan: {exc}"
            ) from None
    return Memory(parameters, gpu_bytes, job.sharding)


@contextlib.asynccontextmanager
async def local_environment(
    job: Job, output_dir: Path, *, mesh_key: str = "", mesh: ScheduledMesh | None = None
) -> AsyncIterator[Environment]:
    """Everything the job talks to, stopped on the way out, and the trainer's own TrainerService (its
    address in `<output>/trainer.json`). Embedded (`mesh` None): events, vault and taskapp-proxy on
    loopback. Scheduled: events go to `mesh`'s stream of its job, and rollouts through its taskapp-proxy when
    the config's Task App is registered there; an example app that is not is played on loopback, as
    embedded. The inference workers always run here. `mesh_key` is the seed of the key that signs this
    process's own tokens (its workers' and its TrainerService's; `TANDEM_MESH_KEY`), so callers that hold
    it can reach the TrainerService; a fresh one when empty."""
    output_dir = await asyncio.to_thread(_prepare, output_dir)
    # Every process of the job reads the model from the same absolute folder, whatever its working directory.
    job.config.model.dir = str(await asyncio.to_thread(ensure_model, job.config.model))
    target = job.config.task_app
    org = target.name.split("/")[1] if target.name else "local"
    mesh_key = mesh_key or secrets.token_hex(32)
    topology = job.config.topology
    placed = plan(
        topology.gpus,
        topology.inference_gpus if topology.HasField("inference_gpus") else "auto",
        topology.tensor_parallel_size if topology.HasField("tensor_parallel_size") else 1,
        job.reference,
        await asyncio.to_thread(_memory, job),
    )
    workers: list[Worker] = []
    ranks: Ranks | None = None  # trainer ranks 1..N-1 (this process is rank 0)
    channels = []
    async with contextlib.AsyncExitStack() as stack:
        try:
            proxy_channel = events_channel = None
            if mesh is not None:
                stack.push_async_callback(_stop, asyncio.create_task(_renew(mesh), name="job-token"))
                remote = mesh.settings
                events_channel = open_channel(remote.target("events"), remote, token=mesh.current_token)
                proxy_channel = open_channel(remote.target("taskapp_proxy"), remote, token=mesh.current_token)
                channels += [events_channel, proxy_channel]
                task_app = target.name
                if not target.name or not await _registered(
                    taskapp_service_pb2_grpc.TaskAppServiceStub(proxy_channel), target.name, mesh.job
                ):
                    proxy_channel = None
            if proxy_channel is None:
                settings, task_app = await _embedded(stack, job, output_dir, mesh_key)
            else:
                settings = local_settings(output_dir / "mesh", mesh_key)
            signer = TokenSigner(load_signing_key(mesh_key, settings.state_dir))
            await _start_workers(job, placed.inference, output_dir, mesh_key, workers)
            ranks = await asyncio.to_thread(start_ranks, job, output_dir, devices_for(job, placed.trainer))
            endpoints = []
            for worker in workers:
                channels.append(open_channel(worker.grpc_address, settings, signer=signer, subject="trainer"))
                endpoints.append(await _endpoint(worker, channels[-1]))
            if proxy_channel is None:
                proxy_channel = open_channel(
                    settings.target("taskapp_proxy"), settings, signer=signer, subject="trainer"
                )
                channels.append(proxy_channel)
            if events_channel is None:
                events_channel = open_channel(
                    settings.target("events"), settings, signer=signer, subject="trainer"
                )
                channels.append(events_channel)
            name = mesh.job if mesh is not None else f"orgs/{org}/jobs/run-{secrets.token_hex(3)}"
            control = Control()
            async with serving(control, name, output_dir, settings):
                yield Environment(
                    proxy=taskapp_service_pb2_grpc.TaskAppServiceStub(proxy_channel),
                    workers=endpoints,
                    task_app=task_app,
                    job=name,
                    output_dir=output_dir,
                    events=events_service_pb2_grpc.EventServiceStub(events_channel),
                    control=control,
                    ranks=ranks,
                )
        finally:
            for channel in channels:
                await channel.close()
            if ranks is not None:
                await asyncio.to_thread(ranks.close)
            for worker in workers:
                await asyncio.to_thread(stop_worker, worker)


async def run_job(job: Job, output_dir: Path) -> list[StepReport]:
    # SIGTERM (a scheduler stopping the job) unwinds like Ctrl-C, so every process started here is stopped.
    task = asyncio.current_task()
    if task is not None:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            for sig in (signal.SIGINT, signal.SIGTERM):
                asyncio.get_running_loop().add_signal_handler(sig, task.cancel)
    mesh_key = os.environ.get("TANDEM_MESH_KEY", "")
    async with local_environment(job, output_dir, mesh_key=mesh_key, mesh=scheduled_mesh()) as env:
        trainer = Trainer(job, env)

        def show(report: StepReport) -> None:
            m = report.metrics
            print(
                f"step {report.step:5d}  reward {m.get('reward/mean', 0):.3f}  loss {m.get('loss', 0):+.4f}"
                f"  kl {m.get('kl', 0):.4f}  mismatch |r-1| {m.get('mismatch/ratio_abs', 0):.1e}"
                f" kl(mu|pi) {m.get('mismatch/kl', 0):.1e}  sync {m.get('weight_sync_s', 0) * 1000:.0f} ms"
                f"  {m.get('step_s', 0):.2f} s",
                flush=True,
            )

        return await trainer.run(on_step=show)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument("--config", type=Path, required=True, help="the job's TOML file")
    parser.add_argument("--output", type=Path, default=Path("runs/latest"), help="checkpoints and logs")
    placement = parser.add_argument_group(
        "placement", "override the config's [topology] (the scheduler passes the GPUs it granted this way)"
    )
    placement.add_argument("--gpus", type=int, help="GPUs of this node for the whole job (0: CPU only)")
    placement.add_argument("--inference-gpus", type=int, help="GPUs for inference workers (default: auto)")
    placement.add_argument(
        "--tensor-parallel-size", type=int, help="tensor-parallel size per inference replica"
    )
    placement.add_argument(
        "--reference", choices=["none", "stacked", "own"], help="where the reference model runs"
    )
    placement.add_argument("--cpu-trainer-ranks", type=int, help="trainer ranks on CPU (gloo), with --gpus 0")
    args = parser.parse_args(argv)
    configure_logging("WARNING", "text")
    transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # one line a step is the view
    topology: dict[str, Any] = {
        key: value
        for key, value in (
            ("gpus", args.gpus),
            ("inference_gpus", args.inference_gpus),
            ("tensor_parallel_size", args.tensor_parallel_size),
            ("reference_placement", args.reference and f"REFERENCE_PLACEMENT_{args.reference.upper()}"),
            ("cpu_trainer_ranks", args.cpu_trainer_ranks),
        )
        if value is not None
    }
    try:
        job = Job(load_job(args.config, {"topology": topology}))
    except InvalidArgument as error:
        print(
            f"error: {args.config}: invalid job config" if error.violations else f"error: {error.message}",
            file=sys.stderr,
        )
        for violation in error.violations:
            print(f"  {violation.field}: {violation.description}", file=sys.stderr)
        return 2
    try:
        reports = asyncio.run(run_job(job, args.output))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("stopped; the checkpoint folder has the last completed checkpoint", file=sys.stderr)
        return 130
    except (RuntimeError, OSError, RpcError, ValueError) as error:
        # The job failed: say why in one line (the log under the output folder has the rest).
        print(f"the job failed: {error}", file=sys.stderr)
        return 1
    if not reports:
        print(
            f"nothing to train: the newest checkpoint in {args.output} is already at the last step "
            f"({job.config.algorithm.steps}); give another --output for a new run"
        )
        return 0
    last = reports[-1].metrics.get("reward/mean", 0.0)
    print(
        f"done: {len(reports)} steps, final mean reward {last:.3f}; checkpoints in {args.output / 'checkpoints'}"
        f" (reward plot: {args.output / 'checkpoints' / 'reward.png'})"
    )
    return 0
