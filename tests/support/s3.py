"""A real S3-compatible server for the bucket-mount tests: moto's server mode in a child process, with request
signing checked (moto's IAM authentication), and one IAM user whose access key the tests store in the vault.

moto lets the first `INITIAL_NO_AUTH_ACTION_COUNT` requests through unsigned; the fixture spends exactly those
on making the user, its policy and its key, so every later request, the tasks' included, must carry a valid
signature: an anonymous request or an unknown key is refused, as by a real store.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.support.postgres import free_port

_SETUP_CALLS = 3  # create_user, put_user_policy, create_access_key


@dataclass(frozen=True)
class S3Server:
    endpoint: str  # http://127.0.0.1:PORT
    key_id: str
    secret: str

    def store(self) -> Any:
        """An s3fs filesystem on the server with the user's key, for the tests' own reads and writes."""
        import s3fs  # noqa: PLC0415

        return s3fs.S3FileSystem(
            key=self.key_id, secret=self.secret, client_kwargs={"endpoint_url": self.endpoint}
        )


@pytest.fixture
def s3_server() -> Iterator[S3Server]:
    boto3 = pytest.importorskip("boto3")
    pytest.importorskip("moto.server")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(_SETUP_CALLS)
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                assert server.poll() is None, "moto's server exited"
                assert time.monotonic() < deadline, "moto's server did not listen"
                time.sleep(0.05)
        endpoint = f"http://127.0.0.1:{port}"
        iam = boto3.client(
            "iam",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="setup",
            aws_secret_access_key="setup",  # unsigned setup calls, see the docstring
        )
        iam.create_user(UserName="task")
        policy = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
        }
        iam.put_user_policy(UserName="task", PolicyName="buckets", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName="task")["AccessKey"]
        yield S3Server(endpoint, key["AccessKeyId"], key["SecretAccessKey"])
    finally:
        server.terminate()
        server.wait(timeout=10)
