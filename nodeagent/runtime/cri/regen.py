"""Regenerate the committed CRI stubs in gen/ from api.proto.

Run: python -m nodeagent.runtime.cri.regen   (needs the test extra, grpcio-tools)

protoc names the generated imports after the path the .proto is given under, so
the file is staged as nodeagent/runtime/cri/gen/api.proto in a temp folder: the
gRPC stub then imports `nodeagent.runtime.cri.gen.api_pb2` and works from anywhere.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = HERE / "api.proto"
GEN = HERE / "gen"
REL = Path("nodeagent/runtime/cri/gen/api.proto")


def regenerate(out_root: Path | None = None) -> list[Path]:
    """Write api_pb2.py, api_pb2.pyi and api_pb2_grpc.py; return their paths."""
    import grpc_tools
    from grpc_tools import protoc  # imported here: only the test extra has it

    out_root = out_root or HERE.parents[2]
    include = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / REL
        staged.parent.mkdir(parents=True)
        shutil.copyfile(PROTO, staged)
        rc = protoc.main([
            "grpc_tools.protoc",
            f"-I{tmp}",
            f"-I{include}",
            f"--python_out={out_root}",
            f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}",
            str(staged),
        ])
    if rc != 0:
        raise RuntimeError(f"protoc failed on {PROTO} (exit {rc})")
    gen = out_root / REL.parent
    return [gen / n for n in ("api_pb2.py", "api_pb2.pyi", "api_pb2_grpc.py")]


def main() -> int:
    for p in regenerate():
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
