"""A private git server for tests: git's own smart-HTTP server (`git http-backend`, as a CGI program) behind
Basic authentication, serving the repositories under one folder read-only.

    with git_http_server(tmp_path / "repos", "alice", "token") as url:
        ...  # url/REPO clones with the credentials; a request without them gets 401, as from a forge
"""

from __future__ import annotations

import base64
import contextlib
import http.server
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

HTTP_BACKEND = "/usr/lib/git-core/git-http-backend"


@contextlib.contextmanager
def git_http_server(root: Path, username: str, password: str) -> Iterator[str]:
    expected = "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.backend()

        def do_POST(self) -> None:
            self.backend()

        def backend(self) -> None:
            if self.headers.get("Authorization") != expected:
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Basic realm="git"')
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            path, _, query = self.path.partition("?")
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            env = {
                "GIT_PROJECT_ROOT": str(root),
                "GIT_HTTP_EXPORT_ALL": "1",
                "PATH_INFO": path,
                "QUERY_STRING": query,
                "REQUEST_METHOD": self.command,
                "CONTENT_TYPE": self.headers.get("Content-Type", ""),
                "CONTENT_LENGTH": str(len(body)),
                "REMOTE_USER": username,
                "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            }
            if self.headers.get("Content-Encoding"):
                env["HTTP_CONTENT_ENCODING"] = self.headers["Content-Encoding"]
            done = subprocess.run([HTTP_BACKEND], input=body, env=env, capture_output=True, check=False)
            head, _, payload = done.stdout.partition(b"\r\n\r\n")
            status = 200
            headers: list[tuple[str, str]] = []
            for line in head.decode("latin-1").split("\r\n"):
                name, _, value = line.partition(":")
                if name.lower() == "status":
                    status = int(value.split()[0])
                elif name:
                    headers.append((name, value.strip()))
            self.send_response(status)
            for name, value in headers:
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
