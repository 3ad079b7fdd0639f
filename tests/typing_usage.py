"""Type-checked by tests/test_typing.py: what users' type checkers see."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, assert_type

from resumable import Manifest, Pipeline, Run, Step, step

pipe = Pipeline("typing", store="memory://typing")


@step
def add(a: int, b: int = 1) -> int:
    return a + b


@step(key="{page}", retries=2)
def fetch(page: int) -> dict[str, int]:
    return {"page": page}


@pipe.step
async def ask(question: str) -> str:
    return question


@pipe.step(version="2")
def parse(raw: bytes) -> list[str]:
    return raw.decode().split()


class Agent:
    @step
    def think(self, topic: str) -> str:
        return topic


steps: list[Step[..., Any]] = [add, fetch, ask, parse]
assert_type(add(1, 2), int)
assert_type(add(1), int)
assert_type(fetch(3), dict[str, int])
pending: Coroutine[Any, Any, str] = ask("hi")
pending.close()
assert_type(Agent().think("x"), str)
assert_type(Agent.think.is_cached(Agent(), "x"), bool)
assert_type(parse(b"a b"), list[str])
assert_type(add.is_cached(1, 2), bool)
assert_type(add.forget(1), None)
assert_type(pipe.status(), Manifest)
assert_type(pipe.reset("add"), list[str])
assert_type(pipe.run(raw=b"x"), Run)


async def main() -> str:
    return await ask("hi")
