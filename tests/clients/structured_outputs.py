"""Structured outputs through the official `openai` Python package against a running `kvq serve`:
`chat.completions.parse` with a pydantic model under each cache method given (streamed too
under the first two), `json_object` replies that `json.loads` reads for 20 seeded sampled runs, a reply cut by
max_tokens reported as `length`, and a schema the grammar cannot enforce refused with a 400.

Usage: python3 structured_outputs.py BASE_URL METHOD [METHOD ...]
Prints one line per check and a closing 'N passed, M failed'; exits non-zero on any failure.
"""

import json
import sys

import openai
from openai import OpenAI
from pydantic import BaseModel, Field
from checks import check, finish

BASE = sys.argv[1].rstrip("/")
METHODS = sys.argv[2:] or ["fp16"]
client = OpenAI(base_url=BASE + "/v1", api_key="not-needed", max_retries=0, timeout=300)
MODEL = client.models.list().data[0].id


class Cat(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=40)
    indoor: bool


CAT_PROMPT = [
    {"role": "system", "content": "You answer in JSON."},
    {"role": "user", "content": "Describe a cat named Tom: its name, its age and whether it lives indoors."},
]



def parse_whole(method):
    r = client.chat.completions.parse(
        model=MODEL, messages=CAT_PROMPT, response_format=Cat, temperature=0, max_tokens=64,
        extra_headers={"x-kv-cache-method": method},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    cat = choice.message.parsed
    assert isinstance(cat, Cat), choice.message
    assert 0 <= cat.age <= 40 and len(cat.name) <= 24, cat
    print(f"     {method}: {choice.message.content}")


def parse_streamed(method):
    with client.chat.completions.stream(
        model=MODEL, messages=CAT_PROMPT, response_format=Cat, temperature=0, max_tokens=64,
        extra_headers={"x-kv-cache-method": method},
    ) as stream:
        deltas = sum(1 for e in stream if e.type == "content.delta")
        final = stream.get_final_completion()
    assert deltas > 1, deltas
    choice = final.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, Cat), choice.message
    # Greedy: the streamed reply is the whole one.
    whole = client.chat.completions.parse(
        model=MODEL, messages=CAT_PROMPT, response_format=Cat, temperature=0, max_tokens=64,
        extra_headers={"x-kv-cache-method": method},
    )
    assert whole.choices[0].message.content == choice.message.content


def json_object_sampled():
    msgs = [{"role": "user", "content": "Reply in JSON: an object with the name and the age of a cat."}]
    # The grammar bounds the reply's form, not its length: a sampled reply may spend its tokens
    # on one long number (JSON numbers have no digit limit) and stop at max_tokens. Every reply
    # that stops is one JSON object; nearly all stop.
    stopped = 0
    for seed in range(20):
        r = client.chat.completions.create(
            model=MODEL, messages=msgs, response_format={"type": "json_object"},
            temperature=0.7, top_p=0.9, seed=seed, max_tokens=256,
        )
        choice = r.choices[0]
        assert choice.finish_reason in ("stop", "length"), (seed, choice)
        assert choice.message.content.startswith("{"), (seed, choice)
        if choice.finish_reason == "stop":
            value = json.loads(choice.message.content)
            assert isinstance(value, dict), (seed, value)
            stopped += 1
    assert stopped >= 17, f"only {stopped} of 20 sampled replies ended"


def cut_by_max_tokens():
    r = client.chat.completions.create(
        model=MODEL, messages=CAT_PROMPT, response_format={"type": "json_object"},
        temperature=0, max_tokens=3,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "length", choice
    assert choice.message.content.startswith("{"), choice.message.content


def unsupported_schema_is_refused():
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "if": {"properties": {"a": {"type": "string"}}}}}}
    try:
        client.chat.completions.create(model=MODEL, messages=CAT_PROMPT, response_format=fmt)
    except openai.BadRequestError as e:
        assert e.status_code == 400
        assert e.body["param"] == "response_format.json_schema.schema", e.body
        assert '"if"' in e.body["message"], e.body
    else:
        raise AssertionError("an unsupported schema keyword was accepted")


for m in METHODS:
    check(f"parse_whole[{m}]", lambda m=m: parse_whole(m))
for m in METHODS[:2]:
    check(f"parse_streamed[{m}]", lambda m=m: parse_streamed(m))
check("json_object_sampled", json_object_sampled)
check("cut_by_max_tokens", cut_by_max_tokens)
check("unsupported_schema_is_refused", unsupported_schema_is_refused)

finish()
