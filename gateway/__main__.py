"""Run the gateway alone (the deployment shape): `python -m gateway`."""

from mesh.server import run_single

if __name__ == "__main__":
    run_single("gateway")
