from tandem_client import AsyncClient as AsyncClient
from tandem_client import Client as Client
from tandem_client import Cursor as Cursor
from tandem_client import RpcError as RpcError
from tandem_client import checkpoint_name as checkpoint_name

SDK: tuple[str, ...]
