"""The official `openai` Python client's Responses API (`client.responses.create`) against a
running `engine serve` on goldens/models/tiny-llama-trained: a plain response, a streamed
one (iterating the client's typed events), a two-turn conversation through
previous_response_id (the second turn's prompt is the whole conversation, as the chat route
renders it, and comes from the prompt cache: cached_tokens > 0), and text.format
json_schema.

    oracles/.venv/bin/python oracles/openai_responses.py --base-url http://127.0.0.1:PORT/v1 [--plant]

With `--plant` the second turn is sent without previous_response_id (the checks must fail).
Prints one line per check and exits non-zero if any fails.
"""

import argparse
import json
import sys

import openai
from openai import OpenAI

FAILED = []
SKY = "What color is the sky?"
GRASS = "What color is the grass?"


def check(name, cond, detail=""):
    print(f"{'ok  ' if cond else 'FAIL'} {name}{': ' + str(detail) if detail else ''}")
    if not cond:
        FAILED.append(name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--plant", action="store_true", help="turn 2 without previous_response_id")
    args = ap.parse_args()
    client = OpenAI(base_url=args.base_url, api_key="not-needed", max_retries=0, timeout=60)
    model = client.models.list().data[0].id

    r = client.responses.create(model=model, input=SKY)
    check("responses.create", r.output_text == "The sky is blue.", repr(r.output_text))
    check("status completed", r.status == "completed", r.status)
    check("usage", r.usage.input_tokens == 14 and r.usage.output_tokens == 6, r.usage)
    check("id", r.id.startswith("resp_") and r.object == "response", r.id)

    events = list(client.responses.create(model=model, input=SKY, stream=True))
    kinds = [e.type for e in events]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    check("stream text", deltas == "The sky is blue.", repr(deltas))
    check("stream events", kinds[:2] == ["response.created", "response.in_progress"]
          and kinds[-1] == "response.completed", kinds)
    check("stream sequence numbers", [e.sequence_number for e in events] == list(range(len(events))))
    done = events[-1].response
    check("stream completed response", done.output_text == "The sky is blue."
          and done.usage is not None and done.usage.output_tokens == 6, done.usage)

    t1 = client.responses.create(model=model, input=SKY)
    turn2 = dict(model=model, input=GRASS)
    if not args.plant:
        turn2["previous_response_id"] = t1.id
    t2 = client.responses.create(**turn2)
    cached = t2.usage.input_tokens_details.cached_tokens
    chat = client.chat.completions.create(model=model, messages=[
        {"role": "user", "content": SKY}, {"role": "assistant", "content": t1.output_text},
        {"role": "user", "content": GRASS}])
    check("two turns: the prompt is the conversation",
          t2.usage.input_tokens == chat.usage.prompt_tokens,
          f"{t2.usage.input_tokens} input tokens, chat {chat.usage.prompt_tokens}")
    check("two turns: the chat route's answer", t2.output_text == chat.choices[0].message.content,
          repr(t2.output_text))
    check("two turns: cached_tokens > 0", cached > 0, f"cached_tokens {cached}")

    schema = {"type": "object", "properties": {"sky": {"enum": ["blue", "grey"]}},
              "required": ["sky"], "additionalProperties": False}
    r = client.responses.create(model=model, input=SKY, max_output_tokens=64, text={"format": {
        "type": "json_schema", "name": "sky", "schema": schema, "strict": True}})
    try:
        doc = json.loads(r.output_text)
        ok = isinstance(doc, dict) and set(doc) == {"sky"} and doc["sky"] in ("blue", "grey")
    except ValueError:
        ok = False
    check("text.format json_schema", ok, repr(r.output_text))

    try:
        client.responses.create(model=model, input="hi", previous_response_id="resp_missing")
        check("unknown previous_response_id raises", False, "no error")
    except openai.NotFoundError as e:
        check("unknown previous_response_id raises NotFoundError", e.status_code == 404, e.status_code)
    try:
        client.responses.create(model=model, input=SKY, max_output_tokens=0)
        check("bad request raises", False, "no error")
    except openai.BadRequestError as e:
        check("bad request raises BadRequestError",
              e.status_code == 400 and "max_output_tokens" in str(e), e.status_code)

    print(f"openai {openai.__version__}: "
          f"{'all checks passed' if not FAILED else 'FAILED: ' + ', '.join(FAILED)}")
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
