"""Entry point of the runtime's child processes: `python -m radixrt.core.child_main <payload.pkl>`.

Children are started as fresh interpreters (not multiprocessing "spawn"), so the caller's
`__main__` is never re-imported: scripts need no `if __name__ == "__main__"` guard. The payload
names the entry point as "module:function" (`ipc.spawn_child` derives it from the function).
"""

from __future__ import annotations

import importlib
import os
import pickle
import sys


def main() -> None:
    with open(sys.argv[1], "rb") as f:
        payload = pickle.load(f)
    if payload.get("cpus"):  # pin first, so thread pools size and place themselves inside
        os.sched_setaffinity(0, payload["cpus"])
    module, func = payload["target"].split(":")
    getattr(importlib.import_module(module), func)(**payload["kwargs"])


if __name__ == "__main__":
    main()
