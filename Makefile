# The two commands of the README: `make run` and `make test`.
.PHONY: setup run up down test lint unit e2e-kind

setup:
	@scripts/setup.sh

# the whole system in the foreground: control plane, CRDs, operator, agent
run: setup
	.venv/bin/python -m e2e.stack

# only the control plane, in the background (stop it with `make down`)
up: setup
	.venv/bin/python -m nodepulse_dev up

down:
	.venv/bin/python -m nodepulse_dev down

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
