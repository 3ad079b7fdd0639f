"""
A payment step marked ``idempotent=False``, in a named pipeline.

Usage: ``python charge.py STATE_DIR SIDE_FILE``. With ``STALL_AT=charge`` it stops inside
the payment (kill it there); the next run refuses with ``StepInterruptedError``; with
``RESET_CHARGE=1`` it first confirms the rerun with ``pipe.reset("charge")``.
"""

from __future__ import annotations

import os
import sys

import crashkit

from resumable import Pipeline

crashkit.setup()
pipe = Pipeline("shop", state_dir=sys.argv[1])


@pipe.step
def basket() -> list[int]:
    crashkit.work("basket", 0.005)
    return [120, 35, 7]


@pipe.step(idempotent=False)
def charge(items: list[int]) -> dict[str, int]:
    crashkit.work("charge", 0.005)
    return {"charged": sum(items)}


@pipe.step
def receipt(payment: dict[str, int]) -> str:
    crashkit.work("receipt", 0.005)
    return f"paid {payment['charged']}"


if os.environ.get("RESET_CHARGE") == "1":
    print("RESET " + ",".join(pipe.reset("charge")), flush=True)
crashkit.result({"receipt": receipt(charge(basket()))})
