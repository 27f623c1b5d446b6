"""Namespaces for the tests' pods."""

from __future__ import annotations

from kubernetes import client

from e2e.harness.waits import eventually


def create_namespace(core: client.CoreV1Api, name: str) -> None:
    """Create the namespace and wait for its default ServiceAccount: pods are refused
    until it exists."""
    core.create_namespace({"metadata": {"name": name}})
    eventually(lambda: core.list_namespaced_service_account(
        name, field_selector="metadata.name=default").items,
        f"the default ServiceAccount of namespace {name}")
