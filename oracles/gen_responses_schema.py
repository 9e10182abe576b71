"""JSON Schemas of the Responses API's shapes, taken from the official `openai` Python
client's pydantic models, as goldens for engine/tests/it/responses.rs (which validates our
`/v1/responses` answers and every streamed event with the `jsonschema` crate, no Python).

    oracles/.venv/bin/python oracles/gen_responses_schema.py [--out goldens/serve]

Writes responses-response.schema.json (`openai.types.responses.Response`) and
responses-stream-event.schema.json (the `ResponseStreamEvent` union). Each file carries its
provenance (`x-provenance`: the openai and pydantic versions, the model it was dumped from).
The models are validated as the client reads an answer (mode="validation").
"""

import argparse
import json
import os

import openai
import pydantic
from openai.types.responses import Response, ResponseStreamEvent


def dump(kind, name, out_dir, path, client=openai, generator="oracles/gen_responses_schema.py"):
    """`kind`'s JSON Schema (named `name`) written to out_dir/path, with its provenance: the
    generator, the `client` package's version, pydantic's. Shared by gen_anthropic_schema.py."""
    schema = pydantic.TypeAdapter(kind).json_schema(mode="validation")
    schema["x-provenance"] = {
        "generator": generator,
        client.__name__: client.__version__,
        "pydantic": pydantic.__version__,
        "model": name,
    }
    with open(os.path.join(out_dir, path), "w") as f:
        json.dump(schema, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"{path}: {name}, {len(schema.get('$defs', {}))} definitions")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="goldens/serve")
    args = ap.parse_args()
    dump(Response, "openai.types.responses.Response", args.out, "responses-response.schema.json")
    dump(ResponseStreamEvent, "openai.types.responses.ResponseStreamEvent", args.out,
         "responses-stream-event.schema.json")


if __name__ == "__main__":
    main()
