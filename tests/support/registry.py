"""A private container registry for tests: the pull half of the OCI distribution API (`/v2/`, manifests and
blobs) over plain HTTP behind Basic authentication, serving one image (one layer, built from files given),
and the `registries.conf` that lets podman reach it without TLS (`CONTAINERS_REGISTRIES_CONF`).

    with private_registry(tmp_path, "alice", "pw", {"hello.txt": b"hi"}) as registry:
        registry.image       # "127.0.0.1:PORT/team/trainer:1"
        registry.conf        # the registries.conf file
        registry.pulled      # the digests of the blobs fetched with valid credentials
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import hashlib
import http.server
import io
import json
import tarfile
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"


@dataclass
class Registry:
    host: str
    image: str
    conf: Path
    manifest_digest: str
    pulled: list[str] = field(default_factory=list)
    refused: int = 0  # requests without valid credentials


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _layer(files: Mapping[str, bytes]) -> tuple[bytes, bytes]:
    """(the gzipped tar, the tar) holding `files`."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    plain = raw.getvalue()
    return gzip.compress(plain, mtime=0), plain


@contextlib.contextmanager
def private_registry(
    folder: Path, username: str, password: str, files: Mapping[str, bytes], repository: str = "team/trainer"
) -> Iterator[Registry]:
    layer, plain = _layer(files)
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "rootfs": {"type": "layers", "diff_ids": [_digest(plain)]},
            "config": {},
        }
    ).encode()
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": MANIFEST_TYPE,
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": _digest(config),
                "size": len(config),
            },
            "layers": [
                {
                    "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": _digest(layer),
                    "size": len(layer),
                }
            ],
        }
    ).encode()
    blobs = {_digest(config): config, _digest(layer): layer}
    expected = "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()
    state: dict[str, Registry] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *_args: object) -> None:
            pass

        def _send(self, code: int, body: bytes = b"", headers: Mapping[str, str] | None = None) -> None:
            self.send_response(code)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_HEAD(self) -> None:
            self.do_GET()

        def do_GET(self) -> None:
            registry = state["registry"]
            if self.headers.get("Authorization") != expected:
                registry.refused += 1
                self._send(401, b"{}", {"WWW-Authenticate": 'Basic realm="tandem-test"'})
                return
            path = self.path.split("?", 1)[0]
            if path in ("/v2/", "/v2"):
                self._send(200, b"{}", {"Content-Type": "application/json"})
            elif path.startswith(f"/v2/{repository}/manifests/"):
                headers = {"Content-Type": MANIFEST_TYPE, "Docker-Content-Digest": _digest(manifest)}
                self._send(200, manifest, headers)
            elif path.startswith(f"/v2/{repository}/blobs/") and path.rsplit("/", 1)[1] in blobs:
                digest = path.rsplit("/", 1)[1]
                registry.pulled.append(digest)
                self._send(200, blobs[digest], {"Content-Type": "application/octet-stream"})
            else:
                self._send(404, b'{"errors": [{"code": "NAME_UNKNOWN"}]}')

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    host = f"127.0.0.1:{server.server_address[1]}"
    conf = folder / "registries.conf"
    conf.write_text(f'[[registry]]\nlocation = "{host}"\ninsecure = true\n')
    state["registry"] = Registry(host, f"{host}/{repository}:1", conf, _digest(manifest))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state["registry"]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
