"""
Three threads reach the crash point of ``crash_at("replace", 1)`` together.

Usage: ``python crash_threads.py DIR``. ``os._exit`` is first wrapped the way coverage's
``patch = ["_exit"]`` wraps it (some work, here a print and a short sleep, before the real
exit), so the test can count how often the process started to die: once is right, since a
second concurrent save of coverage data crashes the interpreter (SIGSEGV in SQLite).
"""

from __future__ import annotations

import os
import sys
import threading
import time

from resumable.testing import crash_at

THREADS = 3
directory = sys.argv[1]
real_exit = os._exit


def saving_exit(status: int) -> None:
    os.write(1, f"EXIT {status}\n".encode())
    time.sleep(0.3)
    real_exit(status)


os._exit = saving_exit  # type: ignore[assignment]
crash_at("replace", 1)
barrier = threading.Barrier(THREADS)


def rename(i: int) -> None:
    source = os.path.join(directory, f"{i}.tmp")
    with open(source, "w") as f:
        f.write("x")
    barrier.wait()
    os.replace(source, os.path.join(directory, f"{i}.done"))


threads = [threading.Thread(target=rename, args=(i,)) for i in range(THREADS)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print("NOT CRASHED", flush=True)
