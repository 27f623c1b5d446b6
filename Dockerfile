# One image for both programs: nodepulse-operator and nodepulse-agent.
#
#   docker build -t nodepulse:0.1.0 .
#
# The chart runs it as user 10001 with a read-only root filesystem. PYTHON_IMAGE is the
# base: the public one by default; the tests, which reach no registry, pass one made
# from Debian's packages (e2e/kind/images.py, docs/development.md, "How the tests build images").
# No `# syntax=` line: BuildKit would fetch that frontend from a registry.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: the nodepulse wheel and every dependency as wheels
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY nodeagent ./nodeagent
COPY operator ./operator
COPY nodepulse_dev ./nodepulse_dev
RUN pip wheel --wheel-dir /wheels .

# ---- runtime: the wheels installed into a slim base, nothing else
FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-index --find-links=/wheels nodepulse \
    # byte-compile now: at run time the root filesystem is read-only
    && python -m compileall -q "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    && groupadd --system --gid 10001 nodepulse \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin nodepulse
USER 10001:10001
WORKDIR /tmp
EXPOSE 8080 8081
# The chart sets the command; without one the image runs the operator (in a pod it
# uses the pod's service account).
CMD ["nodepulse-operator"]
