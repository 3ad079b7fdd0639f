"""
A multi-turn agent whose conversation survives being killed.

Each turn is one keyed step, ``@step(key="{turn}")``: it takes the conversation so far
and returns the turn's new messages (user, tool calls, assistant reply). The "LLM" is a
fake, deterministic function with a little latency, and it can call a weather tool.

Try it:

    python examples/agent_loop.py     # press Ctrl-C (or `kill` it) around turn 3
    python examples/agent_loop.py     # turns 1-2 are replayed from state, turn 3 reruns
    resumable status                  # one slot per turn: agent_turn/1, agent_turn/2 ...

The history is part of each turn's fingerprint, so a turn is replayed only if everything
said before it is unchanged. Editing ``fake_llm`` reruns every turn: functions of the
same module that a step calls are part of its code digest.
State goes to ``$RESUMABLE_STATE_DIR`` if set, else ``./state``.
"""

import logging
import re
import sys
import time

from resumable import step

Message = dict[str, str]

USER_MESSAGES = [
    "Hi! I'm planning a weekend away.",
    "What's the weather in Lisbon?",
    "And in Oslo?",
    "Which of the two is warmer?",
    "Thanks, bye!",
]
WEATHER = {"lisbon": ("sunny", 24), "oslo": ("light rain", 9)}


def weather(city: str) -> str:
    """The tool: a fake weather service."""
    sky, celsius = WEATHER[city.lower()]
    return f"{city}: {sky}, {celsius} C"


def fake_llm(messages: list[Message]) -> Message:
    """A deterministic stand-in for a chat model: reads the conversation, picks a reply."""
    time.sleep(0.2)  # network and inference latency
    last = messages[-1]
    if last["role"] == "tool":
        return {"role": "assistant", "content": f"Right now it is {last['content']}."}
    text = last["content"].lower()
    cities = [city for city in WEATHER if city in text]
    if cities:
        return {"role": "assistant", "tool_call": "weather", "city": cities[0].title()}
    if "warmer" in text:
        # Only the history knows which cities were discussed and what the tool said.
        reports = [m["content"] for m in messages if m["role"] == "tool"]
        warmest = max(reports, key=lambda report: int(re.findall(r"-?\d+", report)[0]))
        return {"role": "assistant", "content": f"{warmest.split(':')[0]} is warmer."}
    if "bye" in text:
        return {"role": "assistant", "content": "Have a great trip!"}
    return {"role": "assistant", "content": "Hello! Ask me about the weather anywhere."}


@step(key="{turn}")
def agent_turn(turn: int, history: list[Message], user_text: str) -> list[Message]:
    """One turn: the user speaks, the model may call tools, then it answers."""
    print(f"  (turn {turn}: calling the model)", flush=True)
    messages = [*history, {"role": "user", "content": user_text}]
    reply = fake_llm(messages)
    while "tool_call" in reply:  # the model asked for a tool: run it, let the model read the result
        messages += [reply, {"role": "tool", "content": weather(reply["city"])}]
        reply = fake_llm(messages)
    return [*messages[len(history) :], reply]


def show(message: Message) -> str:
    if "tool_call" in message:
        return f"assistant -> {message['tool_call']}({message['city']!r})"
    return f"{message['role']}: {message['content']}"


def main() -> None:
    logging.basicConfig(stream=sys.stdout, format="  [%(name)s] %(message)s")
    logging.getLogger("resumable").setLevel(logging.INFO)

    history: list[Message] = []
    for turn, text in enumerate(USER_MESSAGES, start=1):
        new = agent_turn(turn, history, text)
        # Printed from the returned messages, so replayed turns show up exactly as live ones.
        for message in new:
            print(show(message), flush=True)
        history += new
    print(f"conversation finished: {len(history)} messages")


if __name__ == "__main__":
    main()
