# The two commands of the README: `make run` and `make test`.
.PHONY: setup run up down test lint unit e2e-kind

# apt packages, the venv, and the control plane built from its Go modules (once, cached)
setup:
	@scripts/setup.sh

# the whole system in the foreground (docs/dev-cluster.md): control plane, CRDs,
# policies, operator, metrics-server, this machine's node on containerd and a pool of
# virtual nodes; it prints what to try (e2e/test_dev_cluster.py runs every line)
run: setup
	.venv/bin/nodepulse-dev up --foreground --runtime cri --virtual-nodes 5

# only the control plane, in the background (stop it with `make down`)
up: setup
	.venv/bin/nodepulse-dev up --control-plane-only

down:
	.venv/bin/nodepulse-dev down

lint: setup
	.venv/bin/ruff check .
	.venv/bin/mypy nodeagent operator nodepulse_dev e2e tests bench

test: lint
	.venv/bin/pytest --durations=40 tests e2e

unit: setup
	.venv/bin/pytest tests

# only the kind part of `make test`: a private dockerd, the images, a kind cluster, the
# chart on it and the e2e scenarios against it (e2e/kind)
e2e-kind: setup
	.venv/bin/pytest e2e/kind
