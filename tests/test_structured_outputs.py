"""Structured outputs through a real stack on the default model (SmolLM2-135M-Instruct, its real
tokenizer, torch backend): response_format json_schema and json_object with the official
`openai` client (whole and streamed) and GenerateParams.sampling.response_format over gRPC;
every output parses and validates against its schema (jsonschema). Bad formats are a 400 naming
the parameter, or INVALID_ARGUMENT naming the field, never a traceback.
"""

from __future__ import annotations

import json

import grpc
import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from llmserve.response_format import MAX_SCHEMA_BYTES  # noqa: E402
from llmserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc  # noqa: E402
from tests.procs import free_port, stack_fixture  # noqa: E402
from tests.rich_status import field_violation  # noqa: E402

pytestmark = pytest.mark.slow

HTTP_PORT = free_port()
stack = stack_fixture(model="default_model_dir", gateway_args=["--http-port", str(HTTP_PORT)])
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
ASK = [
    {"role": "system", "content": "You answer with JSON only."},
    {"role": "user", "content": "Ada is 36 years old and lives in London. Give her name, age and city."},
]
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
MAX_TOKENS = 160  # far more than a PERSON document with 40-character strings takes


@pytest.fixture(scope="module")
def client(stack):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{HTTP_PORT}/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def gateway(stack):
    with grpc.insecure_channel(stack["gateway"].address) as channel:
        yield gateway_pb2_grpc.GatewayServiceStub(channel)


def chat(client, **kwargs):
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model="", messages=ASK, max_tokens=MAX_TOKENS, **kwargs)


def test_a_json_schema_answer_validates_whole_and_streamed(client):
    response = chat(client, response_format=JSON_SCHEMA_FORMAT)
    [choice] = response.choices
    assert choice.finish_reason == "stop"
    document = json.loads(choice.message.content)
    jsonschema.validate(document, PERSON)
    assert document["age"] == 36 and "Ada" in document["name"]  # the model's answer, shaped
    chunks = list(chat(client, response_format=JSON_SCHEMA_FORMAT, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content


def test_a_json_object_answer_is_a_json_object(client):
    response = chat(client, response_format={"type": "json_object"})
    assert response.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(response.choices[0].message.content), dict)


def test_seeded_sampling_under_a_schema_still_validates(client):
    for seed in range(3):
        response = chat(client, response_format=JSON_SCHEMA_FORMAT, temperature=1.0, seed=seed)
        jsonschema.validate(json.loads(response.choices[0].message.content), PERSON)


def test_the_grpc_field_gives_the_same_answer(client, gateway):
    params = gateway_pb2.GenerateParams(
        chat=common_pb2.ChatInput(messages=[common_pb2.ChatMessage(**m) for m in ASK]),
        sampling=common_pb2.SamplingParams(
            temperature=0.0, max_tokens=MAX_TOKENS,
            response_format=common_pb2.ResponseFormat(json_schema=common_pb2.JsonSchemaFormat(name="person", schema=json.dumps(PERSON))),
        ),
    )  # fmt: skip
    # No deadline: admission would refuse one its estimate of this machine's speed says it misses.
    response = gateway.Generate(gateway_pb2.GenerateRequest(params=params))
    assert response.result.finish_reason == common_pb2.FINISH_REASON_STOP
    jsonschema.validate(json.loads(response.text), PERSON)
    assert response.text == chat(client, response_format=JSON_SCHEMA_FORMAT).choices[0].message.content


@pytest.mark.parametrize(
    ("response_format", "param", "says"),
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}, "response_format.json_schema.schema", "strin"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}}}, "response_format.json_schema.schema", "not"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "[a-"}}}, "response_format.json_schema.schema", "regex"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}, "response_format.json_schema.schema", "object"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema", "required"),
        ({"type": "json_schema", "json_schema": {"name": "a b", "schema": PERSON}}, "response_format.json_schema.name", "letters"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"description": "x" * MAX_SCHEMA_BYTES}}},
         "response_format.json_schema.schema", "exceeds the limit"),
        ({"type": "xml"}, "response_format.type", "'xml'"),
    ],
)  # fmt: skip
def test_a_bad_response_format_is_a_400_naming_it(client, response_format, param, says):
    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, response_format=response_format)
    assert refused.value.body["param"] == param and says in refused.value.body["message"]


def test_min_tokens_with_a_response_format_is_refused(client):
    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, response_format={"type": "json_object"}, extra_body={"min_tokens": 2})
    assert refused.value.body["param"] == "min_tokens"


def test_a_bad_schema_over_grpc_is_invalid_argument_naming_the_field(gateway):
    for response_format in (
        common_pb2.ResponseFormat(json_schema=common_pb2.JsonSchemaFormat(schema="{not json")),
        common_pb2.ResponseFormat(),  # neither json_object nor json_schema
    ):
        params = gateway_pb2.GenerateParams(prompt="Hi", sampling=common_pb2.SamplingParams(response_format=response_format))
        with pytest.raises(grpc.RpcError) as refused:
            gateway.Generate(gateway_pb2.GenerateRequest(params=params), timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        field, _ = field_violation(refused.value)
        assert field.startswith("sampling.response_format")
