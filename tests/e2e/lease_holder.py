"""A client process that saves one block, leases it and waits to be killed.

    python lease_holder.py URL
prints one JSON line {"session": ..., "lease": ...} once the lease is held,
then sleeps: it never closes its session (a test SIGKILLs it)."""
from __future__ import annotations

import json
import sys
import time

from kvkeeper.client import Client

NS = {"model_id": "lease-holder", "dtype": "float16", "kv_layout": "NHD", "block_tokens": 32,
      "block_bytes": 4096}


def main(url: str) -> None:
    c = Client.connect(url, NS, instance_id="lease-holder", timeout=5.0)
    key = b"\x07" * 32
    c.save([key], [bytes(range(256)) * 16])
    m = c.match([key], lease=True)
    print(json.dumps({"session": c.session_id, "lease": m.lease_id}), flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main(sys.argv[1])
