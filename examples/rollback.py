"""
Prompt iteration with history: run, change the prompt, compare, roll back.

An agent answers three questions with a fake, deterministic "LLM". You try a new system
prompt, compare the answers with the previous prompt's, and roll back if you prefer the
old ones: the old answers come back exactly, without calling the model again.

Try it:

    python examples/rollback.py                      # prompt v1: the model answers
    python examples/rollback.py --prompt v2          # prompt v2: answers again, compares
    python examples/rollback.py --rollback           # back to the snapshot of the v1 answers
    python examples/rollback.py                      # v1 again: nothing is recomputed
    resumable --state-dir state-rollback history     # the checkpoints you can go back to

State goes to ./state-rollback (or $RESUMABLE_STATE_DIR).
"""

import argparse
import os
import time

from resumable import Pipeline

PROMPTS = {
    "v1": "You are a terse assistant. Answer in one short sentence.",
    "v2": "You are an enthusiastic assistant! Answer with energy and an example.",
}
QUESTIONS = ("What is a checkpoint?", "Why fsync?", "What is idempotence?")

pipe = Pipeline("rollback-demo", state_dir=os.environ.get("RESUMABLE_STATE_DIR", "state-rollback"))
model_calls = 0


def fake_llm(system: str, question: str) -> str:
    """A stand-in for a paid model call: slow, deterministic, shaped by the system prompt."""
    global model_calls  # noqa: PLW0603 - a counter for the demo's output
    model_calls += 1
    time.sleep(0.2)
    topic = question.removeprefix("What is ").removeprefix("Why ").rstrip("?")
    if "terse" in system:
        return f"{topic.capitalize()}: the short answer."
    return f"Great question! {topic.capitalize()} matters, for example when a job dies at 3 a.m.!"


@pipe.step
def system_prompt(version: str) -> str:
    return PROMPTS[version]


@pipe.step
def answers(system_prompt: str) -> dict[str, str]:
    return {q: fake_llm(system_prompt, q) for q in QUESTIONS}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompt", choices=sorted(PROMPTS), default="v1", help="which system prompt to use")
    parser.add_argument("--rollback", action="store_true", help="go back to the last snapshot of v1 answers")
    args = parser.parse_args()

    if args.rollback:
        checkpoint = pipe.rollback("answers-v1")
        print(f"rolled back to checkpoint {checkpoint.id} ({checkpoint.label})")
        print(f"answers restored: {pipe.run(version='v1').outputs['answers']}")
        return

    previous = {c.label: c for c in pipe.checkpoints() if c.label}
    # The answers now stored, to compare with: reading them costs no model call.
    baseline = answers(PROMPTS["v1"]) if answers.is_cached(PROMPTS["v1"]) and args.prompt != "v1" else None
    run = pipe.run(version=args.prompt)
    print(f"prompt {args.prompt}: ran {run.executed or 'nothing'}, skipped {run.skipped or 'nothing'}")
    print(f"model calls this run: {model_calls}")
    for question, answer in run.outputs["answers"].items():
        print(f"  {question} -> {answer}")
        if baseline is not None:
            print(f"  {'':{len(question)}}    was: {baseline[question]}")
    label = f"answers-{args.prompt}"
    if label not in previous or run.executed:
        pipe.snapshot(label)  # a named point to come back to
        print(f"snapshot {label!r} taken; `--rollback` returns to the v1 answers")


if __name__ == "__main__":
    main()
