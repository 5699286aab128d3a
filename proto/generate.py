"""Regenerate the committed Python code for gemps' .proto files, or check it has not drifted.

python proto/generate.py          # rewrite proto/gemps_proto/**/*_pb2*.py(i)
python proto/generate.py --check  # exit 1 when the committed files differ from a fresh run
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def _grpc_stub_plugin() -> str:
    """mypy-protobuf's plugin writes typed stubs (.pyi) for the generated gRPC module."""
    name = "protoc-gen-mypy_grpc"
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        raise RuntimeError(f"{name} not found: pip install mypy-protobuf (the dev extra has it)")
    return found


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.glob("gemps_proto/**/*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on every .proto under proto/ into out_dir; return the generated files."""
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--plugin=protoc-gen-mypy_grpc={_grpc_stub_plugin()}",
        f"--mypy_grpc_out={out_dir}",
        *(str(p) for p in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted(p for p in out_dir.rglob("*") if p.name.endswith(GENERATED_SUFFIXES))


def drifted_files() -> list[str]:
    """Relative paths whose committed content differs from a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        fresh_rel = {p.relative_to(tmp).as_posix() for p in fresh}
        committed_rel = {
            p.relative_to(PROTO_ROOT).as_posix() for p in PROTO_ROOT.rglob("*") if p.name.endswith(GENERATED_SUFFIXES)
        }
        drift = sorted(fresh_rel ^ committed_rel)
        for rel in sorted(fresh_rel & committed_rel):
            if not filecmp.cmp(Path(tmp) / rel, PROTO_ROOT / rel, shallow=False):
                drift.append(rel)
        return drift


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only report drift; exit 1 if any")
    args = parser.parse_args()
    if args.check:
        drift = drifted_files()
        for rel in drift:
            print(f"generated file out of date: proto/{rel}", file=sys.stderr)
        if drift:
            print("run: python proto/generate.py", file=sys.stderr)
        return 1 if drift else 0
    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(Path(tmp)):
            rel = path.relative_to(tmp)
            shutil.copyfile(path, PROTO_ROOT / rel)
            print(f"wrote proto/{rel.as_posix()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
