"""A job token is exactly its job's (mesh/jobtokens.py), against a real mesh and a job the scheduler runs on
the local backend: it opens the secret its job declared and nothing else, is refused by the gateway and by
every method no job needs, reads only its own job's events, and stops working once its job has ended."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
from tandem.events.v1 import events_service_pb2 as epb
from tandem.events.v1 import events_service_pb2_grpc
from tandem.gateway.v1 import gateway_service_pb2 as pb
from tandem.gateway.v1 import gateway_service_pb2_grpc
from tandem.scheduler.v1 import job_spec_pb2, scheduler_service_pb2, scheduler_service_pb2_grpc
from tandem.vault.v1 import vault_service_pb2, vault_service_pb2_grpc

from gateway.orgs import ADMIN_KEY_FILE
from mesh.clients import open_channel
from mesh.secrets import open_secrets, seal_for_upload
from mesh.status import RpcError
from tests.support.mesh import mesh_settings, running_mesh

pytestmark = pytest.mark.timeout(180)


async def refused(call: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(RpcError) as caught:
        await call  # type: ignore[misc]
    return caught.value.code, caught.value.reason


async def test_a_job_token_is_its_jobs_and_ends_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TANDEM_SCHEDULER_LOCAL__CPUS", "4")
    monkeypatch.setenv("TANDEM_SCHEDULER_LOCAL__MEMORY_GIB", "8")
    token_file, release = tmp_path / "token", tmp_path / "release"
    async with running_mesh(mesh_settings(tmp_path / "state")) as mesh:
        admin_key = (tmp_path / "state" / ADMIN_KEY_FILE).read_text().strip()
        async with open_channel(mesh.address("gateway"), mesh.settings, token=admin_key) as channel:
            admin = gateway_service_pb2_grpc.GatewayServiceStub(channel)
            acme = (await admin.CreateOrg(pb.CreateOrgRequest(org_id="acme"))).key
            await admin.CreateOrg(pb.CreateOrgRequest(org_id="globex"))
        async with open_channel(mesh.address("gateway"), mesh.settings, token=acme) as channel:
            user = gateway_service_pb2_grpc.GatewayServiceStub(channel)
            key = (await user.GetPublicKey(pb.GetPublicKeyRequest(parent="orgs/acme"))).key
            for secret in ("declared", "undeclared"):
                await user.PutSecret(
                    pb.PutSecretRequest(
                        parent="orgs/acme",
                        secret_id=secret,
                        key_id=key.name.rsplit("/", 1)[1],
                        ciphertext=seal_for_upload(key.public_key, f"{secret}-value".encode()),
                    )
                )
            # The job hands its token to the test through a file and waits to be released.
            run = (
                f'printf %s "$TANDEM_JOB_TOKEN" > {token_file}\n'
                f"while [ ! -e {release} ]; do sleep 0.1; done\n"
            )
            task = job_spec_pb2.TaskSpec(
                name="main",
                kind=job_spec_pb2.TaskSpec.KIND_COMMAND,
                run=run,
                secrets=[job_spec_pb2.SecretBinding(secret="declared")],
            )
            job = (
                await user.CreateJob(
                    pb.CreateJobRequest(
                        parent="orgs/acme", job_id="run", spec=job_spec_pb2.JobSpec(tasks=[task])
                    )
                )
            ).job
            deadline = time.monotonic() + 60
            while not token_file.exists() or not token_file.read_text():
                assert time.monotonic() < deadline, "the job never started"
                await asyncio.sleep(0.1)
            token = token_file.read_text()

            async with (
                open_channel(mesh.address("gateway"), mesh.settings, token=token) as gw_channel,
                open_channel(mesh.address("vault"), mesh.settings, token=token) as vault_channel,
                open_channel(mesh.address("events"), mesh.settings, token=token) as events_channel,
                open_channel(mesh.address("scheduler"), mesh.settings, token=token) as sched_channel,
            ):
                gateway = gateway_service_pb2_grpc.GatewayServiceStub(gw_channel)
                vault = vault_service_pb2_grpc.VaultServiceStub(vault_channel)
                events = events_service_pb2_grpc.EventServiceStub(events_channel)
                scheduler = scheduler_service_pb2_grpc.SchedulerServiceStub(sched_channel)
                # What the job may do: open its declared secret, read its own job and events.
                opened = await open_secrets(vault, ["orgs/acme/secrets/declared"], token)
                assert opened == {"orgs/acme/secrets/declared": b"declared-value"}
                assert (await scheduler.GetJob(scheduler_service_pb2.GetJobRequest(name=job.name))).job.name
                await events.ListEvents(epb.ListEventsRequest(job=job.name))
                # At the gateway a job token is no credential at all.
                scope = (grpc.StatusCode.PERMISSION_DENIED, "OUTSIDE_JOB_SCOPE")
                for call in (
                    gateway.ListSecrets(pb.ListSecretsRequest(parent="orgs/acme")),
                    gateway.DeleteSecret(pb.DeleteSecretRequest(name="orgs/acme/secrets/undeclared")),
                    gateway.CreateApiKey(pb.CreateApiKeyRequest(parent="orgs/acme")),
                    gateway.CreateJob(
                        pb.CreateJobRequest(parent="orgs/acme", spec=job_spec_pb2.JobSpec(tasks=[task]))
                    ),
                    gateway.ListJobs(pb.ListJobsRequest(parent="orgs/acme")),
                    gateway.ListSecrets(pb.ListSecretsRequest(parent="orgs/globex")),
                ):
                    assert await refused(call) == scope
                # Nor at the services, beyond its own job.
                assert (
                    await refused(vault.ListSecrets(vault_service_pb2.ListSecretsRequest(parent="orgs/acme")))
                    == scope
                )
                assert (
                    await refused(
                        scheduler.ListJobs(scheduler_service_pb2.ListJobsRequest(parent="orgs/acme"))
                    )
                    == scope
                )
                assert (
                    await refused(scheduler.CancelJob(scheduler_service_pb2.CancelJobRequest(name=job.name)))
                    == scope
                )
                assert (
                    await refused(events.ListEvents(epb.ListEventsRequest(job="orgs/acme/jobs/other")))
                    == scope
                )
                with pytest.raises(RpcError) as undeclared:
                    await open_secrets(vault, ["orgs/acme/secrets/undeclared"], token)
                assert undeclared.value.reason == "SECRET_NOT_DECLARED"
                # Once the job has ended its token opens nothing, long before it expires.
                release.touch()
                while (await user.GetJob(pb.GetJobRequest(name=job.name))).job.state != job.STATE_SUCCEEDED:
                    assert time.monotonic() < deadline + 60
                    await asyncio.sleep(0.1)
                await asyncio.sleep(2.5)  # past the liveness cache of a service that asked while it ran
                revoked = (grpc.StatusCode.UNAUTHENTICATED, "CREDENTIALS_REVOKED")
                with pytest.raises(RpcError) as after:
                    await open_secrets(vault, ["orgs/acme/secrets/declared"], token)
                assert (after.value.code, after.value.reason) == revoked
                assert await refused(events.ListEvents(epb.ListEventsRequest(job=job.name))) == revoked
                assert (
                    await refused(scheduler.GetJob(scheduler_service_pb2.GetJobRequest(name=job.name)))
                    == revoked
                )
