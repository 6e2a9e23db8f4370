# The Tandem platform services (gateway, vault, scheduler, taskapp-proxy, events) in one slim image; no
# torch, no CUDA. Build from the repository root:
#   docker build -f deploy/docker/services.Dockerfile -t ghcr.io/tandem-rl/tandem-services:0.1.0 .
# Run one service per container: `python -m gateway`, `python -m services.vault`, ... (deploy/README.md).
FROM python:3.11-slim AS build

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gen gen
COPY mesh mesh
COPY services services
COPY gateway gateway
COPY tandem_taskapp tandem_taskapp
# trainer/config.py and trainer/placement.py are torch-free and shared with the scheduler's spec checks;
# the base install below pulls no ML packages.
COPY trainer trainer
RUN python -m venv /opt/tandem && /opt/tandem/bin/pip install --upgrade pip && /opt/tandem/bin/pip install .

FROM python:3.11-slim

ENV PATH=/opt/tandem/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 TANDEM_HOST=0.0.0.0 \
    TANDEM_STATE_DIR=/var/lib/tandem
RUN groupadd --gid 10001 tandem && useradd --uid 10001 --gid tandem --no-create-home tandem \
    && mkdir -p /var/lib/tandem && chown tandem:tandem /var/lib/tandem
COPY --from=build /opt/tandem /opt/tandem
USER 10001:10001
WORKDIR /var/lib/tandem
EXPOSE 50050 50051 50052 50053 50054
ENTRYPOINT ["python"]
CMD ["-m", "gateway"]
