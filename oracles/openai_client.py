"""The official `openai` Python client against a running `engine serve` (or mlx_lm.server):
chat, streaming chat (with usage), completions, logprobs, stop, and error handling.

    oracles/.venv/bin/python oracles/openai_client.py --base-url http://127.0.0.1:PORT/v1 [--agent]

Prints one line per check and exits non-zero if any fails. Expects the tiny trained model
(goldens/models/tiny-llama-trained), which answers "What color is the sky?" with
"The sky is blue." (five tokens, and the EOS that ends them: completion_tokens 6, as
mlx_lm.server counts). With `--agent` it runs the agent exchange of openai_agent.py instead,
against goldens/models/tiny-qwen3-tools.
"""

import argparse
import sys

import openai
from openai import OpenAI

FAILED = []


def check(name, cond, detail=""):
    print(f"{'ok  ' if cond else 'FAIL'} {name}{': ' + str(detail) if detail else ''}")
    if not cond:
        FAILED.append(name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--agent", action="store_true", help="the tool-calling exchange (tiny-qwen3-tools)")
    ap.add_argument("--model", help="the model id to ask for (default: the first of /v1/models)")
    ap.add_argument("--plant", action="store_true", help="with --agent: send no tools (must fail)")
    args = ap.parse_args()
    client = OpenAI(base_url=args.base_url, api_key="not-needed", max_retries=0, timeout=60)
    if args.agent:
        import openai_agent

        openai_agent.run(client, check, args.model, args.plant)
        finish()
    sky = [{"role": "user", "content": "What color is the sky?"}]

    models = client.models.list()
    model = models.data[0].id
    check("models.list", len(models.data) == 1, model)

    r = client.chat.completions.create(model=model, messages=sky)
    check("chat", r.choices[0].message.content == "The sky is blue.", r.choices[0].message.content)
    check("chat finish_reason", r.choices[0].finish_reason == "stop", r.choices[0].finish_reason)
    check("chat usage", r.usage.prompt_tokens == 14 and r.usage.completion_tokens == 6, r.usage)
    check("chat model echoed", r.model == model, r.model)

    chunks = list(client.chat.completions.create(model=model, messages=sky, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    check("chat stream", text == "The sky is blue.", text)
    usage = [c.usage for c in chunks if c.usage is not None]
    check("chat stream usage", bool(usage) and usage[-1].completion_tokens == 6, usage[-1:] )

    r = client.completions.create(model=model, prompt="The little robot", max_tokens=8)
    check("completions", r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8,
          repr(r.choices[0].text))

    r = client.chat.completions.create(model=model, messages=sky, logprobs=True, top_logprobs=3)
    lp = r.choices[0].logprobs.content
    check("chat logprobs", len(lp) == 5 and len(lp[0].top_logprobs) == 3 and lp[0].logprob <= 0,
          lp[0].token if lp else None)

    r = client.chat.completions.create(model=model, messages=sky, stop=[" blue"])
    check("stop string", r.choices[0].message.content == "The sky is", r.choices[0].message.content)

    r = client.chat.completions.create(model=model, messages=sky, temperature=0.8, seed=7, max_tokens=12)
    check("sampled", r.choices[0].finish_reason in ("stop", "length"), r.choices[0].message.content)

    try:
        client.chat.completions.create(model=model, messages=sky, max_tokens=0)
        check("bad request raises", False, "no error")
    except openai.BadRequestError as e:
        check("bad request raises BadRequestError", e.status_code == 400 and "max_tokens" in str(e), e.status_code)

    finish()


def finish():
    print(f"openai {openai.__version__}: {'all checks passed' if not FAILED else 'FAILED: ' + ', '.join(FAILED)}")
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
