"""Regenerates the committed gRPC code from jaxinfer.proto (needs grpcio-tools==1.85.1).

    python -m serving.grpc.proto.regen          # rewrite serving/grpc/proto/jaxinfer_pb2*.py* in place
    python -m serving.grpc.proto.regen OUT_DIR  # write them under OUT_DIR/serving/grpc/proto/ instead

Run from anywhere: protoc is given the repository root as its include path, so the generated
modules import each other as `serving.grpc.proto.jaxinfer_pb2` and the descriptor is registered
under "serving/grpc/proto/jaxinfer.proto" (the name server reflection reports).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PROTO = "serving/grpc/proto/jaxinfer.proto"
GENERATED = ("jaxinfer_pb2.py", "jaxinfer_pb2.pyi", "jaxinfer_pb2_grpc.py")


def protoc_args(out_dir: Path) -> list[str]:
    return [
        "grpc_tools.protoc",
        f"-I{ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(ROOT / PROTO),
    ]


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    if protoc.main(protoc_args(out_dir)) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")
    return [out_dir.joinpath(*PROTO.split("/")[:-1], name) for name in GENERATED]


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
