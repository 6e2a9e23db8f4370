"""Container images for tests, made on the spot without a registry or network: a root file system holding
this machine's bash (with the libraries `ldd` names) and a static busybox for the few commands a test task
runs, imported into podman's local store.

    image = import_image(podman, tmp_path, "localhost/tandem-test:1", {"etc/marker": b"..."})
    conf = containers_conf_that_runs(podman, image, tmp_path)  # None: podman runs it as configured

Some machines' podman cannot start a container as configured: crun refuses cgroup v1 + v2 ("hybrid") hosts,
and podman raises RLIMIT_NOFILE / RLIMIT_NPROC above what a process without CAP_SYS_RESOURCE may set. There
`containers_conf_that_runs` writes a containers.conf (runc, and limits at this process's own) that the test
passes as CONTAINERS_CONF, the machine-wide setting an operator of such a host would make.
"""

from __future__ import annotations

import re
import resource
import shutil
import subprocess
import tarfile
from pathlib import Path

BUSYBOX = "/bin/busybox"
APPLETS = ("cat", "echo", "env", "id", "ls", "sleep", "test", "true", "pwd", "sh")


def _libraries(binary: str) -> list[str]:
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
    return [m for m in re.findall(r"(/\S+)", out) if Path(m).exists()]


def import_image(podman: str, folder: Path, name: str, files: dict[str, bytes]) -> str:
    """`name` in podman's store: bash, busybox's APPLETS on /bin, and `files` (path in the image -> bytes)."""
    bash = shutil.which("bash")
    if bash is None or not Path(BUSYBOX).exists():
        raise RuntimeError(
            "an image for the test needs bash and a static busybox (apt-get install busybox-static)"
        )
    root = folder / "image-root"
    (root / "bin").mkdir(parents=True)
    (root / "tmp").mkdir()
    shutil.copy2(bash, root / "bin" / "bash")
    for library in _libraries(bash):
        target = root / library.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(Path(library).resolve(), target)
    shutil.copy2(BUSYBOX, root / "bin" / "busybox")
    for applet in APPLETS:
        (root / "bin" / applet).symlink_to("busybox")
    for path, data in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)
    archive = folder / "image.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(root, arcname=".")
    subprocess.run([podman, "import", str(archive), name], capture_output=True, check=True, timeout=120)
    return name


def _runs(podman: str, image: str, conf: Path | None) -> subprocess.CompletedProcess[str]:
    env = None if conf is None else {"CONTAINERS_CONF": str(conf), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    return subprocess.run(
        [podman, "run", "--rm", image, "bash", "-c", "true"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )


def containers_conf_that_runs(podman: str, image: str, folder: Path) -> Path | None:
    """None where podman runs `image` as configured; else a containers.conf under `folder` with which it does.
    Raises RuntimeError, with podman's own words, where neither does."""
    plain = _runs(podman, image, None)
    if plain.returncode == 0:
        return None
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    nproc = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], pid_max)
    conf = folder / "containers.conf"
    conf.write_text(
        f'[containers]\ndefault_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]\n'
        + ('[engine]\nruntime = "runc"\n' if shutil.which("runc") else "")
    )
    fixed = _runs(podman, image, conf)
    if fixed.returncode != 0:
        raise RuntimeError(
            f"podman cannot run a container here: {plain.stderr.strip()} / {fixed.stderr.strip()}"
        )
    return conf
