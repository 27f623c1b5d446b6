"""Manifest parsing, hash normalization, static pod and mirror pod shape."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from nodeagent.pods.podupdate import (
    ANN_CONFIG_HASH,
    ANN_CONFIG_MIRROR,
    ANN_CONFIG_SEEN,
    ANN_CONFIG_SOURCE,
    Source,
)
from nodeagent.pods.sources.static import (
    MAX_MANIFEST_BYTES,
    ManifestError,
    make_static_pod,
    mirror_pod,
    mirror_problem,
    parse_manifest,
    parse_pod_list,
    static_uid,
)

YAML = b"""
apiVersion: v1
kind: Pod
metadata:
  name: web
  labels: {app: web}
spec:
  containers:
  - name: c
    image: busybox
    command: ["sleep", "3600"]
"""
JSON = json.dumps({"kind": "Pod", "spec": {"containers": [
    {"command": ["sleep", "3600"], "image": "busybox", "name": "c"}]},
    "metadata": {"labels": {"app": "web"}, "name": "web", "namespace": "default",
                 "uid": "ignored", "resourceVersion": "9", "annotations": None},
    "apiVersion": "v1", "status": {"phase": "Running"}}, indent=4).encode()
T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def test_hash_ignores_format_key_order_and_server_fields() -> None:
    a = parse_manifest(YAML, "a.yaml")
    b = parse_manifest(JSON, "b.json")
    assert a == b
    assert static_uid(a, Source.FILE, "n1") == static_uid(b, Source.FILE, "n1")
    assert len(static_uid(a, Source.FILE, "n1")) == 32


def test_hash_changes_with_content_node_and_source() -> None:
    a = parse_manifest(YAML, "a.yaml")
    uid = static_uid(a, Source.FILE, "n1")
    assert static_uid(a, Source.FILE, "n2") != uid
    assert static_uid(a, Source.HTTP, "n1") != uid
    edited = parse_manifest(YAML.replace(b"3600", b"3601"), "a.yaml")
    assert static_uid(edited, Source.FILE, "n1") != uid


def test_unquoted_dates_stay_strings() -> None:
    doc = parse_manifest(YAML.replace(b"labels: {app: web}",
                                      b"annotations: {built: 2026-01-01}"), "a.yaml")
    assert doc["metadata"]["annotations"] == {"built": "2026-01-01"}


def test_static_pod_shape() -> None:
    doc = parse_manifest(YAML, "a.yaml")
    p = make_static_pod(doc, Source.FILE, "node-1", T0)
    meta = p["metadata"]
    assert meta["name"] == "web-node-1" and meta["namespace"] == "default"
    assert meta["uid"] == static_uid(doc, Source.FILE, "node-1")
    assert meta["annotations"] == {ANN_CONFIG_HASH: meta["uid"], ANN_CONFIG_SOURCE: "file",
                                   ANN_CONFIG_SEEN: "2026-01-01T00:00:00.000000Z"}
    assert p["spec"]["nodeName"] == "node-1"
    assert doc["metadata"]["name"] == "web"  # the parsed document is not changed


def test_mirror_pod_is_what_node_restriction_admits() -> None:
    p = make_static_pod(parse_manifest(YAML, "a.yaml"), Source.FILE, "node-1", T0)
    m = mirror_pod(p, "node-uid")
    assert m["metadata"]["annotations"][ANN_CONFIG_MIRROR] == p["metadata"]["uid"]
    assert m["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": "node-1", "uid": "node-uid",
         "controller": True}]
    assert "uid" not in m["metadata"] and m["spec"]["nodeName"] == "node-1"
    assert mirror_problem(m) is None


@pytest.mark.parametrize("spec_patch, expect", [
    ({"serviceAccountName": "sa"}, "service account"),
    ({"volumes": [{"name": "v", "secret": {"secretName": "s"}}]}, "spec.volumes[0].secret"),
    ({"volumes": [{"name": "v", "configMap": {"name": "c"}}]}, "configmap"),
    ({"volumes": [{"name": "v", "persistentVolumeClaim": {"claimName": "c"}}]},
     "persistentvolumeclaim"),
    ({"volumes": [{"name": "v", "projected": {"sources": [{"secret": {"name": "s"}}]}}]},
     "projected.sources[0].secret"),
    ({"containers": [{"name": "c", "image": "i", "env": [
        {"name": "X", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}]},
     "spec.containers[0].env[0].valueFrom.secretKeyRef"),
    ({"containers": [{"name": "c", "image": "i", "envFrom": [{"configMapRef": {"name": "c"}}]}]},
     "envFrom[0].configMapRef"),
])
def test_mirror_problems_name_the_reference(spec_patch: dict, expect: str) -> None:
    p = {"metadata": {}, "spec": {"containers": [{"name": "c", "image": "i"}], **spec_patch}}
    problem = mirror_problem(p)
    assert problem is not None and expect in problem


@pytest.mark.parametrize("data, reason, words", [
    (b"apiVersion: v1\nkind: Pod\nmetadata: {name: [\n", "Malformed", "line"),
    (b"\xff\xfe", "Malformed", "UTF-8"),
    (b"", "Invalid", "empty"),
    (b"- a\n- b\n", "NotAPod", "list"),
    (b"apiVersion: apps/v1\nkind: Deployment\n", "NotAPod", "'Deployment'"),
    (b"apiVersion: v2\nkind: Pod\n", "NotAPod", "apiVersion"),
    (b"apiVersion: v1\nkind: Pod\nspec: {}\n", "MissingField", "metadata"),
    (b"apiVersion: v1\nkind: Pod\nmetadata: {}\nspec: {}\n", "MissingField", "metadata.name"),
    (b"apiVersion: v1\nkind: Pod\nmetadata: {name: Bad_Name}\nspec: {}\n", "InvalidField",
     "DNS-1123"),
    (b"apiVersion: v1\nkind: Pod\nmetadata: {name: a}\n", "MissingField", "spec"),
    (b"apiVersion: v1\nkind: Pod\nmetadata: {name: a}\nspec: {containers: []}\n",
     "MissingField", "spec.containers"),
    (b"apiVersion: v1\nkind: Pod\nmetadata: {name: a}\nspec: {containers: [{name: c}]}\n",
     "MissingField", "spec.containers[0].image"),
    (b"apiVersion: v1\nkind: Pod\nmetadata: {name: a}\nspec: {containers: [{image: i}]}\n",
     "MissingField", "spec.containers[0].name"),
    (b"apiVersion: v1\nkind: Pod\nmetadata: {name: a, labels: {x: 1}}\n"
     b"spec: {containers: [{name: c, image: i}]}\n", "InvalidField", "metadata.labels"),
    (YAML + b"---\n" + YAML, "Invalid", "2 documents"),
    (b"!!float x\n", "Malformed", "ValueError"),
    (b"apiVersion: v1\nkind: Pod\nmetadata: {name: a}\n"
     b"spec: {containers: [{name: c, image: i}], initContainers: true}\n",
     "InvalidField", "spec.initContainers must be a list, got True"),
    (b"apiVersion: v1\nkind: Pod\nmetadata: {name: a}\n"
     b"spec: {containers: [{name: c, image: i, command: [sleep, 1]}]}\n",
     "InvalidField", "spec.containers[0].command must be a list of strings, got ['sleep', 1]"),
    (b"apiVersion: v1\nkind: Pod\nmetadata: {name: a}\n"
     b"spec: {containers: [{name: c, image: i, ports: [{containerPort: 70000}]}]}\n",
     "InvalidField", "spec.containers[0].ports[0].containerPort must be a port number"),
    (b"apiVersion: v1\nkind: Pod\nmetadata: {name: a}\n"
     b"spec: {containers: [{name: c, image: i}], hostNetwork: 'yes'}\n",
     "InvalidField", "spec.hostNetwork must be true or false"),
    (b"apiVersion: v1\nkind: Pod\nmetadata: {name: a}\n"
     b"spec: {containers: [{name: c, image: i}], restartPolicy: Sometimes}\n",
     "InvalidField", "spec.restartPolicy must be one of Always, OnFailure, Never"),
    (b"apiVersion: v1\nkind: Pod\nmetadata: {name: a}\n"
     b"spec: {containers: [{name: c, image: i}], volumes: [{name: v, secret: x}]}\n",
     "InvalidField", "spec.volumes[0].secret must be a mapping"),
    (b"apiVersion: v1\nkind: Pod\nmetadata: {name: a, x: .nan}\n"
     b"spec: {containers: [{name: c, image: i}]}\n", "InvalidField", "not a JSON number"),
    (b"apiVersion: v1\nkind: Pod\nmetadata: {name: a, x: !!binary aGk=}\n"
     b"spec: {containers: [{name: c, image: i}]}\n", "InvalidField", "not JSON data"),
])
def test_bad_manifests_name_file_and_problem(data: bytes, reason: str, words: str) -> None:
    with pytest.raises(ManifestError) as info:
        parse_manifest(data, "pods/bad.yaml")
    assert info.value.reason == reason
    assert str(info.value).startswith("pods/bad.yaml: ")
    assert words in str(info.value)


def test_too_large() -> None:
    with pytest.raises(ManifestError, match="over the limit") as info:
        parse_manifest(b"#" * (MAX_MANIFEST_BYTES + 1), "big.yaml")
    assert info.value.reason == "TooLarge"


def test_pod_lists() -> None:
    body = json.dumps({"apiVersion": "v1", "kind": "PodList", "items": [
        json.loads(JSON), {**json.loads(JSON), "metadata": {"name": "other"}}]}).encode()
    pods = parse_pod_list(body, "http://x/")
    assert [p["metadata"]["name"] for p in pods] == ["web", "other"]
    assert len(parse_pod_list(YAML + b"---\n" + YAML.replace(b"web", b"w2"), "u")) == 2
    with pytest.raises(ManifestError, match="defined twice"):
        parse_pod_list(YAML + b"---\n" + YAML, "u")
    with pytest.raises(ManifestError, match=r"items\[1\]: missing required field metadata"):
        parse_pod_list(json.dumps({"kind": "List", "items": [
            json.loads(JSON), {"apiVersion": "v1", "kind": "Pod"}]}).encode(), "u")
