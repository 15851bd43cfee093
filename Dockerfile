# kvroute images: one target per component, all from one build stage.
#
#   docker build --target controlplane -t kvroute/controlplane:0.1.0 .
#   docker build --target proxy        -t kvroute/proxy:0.1.0 .
#   docker build --target sidecar      -t kvroute/sidecar:0.1.0 .
#   docker build --target sim          -t kvroute/sim:0.1.0 .
#
# The final stages hold the Python runtime and a virtual environment with kvroute and its
# dependencies, compiled to bytecode at build time (the containers run with a read-only
# root filesystem), the proxy's request path compiled to C by mypyc (dataplane/native.py),
# and nothing else: no pip, no compiler, no package manager cache. They
# run as the unprivileged user 10001. Every server binds to 127.0.0.1 unless told
# otherwise: give --host 0.0.0.0 (or KVROUTE_HOST) in a container, as deploy/ does.
# Pin the base by digest too where your registry policy asks for it:
#   docker buildx imagetools inspect python:3.11.14-slim-bookworm

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

# --- build: wheels and the virtual environment ------------------------------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY kvcore ./kvcore
COPY kvruntime ./kvruntime
COPY controlplane ./controlplane
COPY sidecar ./sidecar
COPY dataplane ./dataplane
COPY enginesim ./enginesim
COPY kvroute ./kvroute
COPY bench ./bench
COPY migrations ./migrations
# The control plane finds its Alembic migrations beside its package (the repository's
# root in a checkout, site-packages once installed).
# KVROUTE_NATIVE=1: setup.py compiles the proxy's request path with mypyc (the same mypy
# as the dev extra's), which leaves with the other build tools once the wheel is in.
RUN python -m venv /opt/kvroute \
    && /opt/kvroute/bin/pip install "mypy==2.4.1" "setuptools>=69" wheel \
    && KVROUTE_NATIVE=1 /opt/kvroute/bin/pip install --no-build-isolation . \
    && cp -r migrations /opt/kvroute/lib/python3.11/site-packages/migrations \
    && /opt/kvroute/bin/pip uninstall -y mypy pip setuptools wheel \
    && /opt/kvroute/bin/python -m compileall -q /opt/kvroute

# --- runtime: what every component image shares ---------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
RUN rm -rf /usr/local/lib/python3.11/site-packages/pip /usr/local/bin/pip* \
    && groupadd --gid 10001 kvroute \
    && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin kvroute
COPY --from=build /opt/kvroute /opt/kvroute
ENV PATH=/opt/kvroute/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/tmp/hf
WORKDIR /tmp
USER 10001:10001

# --- one target per component -----------------------------------------------------------------
FROM runtime AS controlplane
EXPOSE 8080 50051
ENTRYPOINT ["kvroute-controlplane"]

FROM runtime AS proxy
EXPOSE 8000
ENTRYPOINT ["kvroute-proxy"]

FROM runtime AS epp
EXPOSE 9002 9003 9090
ENTRYPOINT ["kvroute-epp"]

FROM runtime AS sidecar
EXPOSE 9100
ENTRYPOINT ["kvroute-sidecar"]

FROM runtime AS sim
EXPOSE 8100 5557 5558
ENTRYPOINT ["kvroute-sim"]
