# The ARL-Tangram images: one Dockerfile, three targets, all running the `tangram` command.
#
#   operator     the kopf operator (Helm chart's image); runs as nonroot (65532)
#   scheduler    a pool's scheduler service (tangram serve); runs as nonroot (65532)
#   node-agent   a pool's node agent (tangram agent); runs as root, with the prebuilt
#                static exec server at $TANGRAM_EXECD
#
# The three share one file system (the project in /opt/venv and the exec server) and
# differ only in their user: the operator gives the scheduler Deployments and node-agent
# DaemonSets it creates one image (the chart's `poolImage`, by default the operator's
# own), and their pod specs set the user. Build them with images/build.sh: it makes the
# base images from Debian root file systems (nothing is pulled) and then runs
#   docker build --network host --target T -t arl-tangram/T:VERSION .
# BASE and BUILDER may be any Debian bookworm images with python3 and python3-venv
# (BUILDER also gcc and libc6-dev), e.g. debian:bookworm-slim plus those packages where
# pulling is allowed.

ARG BASE=arl-tangram/base:bookworm
ARG BUILDER=arl-tangram/builder:bookworm

# --- execd: the exec server, compiled as tangram.node_agent.exec_server.build does --------
# (static, so that it runs as PID 1 of any environment image of this architecture)
FROM ${BUILDER} AS execd
COPY node-agent/tangram/node_agent/exec_server.c node-agent/tangram/node_agent/exec_files.c \
     node-agent/tangram/node_agent/exec_tar.c /src/
RUN gcc -static -O2 -o /tangram-execd /src/exec_server.c \
    && test -x /tangram-execd && ! ldd /tangram-execd >/dev/null 2>&1

# --- build: the virtual environment ----------------------------------------------------------
FROM ${BUILDER} AS build
# A PEM bundle pip must trust besides the system's (a TLS-intercepting proxy); only this
# stage sees it.
ARG EXTRA_CA_PEM=""
# Optional extras of the project to install too, e.g. "gpu" (PyTorch and nvidia-ml-py, for
# the GPU pools' node agents: the chart's gpuAgentImage). Several GB: not in the default.
ARG EXTRAS=""
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_DEFAULT_TIMEOUT=120
RUN set -eu; \
    cp /etc/ssl/certs/ca-certificates.crt /tmp/ca.pem; \
    if [ -n "$EXTRA_CA_PEM" ]; then printf '%s\n' "$EXTRA_CA_PEM" >>/tmp/ca.pem; fi
ENV PIP_CERT=/tmp/ca.pem

# Dependencies first (a layer that survives source edits), from pyproject.toml's list.
RUN python3 -m venv /opt/venv && /opt/venv/bin/pip install -q --upgrade pip
COPY pyproject.toml /src/pyproject.toml
RUN EXTRAS="$EXTRAS" python3 -c "import os, tomllib; p = tomllib.load(open('/src/pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + [d for e in os.environ['EXTRAS'].split(',') if e for d in p['optional-dependencies'][e]]))" >/tmp/requirements.txt \
    && /opt/venv/bin/pip install -q -r /tmp/requirements.txt
# Then the project itself (a regular, non-editable install: the source tree stays here).
COPY README.md /src/README.md
COPY scheduler /src/scheduler
COPY operator /src/operator
COPY node-agent /src/node-agent
RUN /opt/venv/bin/pip install -q --no-deps /src \
    && /opt/venv/bin/pip check \
    && /opt/venv/bin/tangram --help >/dev/null \
    && /opt/venv/bin/python -c "import tangram.node_agent.exec_server as e; assert e.SOURCE.exists()"

# --- runtime: what every target holds --------------------------------------------------------
FROM ${BASE} AS runtime
ARG VERSION=0.1.0
COPY --from=build /opt/venv /opt/venv
COPY --from=execd /tangram-execd /usr/local/libexec/tangram/tangram-execd
# PYTHONDONTWRITEBYTECODE: the root file system is read-only in the pods (the venv is
# compiled at install). MPLCONFIGDIR: matplotlib (plots of `tangram bench`) wants a
# writable directory. TANGRAM_EXECD: the agent uses this binary instead of compiling
# exec_server.c (there is no compiler here).
ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    MPLCONFIGDIR=/tmp/matplotlib \
    TANGRAM_EXECD=/usr/local/libexec/tangram/tangram-execd
LABEL org.opencontainers.image.title="ARL-Tangram" \
      org.opencontainers.image.description="Action-level pooling of CPU, GPU and API resources for agentic RL" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
WORKDIR /tmp
CMD ["tangram", "--help"]

# --- the targets -----------------------------------------------------------------------------

# The node agent: root, because it writes cgroupfs files and talks to the Docker socket
# (the DaemonSet also runs it privileged with the host PID namespace: docs/install.md).
FROM runtime AS node-agent
USER 0:0
CMD ["tangram", "agent", "--help"]

# A pool's scheduler service.
FROM runtime AS scheduler
USER 65532:65532
ENV HOME=/home/nonroot
CMD ["tangram", "serve", "--help"]

# The operator (last: the default target of a plain `docker build .`).
FROM runtime AS operator
USER 65532:65532
ENV HOME=/home/nonroot
CMD ["tangram", "--help"]
