"""A worker of the SDK installed alone: numpy cannot be imported here (as in `pip install gemps`).

    python -m tests.numpy_free_worker --target 127.0.0.1:50051 [--aio | --large N] [--with-numpy]

Registers a model with a float32 memoryview, a nested list and buffers (an integer counter and a
float mean), commits by name (lists), flat (`array.array` of float32, then of float64) and with a
buffer delta, pulls, and asks for what needs numpy, and for a counter past int64; then prints
JSON: θ and the buffers as the client received them (lists), the types and shapes of what
`named()` returned, and each refusal's class and message. `--large N`: one tensor of N values,
registered, committed twice and pulled (past 1 MiB the gRPC plane streams them).
tests/integration/test_sdk_without_numpy.py compares θ with a numpy client's: the same worker run
`--with-numpy`.
"""

from __future__ import annotations

import sys

if "--with-numpy" not in sys.argv:
    sys.modules["numpy"] = None  # type: ignore[assignment]  # `import numpy` raises ImportError from here on

import argparse
import array
import asyncio
import json
from collections.abc import Callable
from typing import Any

import gemps
import gemps.aio
from gemps_proto import vectors

#: the model: w (2, 3) and b (2,), buffers count (int) and mean (float)
INITIAL_W = [[0.5, -1.0, 2.0], [0.25, 0.0, -0.75]]
INITIAL_B = [1.0, -2.0]
#: commits, in order: by name, flat float32, flat float64 (with a buffer delta)
BY_NAME: dict[str, list[Any]] = {"b": [0.5, 0.25], "w": [[1.0, 2.0, 3.0], [-1.0, -2.0, -3.0]]}
FLAT_FLOAT32 = [0.125, -0.5, 1.5, 2.0, -0.25, 0.75, 1.0, -1.0]
FLAT_FLOAT64 = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]
BUFFER_DELTA: dict[str, list[Any]] = {"count": [2], "mean": [0.5, -0.5]}


def refusal(call: Callable[[], object]) -> list[str]:
    try:
        call()
    except Exception as error:  # what was raised, by class and message
        return [type(error).__name__, str(error)]
    return ["", "nothing raised"]


def described(central: gemps.CentralVariable) -> dict[str, Any]:
    named = central.named()
    return {
        "theta": central.flat.tolist(),
        "named": {name: [type(value).__name__, list(value.shape), value.tolist()] for name, value in named.items()},
        "buffers": {name: value.tolist() for name, value in central.named_buffers().items()},
        "version": central.version,
    }


def run(target: str) -> dict[str, Any]:
    initial_w = memoryview(array.array("f", [x for row in INITIAL_W for x in row])).cast("B").cast("f", [2, 3])
    found: dict[str, Any] = {"numpy": vectors.HAVE_NUMPY}
    with gemps.Client(target) as client:
        client.register({"w": initial_w, "b": INITIAL_B}, buffers={"count": [7], "mean": [0.0, 1.0]})
        found["spec"] = [[entry.name, list(entry.shape)] for entry in client.spec]
        found["buffer_spec"] = [[entry.name, list(entry.shape), entry.integer] for entry in client.buffer_spec]
        client.commit(BY_NAME)
        client.commit(array.array("f", FLAT_FLOAT32))
        result = client.commit(array.array("d", FLAT_FLOAT64), buffer_delta=BUFFER_DELTA)
        found["committed"] = described(result.parameters)
        found["pulled"] = described(client.pull())
        found["planes"] = client.planes
        found["refused"] = {
            "nan": refusal(lambda: client.commit([float("nan")] + [0.0] * 7)),
            "misspelled": refusal(lambda: client.commit({"w": BY_NAME["w"], "bias": BY_NAME["b"]})),
            "text": refusal(lambda: client.commit({"w": BY_NAME["w"], "b": ["a", "b"]})),
            "delta_past_int64": refusal(
                lambda: client.commit(BY_NAME, buffer_delta={**BUFFER_DELTA, "count": [2**64]})
            ),
        }
        with gemps.Client(target) as other:  # refused before it sends anything
            past_int64: dict[str, list[Any]] = {"count": [2**64], "mean": [0.0, 1.0]}
            found["refused"]["count_past_int64"] = refusal(
                lambda: other.register({"w": INITIAL_W, "b": INITIAL_B}, past_int64)
            )
    found["refused"]["compression"] = refusal(lambda: gemps.Client(target, compression="int8"))
    found["refused"]["bfloat16"] = refusal(lambda: gemps.Client(target, wire_dtype="bfloat16"))
    found["refused"]["reply_compression"] = refusal(lambda: gemps.Client(target, reply_compression="int4"))
    return found


async def run_aio(target: str) -> dict[str, Any]:
    async with gemps.aio.AsyncClient(target) as client:
        await client.register({"w": INITIAL_W, "b": INITIAL_B}, buffers={"count": [7], "mean": [0.0, 1.0]})
        results = await asyncio.gather(*(client.commit(BY_NAME) for _ in range(3)))
        return {"versions": sorted(result.version for result in results), "pulled": described(await client.pull())}


def run_large(target: str, size: int) -> dict[str, Any]:
    with gemps.Client(target) as client:
        client.register({"big": array.array("f", [(i % 7) * 0.5 for i in range(size)])})
        client.commit(array.array("f", [(i % 5) * 0.25 for i in range(size)]))
        committed = client.commit({"big": array.array("f", [-0.125] * size)}).parameters.flat
        pulled = client.pull().flat
        return {"committed": committed.tolist()[::997], "pulled_equal": pulled.tolist() == committed.tolist()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--aio", action="store_true", help="the asyncio client instead")
    parser.add_argument("--large", type=int, default=0, help="one tensor of this many values instead")
    parser.add_argument("--with-numpy", action="store_true", help="numpy importable: the reference run")
    args = parser.parse_args()
    if args.large:
        found = run_large(args.target, args.large)
    else:
        found = asyncio.run(run_aio(args.target)) if args.aio else run(args.target)
    print(json.dumps(found))


if __name__ == "__main__":
    main()
