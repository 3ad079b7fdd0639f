"""
A chat service: one session per conversation, nothing kept in memory between requests.

Each conversation is a named session of one state directory (``state/.sessions/<id>/``),
each message a slot of the keyed step ``reply``. A request opens its conversation's
session (locking that conversation only), reads the earlier turns with ``s.outputs()``
(no replay), and calls ``reply``: a message retried with the same id is answered from
its stored reply, without calling the model again. Any number of worker processes can
serve one state directory: each conversation is served by one of them at a time, and a
request that finds its conversation busy gets a 409 after waiting up to two seconds.

Try it (``pip install fastapi uvicorn``):

    uvicorn examples.chat_service:app --port 8000     # or: python examples/chat_service.py 8000
    curl -X POST localhost:8000/chat/alice -H 'content-type: application/json' \\
         -d '{"id": "m1", "text": "Hello"}'
    curl localhost:8000/chat/alice                    # the transcript
    resumable sessions                                # every conversation, newest first

The "model" is a fake, deterministic function. State goes to ``$RESUMABLE_STATE_DIR``
if set, else ``./state``; set ``$CHAT_STORE`` to a URL (``s3://bucket/chat``) to keep it
in an object store, where several machines can serve it.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel

from resumable import Pipeline, SessionBusyError

pipe = Pipeline("chat", store=os.environ.get("CHAT_STORE") or None)
app = FastAPI(title="resumable chat")
calls = {"model": 0}  # how many times the model ran in this process (the test looks)


async def fake_model(history: list[dict[str, str]], text: str) -> str:
    """Stands in for an LLM call: a little latency, a deterministic answer."""
    calls["model"] += 1
    await asyncio.sleep(0.01)
    turn = len(history) // 2 + 1
    return f"turn {turn}: you said {text!r}"


@pipe.step(key="{msg_id}", ignore=("history",))
async def reply(msg_id: str, text: str, history: list[dict[str, str]]) -> dict[str, str]:  # noqa: ARG001 - the key
    """One message of a conversation and its answer (the history is context, not identity)."""
    return {"user": text, "assistant": await fake_model(history, text)}


class Message(BaseModel):
    """A user's message; its id makes a retry of the same message a skip."""

    id: str
    text: str


@app.post("/chat/{conversation}")
async def chat(conversation: str, message: Message) -> dict[str, Any]:
    """Answer a message in a conversation."""
    try:
        async with pipe.session(conversation, wait=2.0) as s:
            history = [
                {"role": role, "content": turn[role]}
                for turn in s.outputs("reply").values()
                for role in ("user", "assistant")
            ]
            answer = await reply(message.id, message.text, history)
    except SessionBusyError:
        raise HTTPException(409, f"conversation {conversation!r} is busy; retry") from None
    return {"conversation": conversation, **answer}


@app.get("/chat/{conversation}")
def transcript(conversation: str) -> list[dict[str, str]]:
    """The conversation so far, read without taking its lock."""
    return list(pipe.session(conversation).outputs("reply").values())


@app.delete("/chat/{conversation}")
def forget(conversation: str) -> dict[str, str]:
    """Delete a conversation and all its files."""
    try:
        pipe.delete_session(conversation)
    except SessionBusyError:
        raise HTTPException(409, f"conversation {conversation!r} is busy; retry") from None
    return {"deleted": conversation}


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]) if len(sys.argv) > 1 else 8000)
