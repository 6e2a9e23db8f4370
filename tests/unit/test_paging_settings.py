"""Page tokens and typed settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from mesh import paging
from mesh.errors import InvalidArgument
from mesh.settings import Settings


def test_page_token_round_trip() -> None:
    query = paging.fingerprint("orgs/acme", "state=RUNNING")
    token = paging.encode(query, last_key="job-9", last_number=42)
    cursor = paging.decode(token, query)
    assert cursor is not None
    assert (cursor.last_key, cursor.last_number) == ("job-9", 42)
    assert paging.decode("", query) is None


@pytest.mark.parametrize("token", ["%%%", "not-base64!", "AAAA"])
def test_foreign_or_broken_tokens_are_refused(token: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        paging.decode(token, paging.fingerprint("q"))
    assert info.value.reason_name == "INVALID_PAGE_TOKEN"


def test_token_for_another_query_is_refused() -> None:
    token = paging.encode(paging.fingerprint("orgs/acme", "a"), last_key="x")
    with pytest.raises(InvalidArgument) as info:
        paging.decode(token, paging.fingerprint("orgs/acme", "b"))
    assert info.value.reason_name == "INVALID_PAGE_TOKEN"


def test_page_size_defaults_and_caps() -> None:
    assert paging.page_size(0) == paging.DEFAULT_PAGE_SIZE
    assert paging.page_size(5) == 5
    assert paging.page_size(10**6) == paging.MAX_PAGE_SIZE
    with pytest.raises(InvalidArgument):
        paging.page_size(-1)


def test_settings_from_env_and_toml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "tandem.toml"
    config.write_text('host = "0.0.0.0"\nlog_format = "text"\n[ports]\nvault = 7001\nevents = 7004\n')
    monkeypatch.setenv("TANDEM_CONFIG", str(config))
    monkeypatch.setenv("TANDEM_PORTS__EVENTS", "8004")
    settings = Settings(state_dir=tmp_path)
    assert settings.host == "0.0.0.0"  # noqa: S104 - the value read back from the file
    assert settings.log_format == "text"
    assert settings.port("vault") == 7001
    assert settings.port("events") == 8004  # the environment wins over the file
    assert settings.target("vault") == "0.0.0.0:7001"
    assert settings.store_url_for("vault") == f"sqlite:///{tmp_path / 'vault.db'}"


def test_explicit_targets_and_store_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_TARGETS__VAULT", "vault.tandem.svc:50051")
    monkeypatch.setenv("TANDEM_STORE_URL", "postgresql://tandem@db/tandem")
    settings = Settings()
    assert settings.target("vault") == "vault.tandem.svc:50051"
    assert settings.store_url_for("events") == "postgresql://tandem@db/tandem"


@pytest.mark.parametrize(("key", "value"), [("TANDEM_PORTS__VAULT", "70000"), ("TANDEM_LOG_LEVEL", "LOUD")])
def test_invalid_settings_name_the_field(monkeypatch: pytest.MonkeyPatch, key: str, value: str) -> None:
    monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=key.removeprefix("TANDEM_").split("__")[-1].lower()):
        Settings()


def test_tls_is_on_only_with_all_three_files(tmp_path: Path) -> None:
    assert not Settings().tls.enabled
    files = {name: tmp_path / f"{name}.pem" for name in ("cert_file", "key_file", "ca_file")}
    for path in files.values():
        path.write_text("pem")
    assert Settings(tls=files).tls.enabled  # type: ignore[arg-type]
    # Fewer than three is refused, not a plaintext mesh (tests/security/test_config.py has the rest).
    with pytest.raises(ValueError, match="go together"):
        Settings(tls={"cert_file": files["cert_file"]})  # type: ignore[arg-type]
