"""A container's environment, command and args, resolved as the kubelet resolves them,
and the downward API values (pod fields, container resources) that env and downwardAPI
volumes share.

Order (the kubelet's): the service variables of the pod's namespace (unless
`enableServiceLinks: false`; those of `kubernetes` in `default` always); then `envFrom`
in order (each key with its prefix); then `env` in order, where `$(VAR)` in a value is
expanded from what came before it and the service variables. A service variable that
the container defines itself is left out. Command and args are expanded from the final
environment. `$$` is a literal `$`; a reference to an undefined variable stays as
written.

ConfigMaps, Secrets and Services come from nodeagent.pods.objects (watched, not fetched per
container). A missing object or key gives the kubelet's error (`configmap "x" not
found`, `couldn't find key k in ConfigMap ns/x`) unless the reference is optional.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from nodeagent.api.kube import CONFIG_MAPS, SECRETS
from nodeagent.api.quantity import parse_quantity
from nodeagent.pods.objects import ObjectCache, ObjectUnavailable, Ref, ServiceCache, ServiceInfo
from nodeagent.pods.podupdate import is_static

Pod = Mapping[str, Any]


class EnvError(ValueError):
    """The environment cannot be built; the message is the kubelet's."""


# -- $(VAR) expansion -------------------------------------------------------------------

def expand(text: str, lookup: Callable[[str], str | None]) -> str:
    """`$(NAME)` replaced by lookup(NAME), or left as written when that is None; `$$`
    is `$`; any other `$` stays with the character after it."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c != "$" or i + 1 == n:
            out.append(c)
            i += 1
            continue
        nxt = text[i + 1]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "(":
            end = text.find(")", i + 2)
            if end < 0:  # unclosed: the "$(" is kept and scanning goes on after it
                out.append("$(")
                i += 2
                continue
            name = text[i + 2:end]
            value = lookup(name)
            out.append(f"$({name})" if value is None else value)
            i = end + 1
        else:
            out.append("$" + nxt)
            i += 2
    return "".join(out)


def expand_command(container: Mapping[str, Any],
                   env: Iterable[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """The container's command and args with `$(VAR)` expanded from its environment."""
    values = dict(env)
    return ([expand(str(x), values.get) for x in container.get("command") or []],
            [expand(str(x), values.get) for x in container.get("args") or []])


# -- service variables ------------------------------------------------------------------

def _var(name: str) -> str:
    return name.replace("-", "_").upper()


def service_env(services: Iterable[ServiceInfo]) -> dict[str, str]:
    """<NAME>_SERVICE_HOST, _SERVICE_PORT (and _SERVICE_PORT_<PORT NAME>), and the Docker
    link variables <NAME>_PORT, <NAME>_PORT_<port>_<PROTO>{,_PROTO,_PORT,_ADDR}."""
    out: dict[str, str] = {}
    for s in services:
        prefix = _var(s.name)
        out[f"{prefix}_SERVICE_HOST"] = s.cluster_ip
        out[f"{prefix}_SERVICE_PORT"] = str(s.ports[0].port)
        for p in s.ports:
            if p.name:
                out[f"{prefix}_SERVICE_PORT_{_var(p.name)}"] = str(p.port)
        host = f"[{s.cluster_ip}]" if ":" in s.cluster_ip else s.cluster_ip
        for i, p in enumerate(s.ports):
            proto = p.protocol.lower()
            url = f"{proto}://{host}:{p.port}"
            if i == 0:
                out[f"{prefix}_PORT"] = url
            base = f"{prefix}_PORT_{p.port}_{p.protocol.upper()}"
            out[base] = url
            out[f"{base}_PROTO"] = proto
            out[f"{base}_PORT"] = str(p.port)
            out[f"{base}_ADDR"] = s.cluster_ip
    return out


# -- the downward API -------------------------------------------------------------------

def go_quote(s: str) -> str:
    """A string as Go's %q writes it (the downward API's label and annotation files)."""
    out = ['"']
    for ch in s:
        o = ord(ch)
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ch in _GO_ESCAPES:
            out.append(_GO_ESCAPES[ch])
        elif ch.isprintable():
            out.append(ch)
        elif o < 0x80:
            out.append(f"\\x{o:02x}")
        elif o < 0x10000:
            out.append(f"\\u{o:04x}")
        else:
            out.append(f"\\U{o:08x}")
    out.append('"')
    return "".join(out)


_GO_ESCAPES = {"\a": "\\a", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r",
               "\t": "\\t", "\v": "\\v"}


def format_map(m: Mapping[str, Any]) -> str:
    """Labels or annotations as a downwardAPI file holds them: key="value" lines, sorted."""
    return "\n".join(f"{k}={go_quote(str(m[k]))}" for k in sorted(m))


def field_value(pod: Pod, path: str, fields: Mapping[str, str]) -> str:
    """A `fieldRef.fieldPath` of the pod. `fields` holds what the pod object does not
    (spec.nodeName as this node knows it, status.hostIP(s), status.podIP(s))."""
    if path in fields:
        return fields[path]
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    simple = {"metadata.name": meta.get("name"),
              "metadata.namespace": meta.get("namespace") or "default",
              "metadata.uid": meta.get("uid"),
              "spec.nodeName": spec.get("nodeName"),
              "spec.serviceAccountName": spec.get("serviceAccountName")}
    if path in simple:
        return str(simple[path] or "")
    for kind in ("labels", "annotations"):
        values = meta.get(kind) or {}
        if path == f"metadata.{kind}":
            return format_map(values)
        prefix = f"metadata.{kind}['"
        if path.startswith(prefix) and path.endswith("']"):
            return str(values.get(path[len(prefix):-2], ""))  # unset: ""
    raise EnvError(f"unsupported fieldPath: {path}")


_RESOURCES = {"cpu", "memory", "ephemeral-storage"}


def resource_value(pod: Pod, container: Mapping[str, Any], ref: Mapping[str, Any],
                   allocatable: Mapping[str, Any] | None) -> str:
    """A `resourceFieldRef` (limits.* or requests.* of cpu, memory, ephemeral-storage,
    hugepages-*) of `container`, divided by its divisor and rounded up; a limit that is
    not set is the node's allocatable amount."""
    resource = str(ref.get("resource") or "")
    kind, _, name = resource.partition(".")
    if kind not in ("limits", "requests") or not (name in _RESOURCES
                                                  or name.startswith("hugepages-")):
        raise EnvError(f"unsupported container resource : {resource}")
    where = f"resourceFieldRef {resource}"
    divisor_text = ref.get("divisor")
    divisor = parse_quantity(divisor_text, f"{where}: divisor") if divisor_text not in (
        None, "", "0") else 1.0
    if divisor == 0:
        divisor = 1.0
    amounts = ((container.get("resources") or {}).get(kind) or {})
    raw = amounts.get(name)
    if raw is None and kind == "limits" and name in _RESOURCES:
        if allocatable is None:
            raise EnvError(f"{where}: the node's allocatable {name} is not known yet")
        raw = allocatable.get(name)
    value = parse_quantity(raw, where) if raw is not None else 0.0
    if name == "cpu":  # in millicores, as the kubelet divides them
        return str(math.ceil(round(value * 1000, 6) / round(divisor * 1000, 6)))
    return str(math.ceil(math.ceil(value) / math.ceil(divisor)))


def find_container(pod: Pod, name: str) -> Mapping[str, Any] | None:
    spec = pod.get("spec") or {}
    for group in ("containers", "initContainers"):
        for c in spec.get(group) or []:
            if c.get("name") == name:
                return dict(c)
    return None


# -- the resolver -----------------------------------------------------------------------

def env_refs(pod: Pod) -> set[Ref]:
    """The ConfigMaps and Secrets the pod's containers' env and envFrom read."""
    meta = pod.get("metadata") or {}
    ns = str(meta.get("namespace") or "default")
    spec = pod.get("spec") or {}
    out: set[Ref] = set()
    for group in ("initContainers", "containers", "ephemeralContainers"):
        for c in spec.get(group) or []:
            for source in c.get("envFrom") or []:
                if (source.get("configMapRef") or {}).get("name"):
                    out.add((CONFIG_MAPS, ns, str(source["configMapRef"]["name"])))
                if (source.get("secretRef") or {}).get("name"):
                    out.add((SECRETS, ns, str(source["secretRef"]["name"])))
            for e in c.get("env") or []:
                vf = e.get("valueFrom") or {}
                if (vf.get("configMapKeyRef") or {}).get("name"):
                    out.add((CONFIG_MAPS, ns, str(vf["configMapKeyRef"]["name"])))
                if (vf.get("secretKeyRef") or {}).get("name"):
                    out.add((SECRETS, ns, str(vf["secretKeyRef"]["name"])))
    return out


def object_data(ref: Ref, obj: Mapping[str, Any], binary: bool = True) -> dict[str, bytes]:
    """A ConfigMap's data (and binaryData, unless `binary` is False: env reads only
    data), or a Secret's data (base64 in the API), as bytes by key."""
    out: dict[str, bytes] = {}
    if ref[0] is SECRETS:
        for k, v in (obj.get("data") or {}).items():
            out[str(k)] = base64.b64decode(str(v))
        return out
    for k, v in (obj.get("binaryData") or {}).items() if binary else ():
        out[str(k)] = base64.b64decode(str(v))
    for k, v in (obj.get("data") or {}).items():
        out[str(k)] = str(v).encode()
    return out


class EnvResolver:
    """Builds containers' environments. `objects` and `services` None: an agent without
    API access (only literal values and pod fields, no service variables)."""

    def __init__(self, objects: ObjectCache | None = None,
                 services: ServiceCache | None = None,
                 allocatable: Callable[[str], Mapping[str, Any] | None] | None = None) -> None:
        self.objects = objects
        self.services = services
        self.allocatable = allocatable  # node name -> its status.allocatable

    async def _data(self, pod: Pod, res: Any, name: str,
                    optional: bool) -> dict[str, bytes] | None:
        ns = str((pod.get("metadata") or {}).get("namespace") or "default")
        ref: Ref = (res, ns, name)
        kind = "configMap" if res is CONFIG_MAPS else "secret"
        if self.objects is None:
            raise EnvError(f"couldn't get {kind} {ns}/{name}, no kubeClient defined")
        try:
            obj = await self.objects.get(ref)
        except ObjectUnavailable as e:
            raise EnvError(str(e)) from e
        if obj is None:
            if optional:
                return None
            raise EnvError(f'{"configmap" if res is CONFIG_MAPS else "secret"} "{name}" '
                           "not found")
        return object_data(ref, obj, binary=False)

    async def resolve(self, pod: Pod, container: Mapping[str, Any],
                      fields: Mapping[str, str]) -> list[tuple[str, str]]:
        """The container's environment, in order. Raises EnvError."""
        meta = pod.get("metadata") or {}
        spec = pod.get("spec") or {}
        ns = str(meta.get("namespace") or "default")
        service_vars: dict[str, str] = {}
        if self.services is not None:
            links = spec.get("enableServiceLinks")
            try:
                # as the kubelet: a static pod does not wait for the API's Services (the
                # control plane's own static pods start before the API server answers)
                found = await self.services.services(ns, links is None or bool(links),
                                                     wait=not is_static(pod))
            except ObjectUnavailable as e:
                raise EnvError(str(e)) from e
            service_vars = service_env(found)
        env: dict[str, str] = {}
        cache: dict[tuple[Any, str], dict[str, bytes] | None] = {}

        async def data(res: Any, name: str, optional: bool) -> dict[str, bytes] | None:
            if (res, name) not in cache:
                cache[(res, name)] = await self._data(pod, res, name, optional)
            return cache[(res, name)]

        for source in container.get("envFrom") or []:
            prefix = str(source.get("prefix") or "")
            for key, res in (("configMapRef", CONFIG_MAPS), ("secretRef", SECRETS)):
                ref = source.get(key)
                if ref is None:
                    continue
                values = await data(res, str(ref.get("name") or ""), bool(ref.get("optional")))
                for k, v in (values or {}).items():
                    env[prefix + k] = v.decode(errors="replace")

        def lookup(name: str) -> str | None:
            return env.get(name, service_vars.get(name))
        for var in container.get("env") or []:
            name = str(var.get("name") or "")
            value = var.get("value")
            value_from = var.get("valueFrom")
            if value or value_from is None:
                env[name] = expand(str(value or ""), lookup)
                continue
            resolved = await self._value_from(pod, container, name, value_from, fields, data)
            if resolved is not None:
                env[name] = resolved
        out = list(env.items())
        out += [(k, v) for k, v in sorted(service_vars.items()) if k not in env]
        return out

    async def _value_from(self, pod: Pod, container: Mapping[str, Any], name: str,
                          value_from: Mapping[str, Any], fields: Mapping[str, str],
                          data: Callable[..., Any]) -> str | None:
        """One valueFrom; None: an optional reference that is not there (no variable)."""
        ns = str((pod.get("metadata") or {}).get("namespace") or "default")
        if "fieldRef" in value_from:
            return field_value(pod, str(value_from["fieldRef"].get("fieldPath") or ""),
                               fields)
        if "resourceFieldRef" in value_from:
            ref = value_from["resourceFieldRef"]
            target = container
            if ref.get("containerName"):
                found = find_container(pod, str(ref["containerName"]))
                if found is None:
                    raise EnvError(f"container {ref['containerName']} not found")
                target = found
            node = str((pod.get("spec") or {}).get("nodeName") or "")
            alloc = self.allocatable(node) if self.allocatable else None
            return resource_value(pod, target, ref, alloc)
        for key, res, label in (("configMapKeyRef", CONFIG_MAPS, "ConfigMap"),
                                ("secretKeyRef", SECRETS, "Secret")):
            ref = value_from.get(key)
            if ref is None:
                continue
            optional = bool(ref.get("optional"))
            obj_name, k = str(ref.get("name") or ""), str(ref.get("key") or "")
            values = await data(res, obj_name, optional)
            if values is None:
                return None
            if k not in values:
                if optional:
                    return None
                raise EnvError(f"couldn't find key {k} in {label} {ns}/{obj_name}")
            return str(values[k].decode(errors="replace"))
        kinds = ", ".join(sorted(value_from)) or "nothing"
        raise EnvError(f"env {name}: valueFrom.{kinds} is not supported by this agent")
