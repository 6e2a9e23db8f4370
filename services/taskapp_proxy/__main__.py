"""Run the taskapp_proxy service alone (the deployment shape): `python -m services.taskapp_proxy`.

Settings come from TANDEM_* environment variables and the TOML file in TANDEM_CONFIG (see mesh.settings).
"""

from mesh.server import run_single

if __name__ == "__main__":
    run_single("taskapp_proxy")
