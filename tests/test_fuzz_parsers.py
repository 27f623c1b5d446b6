"""Fuzzing the parsers of untrusted input: static pod manifests (a file in the folder, a
URL body) and the agent's config (file, flags, environment).

Whatever the input, the parser either returns or raises the project's own clear error
(ManifestError / ConfigError, whose text names the subject); any other exception is a
bug. Inputs: raw bytes, YAML-ish text built from the characters that matter to YAML,
and valid documents with random values put at random places (the interesting case: it
gets past the first checks).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nodeagent import config
from nodeagent.api.clock import FakeClock
from nodeagent.config import ConfigError
from nodeagent.pods.podupdate import Source
from nodeagent.pods.sources.static import (
    ManifestError,
    canonical,
    check_host_access,
    make_static_pod,
    mirror_pod,
    mirror_problem,
    parse_manifest,
    parse_pod_list,
    static_uid,
)

# NP_FUZZ_EXAMPLES=5000 for a longer hunt; 200 keeps the unit suite fast
FUZZ = settings(max_examples=int(os.environ.get("NP_FUZZ_EXAMPLES", "200")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

POD: dict[str, Any] = {
    "apiVersion": "v1", "kind": "Pod",
    "metadata": {"name": "web", "namespace": "default", "labels": {"app": "web"}},
    "spec": {"containers": [{"name": "c", "image": "busybox",
                             "command": ["sleep", "3600"],
                             "securityContext": {"privileged": False},
                             "env": [{"name": "A", "value": "1",
                                      "valueFrom": {"fieldRef": {"fieldPath": "x"}}}],
                             "envFrom": [{"prefix": "P"}],
                             "ports": [{"containerPort": 80, "hostPort": 0}]}],
             "volumes": [{"name": "v", "emptyDir": {}, "secret": {},
                          "projected": {"sources": [{"configMap": {"name": "x"}}]}}],
             "hostNetwork": False},
}

# JSON-like values, YAML's odd scalars included
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True),
    st.text(max_size=20),
    st.sampled_from(["", "Pod", "v1", "true", "null", "~", "2026-01-01", "0x1F", ".nan",
                     "-.inf", "Bad_Name", "a" * 300, "web", "default"]))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4),
    st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)

# paths into the valid pod where a random value is put
PATHS = [
    ("kind",), ("apiVersion",), ("metadata",), ("metadata", "name"),
    ("metadata", "namespace"), ("metadata", "labels"), ("metadata", "annotations"),
    ("metadata", "labels", "app"), ("spec",), ("spec", "containers"),
    ("spec", "containers", 0), ("spec", "containers", 0, "name"),
    ("spec", "containers", 0, "image"), ("spec", "containers", 0, "securityContext"),
    ("spec", "containers", 0, "securityContext", "privileged"),
    ("spec", "initContainers"), ("spec", "hostNetwork"), ("spec", "hostPID"),
    ("spec", "volumes"), ("status",), ("metadata", "uid"),
    ("spec", "volumes", 0), ("spec", "volumes", 0, "secret"),
    ("spec", "volumes", 0, "projected"), ("spec", "volumes", 0, "projected", "sources"),
    ("spec", "volumes", 0, "projected", "sources", 0),
    ("spec", "containers", 0, "env"), ("spec", "containers", 0, "env", 0),
    ("spec", "containers", 0, "env", 0, "valueFrom"), ("spec", "containers", 0, "envFrom"),
    ("spec", "containers", 0, "ports"), ("spec", "containers", 0, "ports", 0, "hostPort"),
    ("spec", "containers", 0, "command"), ("spec", "restartPolicy"),
    ("spec", "terminationGracePeriodSeconds"), ("spec", "ephemeralContainers"),
]


def put(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    doc = copy.deepcopy(doc)
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return doc


def accept(data: bytes, *, as_list: bool = False) -> None:
    """Parse like the sources do; only ManifestError may come out."""
    try:
        docs = parse_pod_list(data, "u") if as_list else [parse_manifest(data, "f.yaml")]
        for doc in docs:
            check_host_access(doc, "f.yaml")
            static_uid(doc, Source.FILE, "n1")
            json.loads(canonical(doc))  # what is hashed is JSON data
            static = make_static_pod(doc, Source.FILE, "n1", FakeClock().now())
            mirror_problem(static)  # the mirror manager reads what the parser passed
            mirror_pod(static, "node-uid")
    except ManifestError as e:
        assert str(e).startswith(("f.yaml", "u")), str(e)


@FUZZ
@given(st.binary(max_size=400))
def test_manifest_bytes(data: bytes) -> None:
    accept(data)
    accept(data, as_list=True)


# YAML text from the pieces that matter to YAML (anchors, aliases, tags, merge keys)
yaml_text = st.lists(st.sampled_from(list("ab:-[]{},&*!|>'\"#\n ?%@`0.~\t") +
                                     ["  ", "- ", ": ", "&a ", "*a", "!!binary ",
                                      "!!python/object ", "<<: ", "!!set ", "!!float "]),
                     max_size=60).map("".join)


@FUZZ
@given(yaml_text)
def test_manifest_yaml_text(text: str) -> None:
    accept(text.encode())
    accept(("apiVersion: v1\nkind: Pod\nmetadata:\n  name: " + text).encode())


@FUZZ
@given(st.sampled_from(PATHS), values, st.sampled_from(["json", "yaml"]))
def test_manifest_with_a_random_value(path: tuple[Any, ...], value: Any, fmt: str) -> None:
    doc = put(POD, path, value)
    data = (json.dumps(doc) if fmt == "json" else yaml.safe_dump(doc)).encode()
    accept(data)
    accept(json.dumps({"apiVersion": "v1", "kind": "PodList", "items": [POD, doc]}).encode(),
           as_list=True)


def test_yaml_alias_bombs_are_refused() -> None:
    """Self-reference and exponential expansion through aliases: refused, not expanded."""
    loop = b"apiVersion: v1\nkind: Pod\nmetadata: {name: a}\nspec: &s {containers: [*s]}\n"
    laughs = [b"a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        refs = ", ".join([f"*a{i - 1}"] * 10)
        laughs.append(f"a{i}: &a{i} [{refs}]".encode())
    bomb = (b"apiVersion: v1\nkind: Pod\nmetadata:\n  name: a\n  x:\n" +
            b"\n".join(b"    " + line for line in laughs) +
            b"\nspec: {containers: [{name: c, image: i}]}\n")
    for data, words in ((loop, "nested more than"), (bomb, "more than 100000 values")):
        try:
            parse_manifest(data, "bomb.yaml")
        except ManifestError as e:
            assert e.reason == "TooLarge" and words in str(e), str(e)
        else:
            raise AssertionError("an alias bomb was accepted")


# -- the agent's config ---------------------------------------------------------------

KEYS = sorted({o.key for o in config.OPTIONS if o.key})
FLAGS = sorted({o.flag for o in config.OPTIONS if o.flag})


def load_file(tmp: Path, data: Any) -> None:
    path = tmp / "agent.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    try:
        config.load({"config": str(path), "node-name": "n1"}, {})
    except ConfigError as e:
        assert str(path) in str(e) or "--node-name" in str(e) or "setting" in str(e) \
            or "agent id" in str(e) or "--" in str(e), str(e)


@FUZZ
@given(st.dictionaries(st.sampled_from(KEYS), values, max_size=4))
def test_config_file_values(tmp_path_factory: Any, data: dict[str, Any]) -> None:
    load_file(tmp_path_factory.mktemp("cfg"), data)


@FUZZ
@given(st.one_of(yaml_text, st.dictionaries(st.text(max_size=10), scalars, max_size=3)))
def test_config_file_shape(tmp_path_factory: Any, data: Any) -> None:
    load_file(tmp_path_factory.mktemp("cfg"), data)


@FUZZ
@given(st.dictionaries(st.sampled_from(FLAGS), st.text(max_size=30), max_size=4),
       st.booleans())
def test_config_flags_and_env(flags: dict[str, str], as_env: bool) -> None:
    """Flags and variables are strings, whatever they hold."""
    try:
        if as_env:
            config.load({}, {config.env_name(k): v for k, v in flags.items()})
        else:
            config.load(flags, {})
    except ConfigError as e:
        assert "--" in str(e) or "$NODEPULSE_" in str(e) or "agent id" in str(e) \
            or "setting" in str(e) or "node name prefix" in str(e), str(e)
