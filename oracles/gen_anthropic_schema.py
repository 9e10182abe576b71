"""JSON Schemas of the Anthropic Messages API's shapes, taken from the official `anthropic`
Python client's pydantic models, as goldens for engine/tests/it/messages.rs (which validates
our `/v1/messages` answers, every streamed event, the count_tokens answer and the error
bodies with the `jsonschema` crate, no Python).

    oracles/.venv/bin/python oracles/gen_anthropic_schema.py [--out goldens/serve]

Writes anthropic-message.schema.json (`anthropic.types.Message`),
anthropic-stream-event.schema.json (the `RawMessageStreamEvent` union, plus the `error`
event as `anthropic.types.ErrorResponse`), anthropic-count-tokens.schema.json
(`MessageTokensCount`) and anthropic-error.schema.json (`ErrorResponse`). Each carries its
provenance (`x-provenance`: the anthropic and pydantic versions, the model it was dumped
from). The models are validated as the client reads an answer (mode="validation").
Pydantic leaves extra keys open; these schemas keep that (the client ignores unknown keys).
"""

import argparse
import functools
from typing import Union

import anthropic
from anthropic.types import (ErrorResponse, Message, MessageTokensCount,
                             RawMessageStreamEvent)

import gen_responses_schema

dump = functools.partial(gen_responses_schema.dump, client=anthropic,
                         generator="oracles/gen_anthropic_schema.py")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="goldens/serve")
    args = ap.parse_args()
    dump(Message, "anthropic.types.Message", args.out, "anthropic-message.schema.json")
    dump(Union[RawMessageStreamEvent, ErrorResponse],
         "anthropic.types.RawMessageStreamEvent | anthropic.types.ErrorResponse", args.out,
         "anthropic-stream-event.schema.json")
    dump(MessageTokensCount, "anthropic.types.MessageTokensCount", args.out,
         "anthropic-count-tokens.schema.json")
    dump(ErrorResponse, "anthropic.types.ErrorResponse", args.out, "anthropic-error.schema.json")


if __name__ == "__main__":
    main()
