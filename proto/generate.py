"""Generate the Python modules of the API (service/api/) from proto/osscar/compression/v1/compression.proto.

    .venv/bin/python proto/generate.py            # rewrite service/api/
    .venv/bin/python proto/generate.py --check    # exit 1 when service/api/ is stale (a test runs this)

The generated modules are committed so that installing the package needs no protoc. Two fix-ups:
googleapis-common-protos ships google/longrunning/operations.proto as `operations_proto.proto` (its
descriptor keeps the original name), so a copy under the original name is put on the include path; and
the generated gRPC module imports its messages from `service.api` instead of the proto package path.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO = Path("osscar/compression/v1/compression.proto")
OUT = ROOT / "service" / "api"
NAMES = ("compression_pb2.py", "compression_pb2.pyi", "compression_pb2_grpc.py")


def generate(out: Path) -> None:
    import grpc_tools
    from google.longrunning import operations_proto_pb2
    from grpc_tools import protoc

    site = Path(operations_proto_pb2.__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        shim = tmp / "include" / "google" / "longrunning"
        shim.mkdir(parents=True)
        shutil.copy(site / "google" / "longrunning" / "operations_proto.proto", shim / "operations.proto")
        raw = tmp / "raw"
        raw.mkdir()
        args = ["protoc", f"-I{ROOT / 'proto'}", f"-I{tmp / 'include'}", f"-I{site}",
                f"-I{Path(grpc_tools.__file__).parent / '_proto'}", f"--python_out={raw}", f"--pyi_out={raw}",
                f"--grpc_python_out={raw}", str(PROTO)]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        out.mkdir(parents=True, exist_ok=True)
        for name in NAMES:
            text = (raw / PROTO.parent / name).read_text()
            text = text.replace("from osscar.compression.v1 import compression_pb2",
                                "from service.api import compression_pb2")
            (out / name).write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with service/api/ instead of writing it")
    args = parser.parse_args()
    if not args.check:
        generate(OUT)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = [n for n in NAMES if not (OUT / n).is_file() or (OUT / n).read_text() != (Path(tmp) / n).read_text()]
    if stale:
        print(f"stale: {', '.join(stale)}; run python proto/generate.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
