"""Generate the Python code for every contract under protos/ into gen/python/.

Run with `make gen` (or `python scripts/gen.py`). The output is committed; `--check` regenerates into a
temporary folder and fails when it differs from what is committed, which is how CI catches drift.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc_tools

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
OUT = ROOT / "gen" / "python"
WELL_KNOWN = Path(grpc_tools.__file__).parent / "_proto"
# The top package: the generated contracts below it, and the Python SDK's clients as `tandem.Client` and
# `tandem.AsyncClient` (templates beside this script; loaded on first use, as tandem_client imports the contracts).
TOP_INIT = Path(__file__).with_name("tandem_top.py.in")
TOP_STUB = Path(__file__).with_name("tandem_top.pyi.in")


def generate(out: Path) -> None:
    protos = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto"))
    if not protos:
        sys.exit("no .proto files under protos/")
    out.mkdir(parents=True, exist_ok=True)
    bindir = Path(sys.executable).parent
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{PROTOS}",
        f"-I{WELL_KNOWN}",
        f"--plugin=protoc-gen-mypy={bindir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={bindir / 'protoc-gen-mypy_grpc'}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_out=quiet:{out}",
        f"--mypy_grpc_out=quiet:{out}",
        *protos,
    ]
    subprocess.run(cmd, check=True, cwd=PROTOS)
    # Regular packages (not namespace packages) so every tool resolves `tandem.<area>.v1` the same way.
    for folder in [p for p in out.rglob("*") if p.is_dir()] + [out / "tandem"]:
        init = folder / "__init__.py"
        if not init.exists():
            init.write_text("")
    shutil.copyfile(TOP_INIT, out / "tandem" / "__init__.py")
    shutil.copyfile(TOP_STUB, out / "tandem" / "__init__.pyi")


def differences(a: Path, b: Path) -> list[str]:
    cmp = filecmp.dircmp(a, b, ignore=["__pycache__"])
    found = [f"only in committed: {n}" for n in cmp.left_only]
    found += [f"missing from committed: {n}" for n in cmp.right_only]
    found += [f"differs: {n}" for n in cmp.diff_files]
    for sub, sub_cmp in cmp.subdirs.items():
        found += [f"{sub}/{d}" for d in differences(Path(sub_cmp.left), Path(sub_cmp.right))]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if gen/python differs from the protos")
    args = parser.parse_args()
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            fresh = Path(tmp) / "python"
            generate(fresh)
            drift = differences(OUT, fresh)
        if drift:
            print("generated code is out of date; run `make gen` and commit:", *drift, sep="\n  ")
            sys.exit(1)
        print("generated code matches the protos")
        return
    shutil.rmtree(OUT / "tandem", ignore_errors=True)
    generate(OUT)
    print(f"generated Python code into {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
