"""Static pods: parsing and checking manifests, the content hash, and mirror pods.

A manifest (YAML or JSON, from a file or a URL) becomes a static pod:
- name `<name>-<node>`, `spec.nodeName` = node, namespace defaulted to `default`;
- UID = hash of (source, node, normalized pod): the same content always gives the
  same UID, any real change gives a new one; `kubernetes.io/config.hash` = the UID;
- `kubernetes.io/config.source` (file|http) and `kubernetes.io/config.seen`.

Normalization makes the hash blind to formatting: YAML vs JSON, whitespace, key order,
explicit nulls, and the fields a manifest cannot own (uid, resourceVersion, status...).
"""

from __future__ import annotations

import copy
import datetime as dt
import hashlib
import json
import math
import re
from typing import Any

import yaml

from nodeagent.api.clock import api_microtime
from nodeagent.pods.podupdate import (
    ANN_CONFIG_HASH,
    ANN_CONFIG_MIRROR,
    ANN_CONFIG_SEEN,
    ANN_CONFIG_SOURCE,
    Pod,
    Source,
)

MAX_MANIFEST_BYTES = 1 << 20  # 1 MiB per manifest file
# After YAML aliases are expanded: a small file can stand for a huge or endless tree
# ("billion laughs", an alias to itself), which is refused rather than expanded.
MAX_DEPTH = 64
MAX_NODES = 100_000

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# Set by the API server or the agent, never by a manifest: ignored for the hash.
_SERVER_META = ("uid", "resourceVersion", "creationTimestamp", "selfLink", "generation",
                "managedFields", "deletionTimestamp", "deletionGracePeriodSeconds")


class ManifestError(ValueError):
    """A manifest that cannot become a pod. `str()` names the manifest and the problem."""

    def __init__(self, subject: str, problem: str, reason: str = "Invalid") -> None:
        super().__init__(f"{subject}: {problem}")
        self.subject = subject
        self.problem = problem
        self.reason = reason  # short CamelCase word for metrics and Events


# libyaml's parser when PyYAML has it (about 8x faster on a typical manifest).
_SafeLoader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _Loader(_SafeLoader):  # type: ignore[valid-type,misc]
    """SafeLoader without YAML 1.1 timestamps: an unquoted date stays a string, as it
    would in the API's JSON (and json.dumps can hash it)."""


_Loader.yaml_implicit_resolvers = {
    k: [(tag, rx) for tag, rx in v if tag != "tag:yaml.org,2002:timestamp"]
    for k, v in _SafeLoader.yaml_implicit_resolvers.items()
}


# What PyYAML's safe constructors raise besides YAMLError on bad input ("!!float x":
# ValueError, "!!float" with nothing: IndexError; deep nesting: RecursionError).
YAML_CRASHES = (ValueError, TypeError, IndexError, KeyError, OverflowError, RecursionError)


def parse_documents(data: bytes, subject: str) -> list[Any]:
    """YAML or JSON (JSON is YAML) -> the non-empty documents it holds."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ManifestError(subject, f"not UTF-8 text (byte {e.start})", "Malformed") from e
    if text.lstrip().startswith("{"):
        try:
            return [json.loads(text)]  # JSON: the fast path (YAML errors name lines, below)
        except ValueError:
            pass
    try:
        docs = [d for d in yaml.load_all(text, Loader=_Loader) if d is not None]
    except yaml.YAMLError as e:
        where = ""
        mark = getattr(e, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ManifestError(subject, f"malformed YAML/JSON{where}: {problem}",
                            "Malformed") from e
    except YAML_CRASHES as e:
        # PyYAML's constructors fail this way on some explicit tags ("!!float x")
        raise ManifestError(subject, f"malformed YAML/JSON: {type(e).__name__}: {e}",
                            "Malformed") from e
    return docs


def parse_manifest(data: bytes, subject: str) -> dict[str, Any]:
    """One file = one Pod. Returns the checked, normalized pod document."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(subject, f"{len(data)} bytes, over the limit of "
                            f"{MAX_MANIFEST_BYTES} bytes", "TooLarge")
    docs = parse_documents(data, subject)
    if not docs:
        raise ManifestError(subject, "empty manifest: no document", "Invalid")
    if len(docs) > 1:
        raise ManifestError(subject, f"{len(docs)} documents; a manifest file holds one Pod",
                            "Invalid")
    return check_pod(docs[0], subject)


def parse_pod_list(data: bytes, subject: str) -> list[dict[str, Any]]:
    """A URL body: one Pod, a PodList/List of Pods, or several YAML documents of Pods."""
    docs = parse_documents(data, subject)
    pods: list[dict[str, Any]] = []
    for i, doc in enumerate(docs):
        where = subject if len(docs) == 1 else f"{subject} (document {i + 1})"
        if isinstance(doc, dict) and doc.get("kind") in ("PodList", "List"):
            items = doc.get("items")
            if not isinstance(items, list):
                raise ManifestError(where, f"{doc.get('kind')} without an items list")
            pods.extend(check_pod(item, f"{where} items[{j}]") for j, item in enumerate(items))
        else:
            pods.append(check_pod(doc, where))
    seen: dict[str, int] = {}
    for i, pod in enumerate(pods):
        key = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
        if key in seen:
            raise ManifestError(subject, f"pod {key} defined twice (entries {seen[key] + 1} "
                                f"and {i + 1})", "Duplicate")
        seen[key] = i
    return pods


def check_pod(doc: Any, subject: str) -> dict[str, Any]:
    """Check that `doc` is a Pod with the fields we need; return it normalized."""
    if not isinstance(doc, dict):
        raise ManifestError(subject, f"not a Pod: the document is a {type(doc).__name__}, "
                            "not a mapping", "NotAPod")
    kind, api_version = doc.get("kind"), doc.get("apiVersion")
    if kind != "Pod":
        raise ManifestError(subject, f"not a Pod: kind is {kind!r}", "NotAPod")
    if api_version != "v1":
        raise ManifestError(subject, f"apiVersion is {api_version!r}, a Pod is 'v1'", "NotAPod")
    pod = _drop_nulls(doc, subject, [MAX_NODES])
    meta = pod.get("metadata")
    if not isinstance(meta, dict):
        raise ManifestError(subject, "missing required field metadata", "MissingField")
    name = meta.get("name")
    if not name:
        raise ManifestError(subject, "missing required field metadata.name", "MissingField")
    if not isinstance(name, str) or not _DNS_SUBDOMAIN.match(name) or len(name) > 253:
        raise ManifestError(subject, f"metadata.name {name!r} is not a DNS-1123 subdomain",
                            "InvalidField")
    ns = meta.setdefault("namespace", "default")
    if not isinstance(ns, str) or not _DNS_LABEL.match(ns) or len(ns) > 63:
        raise ManifestError(subject, f"metadata.namespace {ns!r} is not a DNS-1123 label",
                            "InvalidField")
    for field in ("labels", "annotations"):
        value = meta.get(field)
        if value is not None and not (isinstance(value, dict) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in value.items())):
            raise ManifestError(subject, f"metadata.{field} must map strings to strings",
                                "InvalidField")
    spec = pod.get("spec")
    if not isinstance(spec, dict):
        raise ManifestError(subject, "missing required field spec", "MissingField")
    containers = spec.get("containers")
    if not isinstance(containers, list) or not containers:
        raise ManifestError(subject, "missing required field spec.containers "
                            "(a non-empty list)", "MissingField")
    _check_types(spec, _SPEC_TYPES, "spec", subject)
    if "ephemeralContainers" in spec:
        raise ManifestError(subject, "spec.ephemeralContainers: a static pod cannot have "
                            "ephemeral containers", "InvalidField")
    for i, vol in enumerate(spec.get("volumes") or []):
        if not isinstance(vol, dict) or not isinstance(vol.get("name"), str) \
                or not _DNS_LABEL.match(vol["name"]):
            raise ManifestError(subject, f"spec.volumes[{i}] needs a name that is a DNS-1123 "
                                "label", "InvalidField")
        for kind, body in vol.items():
            if kind != "name" and not isinstance(body, dict):
                raise ManifestError(subject, f"spec.volumes[{i}].{kind} must be a mapping",
                                    "InvalidField")
        sources = vol.get("projected", {}).get("sources", [])
        if not (isinstance(sources, list) and all(isinstance(x, dict) for x in sources)):
            raise ManifestError(subject, f"spec.volumes[{i}].projected.sources must be a "
                                "list of mappings", "InvalidField")
    names: set[str] = set()
    for group in ("initContainers", "containers"):
        for i, c in enumerate(spec.get(group) or []):
            path = f"spec.{group}[{i}]"
            if not isinstance(c, dict):
                raise ManifestError(subject, f"{path} is not a mapping", "InvalidField")
            _check_types(c, _CONTAINER_TYPES, path, subject)
            for j, env in enumerate(c.get("env") or []):
                if not isinstance(env, dict) or not isinstance(env.get("name"), str) \
                        or not env["name"] or not isinstance(env.get("value", ""), str) \
                        or not isinstance(env.get("valueFrom", {}), dict):
                    raise ManifestError(subject, f"{path}.env[{j}] needs a name, and a string "
                                        "value or a valueFrom mapping", "InvalidField")
            for j, port in enumerate(c.get("ports") or []):
                for key, low in (("containerPort", 1), ("hostPort", 0)):
                    v = port.get(key, low if key == "hostPort" else None)
                    if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= 65535:
                        raise ManifestError(subject, f"{path}.ports[{j}].{key} must be a "
                                            f"port number ({low}-65535), got {v!r}",
                                            "InvalidField")
            cname = c.get("name")
            if not cname:
                raise ManifestError(subject, f"missing required field {path}.name",
                                    "MissingField")
            if not isinstance(cname, str) or not _DNS_LABEL.match(cname):
                raise ManifestError(subject, f"{path}.name {cname!r} is not a DNS-1123 label",
                                    "InvalidField")
            if cname in names:
                raise ManifestError(subject, f"{path}.name {cname!r} is used twice",
                                    "InvalidField")
            names.add(cname)
            if not isinstance(c.get("image"), str) or not c["image"]:
                raise ManifestError(subject, f"missing required field {path}.image",
                                    "MissingField")
    for k in _SERVER_META:
        meta.pop(k, None)
    pod.pop("status", None)
    return pod


_LIST, _MAP, _STR, _BOOL, _INT = list, dict, str, bool, int
# The types of the fields the agent itself reads (the runtime, the pod workers, the
# checks above): what the API server's validation guarantees for pods from the API.
_SPEC_TYPES: dict[str, Any] = {
    "containers": _LIST, "initContainers": _LIST, "volumes": _LIST, "readinessGates": _LIST,
    "tolerations": _LIST, "imagePullSecrets": _LIST, "hostNetwork": _BOOL,
    "hostPID": _BOOL, "hostIPC": _BOOL, "hostname": _STR, "subdomain": _STR,
    "serviceAccountName": _STR, "serviceAccount": _STR, "nodeName": _STR,
    "nodeSelector": _MAP, "securityContext": _MAP, "dnsConfig": _MAP,
    "terminationGracePeriodSeconds": _INT, "activeDeadlineSeconds": _INT,
    "restartPolicy": ("Always", "OnFailure", "Never"),
    "dnsPolicy": ("ClusterFirst", "ClusterFirstWithHostNet", "Default", "None"),
}
_CONTAINER_TYPES: dict[str, Any] = {
    "command": [_STR], "args": [_STR], "env": _LIST, "envFrom": [_MAP], "ports": [_MAP],
    "volumeMounts": [_MAP], "workingDir": _STR, "resources": _MAP, "securityContext": _MAP,
    "livenessProbe": _MAP, "readinessProbe": _MAP, "startupProbe": _MAP, "lifecycle": _MAP,
    "imagePullPolicy": ("Always", "IfNotPresent", "Never"), "stdin": _BOOL, "tty": _BOOL,
    "restartPolicy": ("Always",),
}


def _check_types(obj: dict[str, Any], types: dict[str, Any], path: str, subject: str) -> None:
    for key, want in types.items():
        if key not in obj:
            continue
        v = obj[key]
        if isinstance(want, tuple):
            ok, what = v in want, f"one of {', '.join(want)}"
        elif isinstance(want, list):
            ok = isinstance(v, list) and all(isinstance(x, want[0]) for x in v)
            what = f"a list of {'strings' if want[0] is str else 'mappings'}"
        else:
            ok = isinstance(v, want) and (want is bool or not isinstance(v, bool))
            what = _TYPE_NAMES[want]
            if ok and want is int and v < 0:
                ok, what = False, "a number, not negative"
        if not ok:
            raise ManifestError(subject, f"{path}.{key} must be {what}, got {v!r:.60}",
                                "InvalidField")
    sc = obj.get("securityContext") or {}
    if "privileged" in sc and not isinstance(sc["privileged"], bool):
        raise ManifestError(subject, f"{path}.securityContext.privileged must be true or "
                            f"false, got {sc['privileged']!r:.60}", "InvalidField")


_TYPE_NAMES = {list: "a list", dict: "a mapping", str: "a string", bool: "true or false",
               int: "a whole number"}


def _drop_nulls(value: Any, subject: str, budget: list[int], depth: int = 0) -> Any:
    """A deep copy without null mapping values (`labels:` with nothing after it is
    the same as no labels), refusing trees deeper than MAX_DEPTH or with more than
    MAX_NODES values (`budget` counts down), and anything that is not JSON data."""
    budget[0] -= 1
    if budget[0] < 0:
        raise ManifestError(subject, f"more than {MAX_NODES} values (YAML aliases "
                            "expanded)", "TooLarge")
    if depth > MAX_DEPTH:
        raise ManifestError(subject, f"nested more than {MAX_DEPTH} levels deep "
                            "(or a YAML alias that refers to itself)", "TooLarge")
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ManifestError(subject, f"key {k!r} is not a string", "InvalidField")
            if v is not None:
                out[k] = _drop_nulls(v, subject, budget, depth + 1)
        return out
    if isinstance(value, list):
        return [_drop_nulls(v, subject, budget, depth + 1) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        raise ManifestError(subject, f"{value!r} is not a JSON number", "InvalidField")
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise ManifestError(subject, f"a {type(value).__name__} value ({value!r:.40}) is not "
                        "JSON data", "InvalidField")


ALLOW_PRIVILEGED_HINT = ("set allowPrivileged: true in the agent's --config (or "
                         "--allow-privileged) to allow privileged and host-namespace "
                         "static pods")


def host_access(pod: dict[str, Any]) -> str | None:
    """The first field that gives a pod the host: a host namespace or a privileged
    container (with allowPrivilegeEscalation and added capabilities these are what
    PodSecurity's baseline level forbids; the agent refuses the two that hand over the
    node outright). None if there is none. Any value but false or absent counts: the
    runtime reads these as truthy ("false" as a string would be true there)."""
    spec = pod.get("spec") or {}
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field) not in (None, False):
            return f"spec.{field}"
    for group in ("initContainers", "containers", "ephemeralContainers"):
        for i, c in enumerate(spec.get(group) or []):
            sc = c.get("securityContext") if isinstance(c, dict) else None
            if isinstance(sc, dict) and sc.get("privileged") not in (None, False):
                return f"spec.{group}[{i}].securityContext.privileged"
    return None


def check_host_access(pod: dict[str, Any], subject: str) -> None:
    """Refuse a static pod that would get the host (see host_access)."""
    field = host_access(pod)
    if field is not None:
        raise ManifestError(subject, f"{field} is set: privileged and host-namespace "
                            f"static pods are refused ({ALLOW_PRIVILEGED_HINT})", "Forbidden")


def canonical(doc: Any) -> bytes:
    """The bytes the hash is taken over: sorted keys, no whitespace."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def static_uid(doc: dict[str, Any], source: Source, node_name: str) -> str:
    """Deterministic UID (32 hex digits) of a normalized pod from `source` on `node_name`."""
    h = hashlib.sha256()
    h.update(f"{source.value}\0{node_name}\0".encode())
    h.update(canonical(doc))
    return h.hexdigest()[:32]


def make_static_pod(doc: dict[str, Any], source: Source, node_name: str,
                    seen: dt.datetime) -> Pod:
    """The pod the sync loop runs for a checked manifest (see the module docstring)."""
    uid = static_uid(doc, source, node_name)
    pod = copy.deepcopy(doc)
    meta = pod["metadata"]
    meta["name"] = f"{meta['name']}-{node_name}"
    if len(meta["name"]) > 253:
        raise ManifestError(meta["name"], "pod name with the node suffix is over 253 "
                            "characters", "InvalidField")
    meta["uid"] = uid
    ann = dict(meta.get("annotations") or {})
    ann[ANN_CONFIG_HASH] = uid
    ann[ANN_CONFIG_SOURCE] = source.value
    ann[ANN_CONFIG_SEEN] = api_microtime(seen)
    meta["annotations"] = ann
    pod["spec"]["nodeName"] = node_name
    return pod


def mirror_pod(static: Pod, node_uid: str) -> Pod:
    """The API object for a static pod, shaped as NodeRestriction admits it from the
    node itself: the mirror annotation, bound to the node, and one controller owner
    reference to the Node (with its UID) that does not block owner deletion."""
    meta = static["metadata"]
    ann = dict(meta.get("annotations") or {})
    ann[ANN_CONFIG_MIRROR] = ann[ANN_CONFIG_HASH]
    node = static["spec"]["nodeName"]
    mirror_meta: dict[str, Any] = {
        "name": meta["name"], "namespace": meta["namespace"], "annotations": ann,
        "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": node,
                             "uid": node_uid, "controller": True}],
    }
    if meta.get("labels"):
        mirror_meta["labels"] = dict(meta["labels"])
    return {"apiVersion": "v1", "kind": "Pod", "metadata": mirror_meta,
            "spec": copy.deepcopy(static["spec"])}


def mirror_problem(pod: Pod) -> str | None:
    """Why NodeRestriction would refuse this pod as a mirror pod created by its node,
    or None. A node may not create pods that reference other API objects."""
    spec = pod.get("spec", {})
    if spec.get("serviceAccountName") or spec.get("serviceAccount"):
        return "references a service account (spec.serviceAccountName)"
    if spec.get("imagePullSecrets"):
        return "references secrets (spec.imagePullSecrets)"
    for i, vol in enumerate(spec.get("volumes") or []):
        where = f"spec.volumes[{i}]"
        if "secret" in vol:
            return f"references a secret ({where}.secret)"
        if "configMap" in vol:
            return f"references a configmap ({where}.configMap)"
        if "persistentVolumeClaim" in vol:
            return f"references a persistentvolumeclaim ({where}.persistentVolumeClaim)"
        for j, src in enumerate((vol.get("projected") or {}).get("sources") or []):
            for key, what in (("secret", "a secret"), ("configMap", "a configmap"),
                              ("clusterTrustBundle", "a clustertrustbundle"),
                              ("serviceAccountToken", "a service account")):
                if key in src:
                    return f"references {what} ({where}.projected.sources[{j}].{key})"
        for plugin, body in vol.items():
            if isinstance(body, dict) and ({"secretRef", "nodePublishSecretRef"} & body.keys()
                                           or (plugin != "secret" and "secretName" in body)):
                return f"references a secret ({where}.{plugin})"
    for group in ("initContainers", "containers", "ephemeralContainers"):
        for i, c in enumerate(spec.get(group) or []):
            where = f"spec.{group}[{i}]"
            for j, env in enumerate(c.get("env") or []):
                ref = env.get("valueFrom") or {}
                if "secretKeyRef" in ref:
                    return f"references a secret ({where}.env[{j}].valueFrom.secretKeyRef)"
                if "configMapKeyRef" in ref:
                    return (f"references a configmap "
                            f"({where}.env[{j}].valueFrom.configMapKeyRef)")
            for j, src in enumerate(c.get("envFrom") or []):
                if "secretRef" in src:
                    return f"references a secret ({where}.envFrom[{j}].secretRef)"
                if "configMapRef" in src:
                    return f"references a configmap ({where}.envFrom[{j}].configMapRef)"
    return None
