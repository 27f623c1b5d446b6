"""The kubelet's settings surface, read from the pinned Go modules: every field of the
kubelet.config.k8s.io/v1beta1 KubeletConfiguration (its json path and the shape of its
Go type) and every flag of the kubelet's command line.

    .venv/bin/python scripts/kubelet_surface.py          # rewrites tests/data/kubelet-surface.txt
    .venv/bin/python scripts/kubelet_surface.py --docs   # rewrites the table of
                                                         # docs/kubelet-dropin.md

tests/test_kubeletconfig.py reads the Go sources with these functions when the module
cache holds them, and the committed list otherwise, and checks that
nodeagent/kubeletconfig.py has a row for each.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIST = ROOT / "tests" / "data" / "kubelet-surface.txt"
DOC = ROOT / "docs" / "kubelet-dropin.md"
DOC_START = "<!-- kubelet table: generated from nodeagent/kubeletconfig.py -->\n"
DOC_END = "<!-- end of kubelet table -->\n"

_STRUCT = re.compile(r"^type (\w+) struct \{\n(.*?)^\}", re.M | re.S)
_FIELD = re.compile(r'^\s+\w+\s+([^\s`]+)\s+`json:"([^",]*)', re.M)
_NAMED_STRING = re.compile(r"^type (\w+) string$", re.M)
_SCALARS = {"string": "str", "*string": "*str", "bool": "bool", "*bool": "*bool",
            "int32": "int", "int64": "int", "*int32": "*int", "*int64": "*int",
            "*float64": "*float", "metav1.Duration": "duration",
            "*metav1.Duration": "*duration"}


def config_fields(types_go: str, root: str = "KubeletConfiguration") -> dict[str, str]:
    """Dotted json path -> shape of every field of `root`, structs of the same file
    followed down to their fields."""
    structs = {name: body for name, body in _STRUCT.findall(types_go)}
    strings = set(_NAMED_STRING.findall(types_go))

    def walk(name: str, prefix: str) -> dict[str, str]:
        out: dict[str, str] = {}
        for go_type, json in _FIELD.findall(structs[name]):
            if json in ("", "-"):
                continue  # inline (TypeMeta) or not serialized
            path, bare = prefix + json, go_type.lstrip("*")
            if bare in structs:
                out.update(walk(bare, path + "."))
            elif go_type in _SCALARS:
                out[path] = _SCALARS[go_type]
            elif bare in strings:
                out[path] = "str"
            elif go_type.startswith("map["):
                out[path] = "map"
            elif go_type.startswith("[]"):
                out[path] = "list"
            else:
                out[path] = "struct"  # a type of another package
        return out
    return walk(root, "")


_FLAG = re.compile(r'\bfs\.\w+\([^"\n]*?"([a-z0-9][a-z0-9-]*)"')


def kubelet_flags(options_go: str, logs_options_go: str) -> set[str]:
    """The flag names the kubelet's command line defines (cmd/kubelet/app/options and
    the logging flags of component-base)."""
    names = set(_FLAG.findall(options_go)) | set(_FLAG.findall(logs_options_go))
    if "LogFlushFreqFlagName" in logs_options_go:
        names.add("log-flush-frequency")
    return names


def sources(gomod: Path, versions: dict[str, str]) -> tuple[str, str, str]:
    """(types.go, options.go, the logging options.go) of the pinned modules."""
    kubelet = gomod / f"k8s.io/kubelet@{versions['k8s.io/kubelet']}"
    kubernetes = gomod / f"k8s.io/kubernetes@{versions['k8s.io/kubernetes']}"
    base = gomod / f"k8s.io/component-base@{versions['k8s.io/component-base']}"
    return ((kubelet / "config/v1beta1/types.go").read_text(),
            (kubernetes / "cmd/kubelet/app/options/options.go").read_text(),
            (base / "logs/api/v1/options.go").read_text())


def pinned() -> dict[str, str]:
    from nodepulse_dev.build import pinned_version
    return {m: pinned_version("kubernetes", m)
            for m in ("k8s.io/kubelet", "k8s.io/kubernetes", "k8s.io/component-base")}


def read_list(path: Path = LIST) -> tuple[dict[str, str], set[str]]:
    fields, flags = {}, set()
    for line in path.read_text().splitlines():
        if line.startswith("field "):
            _, name, kind = line.split()
            fields[name] = kind
        elif line.startswith("flag "):
            flags.add(line.split()[1])
    return fields, flags


def doc_table(text: str) -> str:
    """The generated section of docs/kubelet-dropin.md."""
    return text.split(DOC_START, 1)[1].split(DOC_END, 1)[0]


def write_doc() -> None:
    from nodeagent.config import kubelet_table
    text = DOC.read_text()
    head, rest = text.split(DOC_START, 1)
    DOC.write_text(head + DOC_START + kubelet_table() + DOC_END + rest.split(DOC_END, 1)[1])
    print(f"{DOC}: table written")


def main() -> None:
    sys.path.insert(0, str(ROOT))
    if sys.argv[1:] == ["--docs"]:
        write_doc()
        return
    from nodepulse_dev.build import cache_root
    versions = pinned()
    types_go, options_go, logs_go = sources(cache_root() / "gomod", versions)
    lines = [f"# {m}@{v}" for m, v in sorted(versions.items())]
    lines.insert(0, "# generated by scripts/kubelet_surface.py from the pinned modules:")
    lines += [f"field {p} {k}" for p, k in config_fields(types_go).items()]
    lines += [f"flag {f}" for f in sorted(kubelet_flags(options_go, logs_go))]
    LIST.parent.mkdir(parents=True, exist_ok=True)
    LIST.write_text("\n".join(lines) + "\n")
    print(f"{LIST}: {len(lines)} lines")


if __name__ == "__main__":
    main()
