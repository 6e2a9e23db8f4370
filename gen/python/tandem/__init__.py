"""Tandem: the contracts generated from protos/ (`tandem.<area>.v1`) and the Python SDK.

    import tandem

    with tandem.Client() as client:  # the gateway from TANDEM_GATEWAY, key from TANDEM_API_KEY
        print([job.name for job in client.list_jobs()])

`tandem.Client`, `tandem.AsyncClient` and the rest of the SDK live in `tandem_client`. Written by scripts/gen.py.
"""

from typing import Any

SDK = ("AsyncClient", "Client", "Cursor", "RpcError", "checkpoint_name")


def __getattr__(name: str) -> Any:
    if name in SDK:
        import tandem_client

        return getattr(tandem_client, name)
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")
