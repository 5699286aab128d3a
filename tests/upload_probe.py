"""One commit's attempt from a simulated host (tests/integration/test_data_plane_patience.py):

    python -m tests.upload_probe HOST:PORT VALUES

registers VALUES float32 values over the data plane, prints {"registered": true}, waits for a line
on its standard input, commits an update of ones in one attempt (no retry), and prints how it
ended: its error, if any, and when.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from gemps import Client, GempsError, RetryPolicy


def main() -> None:
    target, size = sys.argv[1], int(sys.argv[2])
    client = Client(target, shared_memory=False, timeout=120, attempt_timeout=60, retry=RetryPolicy(max_attempts=1))
    client.register({"w": np.zeros(size, np.float32)})
    print(json.dumps({"registered": True}), flush=True)
    sys.stdin.readline()  # the test's go: what it sets up around the commit is in place
    started = time.monotonic()
    try:
        client.commit(np.ones(size, np.float32), kind="update")
        error = ""
    except GempsError as failed:
        error = str(failed)
    print(json.dumps({"error": error, "failed_after_s": time.monotonic() - started}), flush=True)


if __name__ == "__main__":
    main()
