# The two commands of the README: `make run` and `make test`.
.PHONY: setup run down test lint unit e2e

setup:
	@scripts/setup.sh

run: setup
	.venv/bin/python -m e2e.cluster up

down:
	.venv/bin/python -m e2e.cluster down

lint: setup
	.venv/bin/ruff check .
	.venv/bin/mypy nodeagent operator e2e tests bench

test: lint
	.venv/bin/pytest tests e2e

unit: setup
	.venv/bin/pytest tests
