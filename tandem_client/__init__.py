"""Tandem's Python SDK: `Client` (blocking) and `AsyncClient` (asyncio) over the public gateway API.

    from tandem_client import Client

    with Client() as tandem:  # the gateway from TANDEM_GATEWAY (default 127.0.0.1:50050), key from TANDEM_API_KEY
        tandem.put_secret("env-key", b"...")          # sealed here; the value never leaves in plaintext
        job = tandem.create_job(rl_config_toml=open("examples/jobs/demo.toml").read())
        for event in tandem.watch_events(job.name):   # resumes after a dropped connection
            print(event.seq, event.type, event.message)

Also reachable as `tandem.Client` and `tandem.AsyncClient`: `tandem` is the package of the generated protos
(`tandem.gateway.v1`, ...), which `make gen` writes, and its top loads these names from here on first use.
"""

from mesh.status import RpcError
from tandem_client.aio import API_KEY_ENV, DEFAULT_GATEWAY, GATEWAY_ENV, AsyncClient, checkpoint_name
from tandem_client.events import Cursor
from tandem_client.sync import Client

__all__ = [
    "API_KEY_ENV",
    "DEFAULT_GATEWAY",
    "GATEWAY_ENV",
    "AsyncClient",
    "Client",
    "Cursor",
    "RpcError",
    "checkpoint_name",
]
