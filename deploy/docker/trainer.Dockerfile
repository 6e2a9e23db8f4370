# The image Tandem's task pods run in: the trainer and inference workers (the `gpu` extra: vLLM, which
# brings its CUDA build of torch) on a CUDA runtime base, plus the Tandem package itself so a task can open
# its secrets (python -m services.scheduler.backends.task_secrets) and run `python -m trainer`.
# Build from the repository root on a machine with network access to PyPI:
#   docker build -f deploy/docker/trainer.Dockerfile -t ghcr.io/tandem-rl/tandem-trainer:0.1.0 .
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu22.04

ARG DEBIAN_FRONTEND=noninteractive
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends software-properties-common ca-certificates curl git \
    && add-apt-repository -y ppa:deadsnakes/ppa \
    && apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev build-essential \
    && rm -rf /var/lib/apt/lists/*
RUN python3.11 -m venv /opt/tandem
ENV PATH=/opt/tandem/bin:$PATH

WORKDIR /src
COPY pyproject.toml README.md ./
COPY gen gen
COPY mesh mesh
COPY services services
COPY gateway gateway
COPY tandem_taskapp tandem_taskapp
COPY trainer trainer
RUN pip install --upgrade pip && pip install '.[gpu,storage]'

RUN groupadd --gid 10001 tandem && useradd --uid 10001 --gid tandem --create-home tandem
USER 10001:10001
WORKDIR /home/tandem
CMD ["python", "-m", "trainer", "--help"]
