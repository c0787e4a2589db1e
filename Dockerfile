# The presto-sd service image: one image for every component of the Helm chart (drafter,
# verifier, the orchestrator on the Ray head and the Ray workers, the model fetcher, the
# test hook). Entrypoint `presto-sd`: the chart runs `presto-sd serve drafter|verifier ...`.
#
# Build from the repository root (docs/deploy.md, "Build the image"):
#   docker build -t REGISTRY/presto-sd:0.1.0-cu128 .                           # GPU pools
#   docker build -t REGISTRY/presto-sd:0.1.0-cpu --build-arg TORCH_VARIANT=cpu .  # no GPU
#
# Model weights are not in the image: mount them at /models ($PRESTO_SD_CACHE), where
# `presto-sd models fetch` and the chart's fetch init container put them.

# Pinned base (never `latest`); build and runtime stages must share it, the venv is copied.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# torch build: "cpu", or a CUDA variant the torch release publishes ("cu128", ...). The
# version matches scripts/setup.sh and pyproject.toml's upper bound.
ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cu128
# Ray for the orchestrator (KubeRay head and workers); match the chart's
# orchestrator.kuberay.rayVersion. [default] brings the dashboard and metrics agent.
ARG RAY_VERSION=2.60.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/presto-sd
ENV PATH=/opt/presto-sd/bin:$PATH
# torch first, from the index of the chosen variant; the constraint file then keeps every
# later install on exactly that build (no pip resolve may swap in another torch)
RUN pip install --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}" \
        "torch==${TORCH_VERSION}+${TORCH_VARIANT}" \
    && echo "torch==${TORCH_VERSION}+${TORCH_VARIANT}" > /opt/presto-sd/constraints.txt
WORKDIR /src
COPY pyproject.toml README.md ./
COPY presto_sd ./presto_sd
COPY drafter_service ./drafter_service
COPY verifier_service ./verifier_service
COPY orchestrator ./orchestrator
COPY presto_pb ./presto_pb
RUN pip install --constraint /opt/presto-sd/constraints.txt . "ray[default]==${RAY_VERSION}"

FROM ${PYTHON_IMAGE}
ARG TORCH_VARIANT=cu128
# wget: KubeRay's default probes on Ray worker pods call it; bash and flock (util-linux)
# are in the base already (the head's start script, the fetch init container's lock). The
# CPU image adds a C compiler: a CPU verifier's bf16 decode attention is a small C kernel
# built on first use for the node's own CPU, into $PRESTO_SD_CACHE/kernels (docs/design.md);
# without one it runs torch's SDPA, slower and as lossless
RUN apt-get update \
    && apt-get install -y --no-install-recommends wget \
        $(if [ "$TORCH_VARIANT" = cpu ]; then echo gcc libc6-dev; fi) \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --gid 10001 presto \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/presto --shell /bin/bash presto \
    && mkdir -p /models \
    && chown 10001:10001 /models
COPY --from=build /opt/presto-sd /opt/presto-sd
ENV PATH=/opt/presto-sd/bin:$PATH \
    PRESTO_SD_CACHE=/models \
    PYTHONUNBUFFERED=1
VOLUME ["/models"]
WORKDIR /home/presto
# uid 10001, as the chart's podSecurityContext.runAsUser (numeric, so runAsNonRoot can check it)
USER 10001:10001
# orchestrator (Generate API), drafter, verifier
EXPOSE 50050 50051 50052
ENTRYPOINT ["presto-sd"]
CMD ["--help"]
