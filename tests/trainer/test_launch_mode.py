"""The launcher's one rule for its two modes: scheduled when the environment names a mesh (what the
scheduler sets for an online_rl task), embedded otherwise."""

from __future__ import annotations

from trainer.launch import scheduled_mesh

SCHEDULED = {
    "TANDEM_JOB": "orgs/acme/jobs/rl",
    "TANDEM_JOB_TOKEN": "tdm1.claims.sig",
    "TANDEM_TARGETS__EVENTS": "10.0.0.1:50054",
    "TANDEM_TARGETS__TASKAPP_PROXY": "10.0.0.1:50053",
}


def test_the_scheduler_environment_selects_the_scheduled_mode() -> None:
    mesh = scheduled_mesh(SCHEDULED)
    assert mesh is not None and mesh.job == "orgs/acme/jobs/rl" and mesh.current_token() == "tdm1.claims.sig"
    assert mesh.settings.target("events") == "10.0.0.1:50054"
    assert mesh.settings.target("taskapp_proxy") == "10.0.0.1:50053"
    assert not mesh.settings.targets.scheduler  # no scheduler named: the token is not renewed


def test_anything_less_is_the_embedded_mode() -> None:
    assert scheduled_mesh({}) is None
    for missing in SCHEDULED:
        assert scheduled_mesh({k: v for k, v in SCHEDULED.items() if k != missing}) is None, missing
