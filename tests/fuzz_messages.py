"""Hypothesis strategies of requests for every public method of the three services, as the bytes
a client sends, for the fuzz tests (tests/test_fuzz.py).

A request is drawn one of five ways (its `kind`):
  valid      one the method should serve, with max_tokens of a few, so that cases stay fast;
  perturbed  a valid one with one to three fields set to arbitrary values or cleared, so that
             hostile values reach the deep paths (tokenizer, chat template, engine);
  long       a valid one with one string as long as a cap or past it (what must not be echoed);
  generic    every field arbitrary, built from the message's descriptor (so a field added to a
             proto is fuzzed without a change here);
  raw        protobuf wire bytes: fields with invalid UTF-8 or the wrong wire type, unknown
             fields, truncated or flipped bytes, more bytes than the service receives.
Values favour the edges: 0, -1, the integer bounds, nan and ±inf, unknown enum values, and
lengths and counts at each cap, one below it and one past it (`Caps`: the stack's limits).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from google.protobuf import text_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

from llmserve import token_id_bytes
from llmserve.message_limits import MAX_TOKEN_ID_BYTES
from llmserve.pb import MAX_LOGPROBS, MAX_N, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from llmserve.preprocessing.validation import ALLOWED_ROLES
from llmserve.v1 import common_pb2, gateway_pb2, inference_pb2, preprocess_pb2

# The longest log line the fuzz tests accept: "a few KB" (issue 18). A request field of this
# length is one of the edges, so a service that logs it whole is caught.
MAX_LOG_LINE_BYTES = 4096
# grpc's default limits on the metadata a client accepts (soft, hard): a status that echoes a
# long client value crosses them, and the client sees "Stream removed" instead of the status.
CLIENT_METADATA_LIMITS_BYTES = (8192, 16384)
# A few ids, so that a Multiplex stream's aborts and duplicates hit its own requests.
REQUEST_IDS = ("fuzz-0", "fuzz-1", "fuzz-2", "fuzz-3")
_MAX_DEPTH = 4  # our messages nest 3 deep; the guard is for a recursive message added later
_MAX_PERTURBATIONS = 3
# Small lengths and counts come most often: they reach validation's every branch cheaply.
_MAX_SMALL_SIZE = 8
# A repeated field takes at most this many times the service's receive limit: far enough past
# it to be refused, and small enough to build in milliseconds.
_MAX_FIELD_BYTES_PER_LIMIT = 2


@dataclass(frozen=True)
class Method:
    """One public RPC, as its descriptor declares it."""

    service: str  # which server answers it: "gateway", "preprocess" or "inference"
    path: str  # "/llmserve.v1.GatewayService/Generate"
    request_type: type[Message]
    response_type: type[Message]
    is_client_streaming: bool
    is_server_streaming: bool

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]


_SERVICES = {
    "gateway": gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"],
    "preprocess": preprocess_pb2.DESCRIPTOR.services_by_name["PreprocessService"],
    "inference": inference_pb2.DESCRIPTOR.services_by_name["InferenceService"],
}


def public_methods() -> list[Method]:
    """Every method of the three services, read from the protos (a new one is fuzzed too)."""
    return [
        Method(
            service, f"/{descriptor.full_name}/{method.name}", GetMessageClass(method.input_type),
            GetMessageClass(method.output_type), method.client_streaming, method.server_streaming,
        )
        for service, descriptor in _SERVICES.items()
        for method in descriptor.methods
    ]


@dataclass(frozen=True)
class Caps:
    """The limits of the stack under test, read from its info RPCs."""

    model_name: str
    vocab_size: int
    context_tokens: int
    max_output_tokens: int
    max_prompt_bytes: int
    receive_limit_bytes: Mapping[str, int]  # by service
    # Entries of the stack's own prompt ids ring (preprocess wrote them): a valid reference, and
    # a real segment name for the perturbed ones to reach the bounds and key checks behind it.
    prompt_ids_in_region: tuple[common_pb2.PromptIdsInRegion, ...] = ()

    def edge_lengths(self, service: str) -> list[int]:
        """String and bytes lengths worth trying: each cap a value may meet, ±1."""
        caps = (MAX_STOP_STRING_CHARS, MAX_LOG_LINE_BYTES, *CLIENT_METADATA_LIMITS_BYTES, self.max_prompt_bytes,
                self.receive_limit_bytes[service])
        return _around(caps)

    def edge_counts(self, service: str) -> list[int]:
        """Repeated-field lengths worth trying: each count cap, ±1, and the context in token ids
        (and past the receive limit in them)."""
        caps = (MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, self.context_tokens,
                self.receive_limit_bytes[service] // MAX_TOKEN_ID_BYTES)
        return _around(caps)

    def edge_ints(self) -> list[int]:
        """Integer values worth trying besides the type's bounds: each numeric cap, ±1."""
        caps = (self.vocab_size, self.context_tokens, self.max_output_tokens, MAX_N, MAX_LOGPROBS)
        return _around(caps) + [0, 1, 2, 10, 600_000, 600_001]  # 10 and 600,000: the heartbeat range


def _around(caps: Sequence[int]) -> list[int]:
    return sorted({max(0, cap + delta) for cap in caps for delta in (-1, 0, 1)})


@dataclass(frozen=True)
class Case:
    """What one fuzz case sends: the requests' bytes (several for a Multiplex stream), how each
    was drawn, and after how many responses of a stream the client cancels (None: it reads to
    the end)."""

    requests: tuple[bytes, ...]
    kinds: tuple[str, ...]
    read_limit: int | None
    request_type: type[Message]

    def __repr__(self) -> str:
        shown = ", ".join(f"{kind}: {describe(data, self.request_type)}" for kind, data in zip(self.kinds, self.requests))
        return f"Case(read_limit={self.read_limit}, requests=[{shown}])"


def describe(data: bytes, request_type: type[Message]) -> str:
    """A request as text a reproduction can be written from: the message when it parses, else
    its bytes; a run of one character longer than 16 written as `c…×N`."""
    try:
        text = text_format.MessageToString(request_type.FromString(data), as_one_line=True) or "<empty>"
    except DecodeError:
        text = f"bytes {data!r}"
    text = re.sub(r"(.)\1{16,}", lambda run: f"{run.group(1)}…×{len(run.group(0))}", text, flags=re.S)
    return text if len(text) <= 2000 else f"{text[:1500]} … {text[-300:]} ({len(data)} bytes)"


def cases(method: Method, caps: Caps, read_limits: st.SearchStrategy[int | None]) -> st.SearchStrategy[Case]:
    """Cases for `method`: one request, or 1 to 4 commands for a client stream."""
    one = requests(method.request_type.DESCRIPTOR, caps, method.service)
    drawn = st.lists(one, min_size=1, max_size=4) if method.is_client_streaming else one.map(lambda r: [r])
    return st.builds(
        lambda pairs, read_limit: Case(
            tuple(data for _, data in pairs), tuple(kind for kind, _ in pairs), read_limit, method.request_type
        ),
        drawn, read_limits,
    )


def requests(descriptor: Descriptor, caps: Caps, service: str) -> st.SearchStrategy[tuple[str, bytes]]:
    """(kind, bytes) of one request of type `descriptor`, each kind about as often; valid ones
    come first, so that a failure shrinks towards one."""
    valid = valid_messages(descriptor, caps)
    serialized = lambda kind: lambda message: (kind, message.SerializeToString())  # noqa: E731
    perturbed = perturbed_messages(valid, descriptor, caps, service).map(serialized("perturbed"))
    raw = raw_bytes(valid, descriptor, caps, service).map(lambda data: ("raw", data))
    return st.one_of(
        valid.map(serialized("valid")), perturbed,
        long_string_messages(valid, descriptor, caps, service).map(serialized("long")), raw,
        messages(descriptor, caps, service).map(serialized("generic")),
    )


# --- arbitrary messages, from the descriptor -------------------------------------------------

_INT_BOUNDS = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
_EDGE_FLOATS = (0.0, -0.0, 1.0, -1.0, 0.5, 1e-45, 3.4e38, -3.4e38, float("nan"), float("inf"), float("-inf"))
# A proto string cannot hold a lone surrogate (the client refuses to encode it): invalid UTF-8
# is sent as raw bytes instead (raw_bytes).
_CHARACTERS = st.characters(exclude_categories=("Cs",))


def messages(descriptor: Descriptor, caps: Caps, service: str, depth: int = 0) -> st.SearchStrategy[Message]:
    """A message of type `descriptor` with any of its fields set to arbitrary values (at most
    one member of each oneof; proto3 `optional` fields are oneofs of one)."""

    @st.composite
    def draw_message(draw):
        message = GetMessageClass(descriptor)()
        for field in descriptor.fields:
            if field.containing_oneof is None and draw(st.booleans()):
                set_field(message, field, draw(field_values(field, caps, service, depth)))
        for oneof in descriptor.oneofs:
            field = draw(st.none() | st.sampled_from(list(oneof.fields)))
            if field is not None:
                set_field(message, field, draw(field_values(field, caps, service, depth)))
        return message

    return draw_message()


def field_values(field: FieldDescriptor, caps: Caps, service: str, depth: int) -> st.SearchStrategy:
    """Values for `field`: a list of its element values when repeated."""
    element = _element_values(field, caps, service, depth)
    if not field.is_repeated:
        return element
    budget_bytes = _MAX_FIELD_BYTES_PER_LIMIT * caps.receive_limit_bytes[service]
    return st.builds(
        lambda unit, count: _tiled(unit, min(count, _max_count(unit, budget_bytes))),
        st.lists(element, min_size=1, max_size=4), sizes(caps.edge_counts(service)),
    )


def _max_count(unit: list, budget_bytes: int) -> int:
    """How many items of `unit`, tiled, fit `budget_bytes` on the wire: a count past the caps
    times an element past them would take gigabytes (to build, not to refuse)."""
    unit_bytes = sum(_wire_size(item) for item in unit)
    return max(1, budget_bytes * len(unit) // max(1, unit_bytes))


def _wire_size(item) -> int:
    if isinstance(item, Message):
        return item.ByteSize() + 2
    if isinstance(item, (str, bytes)):
        return len(item.encode() if isinstance(item, str) else item) + 2
    return 1


def _element_values(field: FieldDescriptor, caps: Caps, service: str, depth: int) -> st.SearchStrategy:
    generic = _generic_values(field, caps, service, depth)
    hint = _HINTS.get(field.full_name)
    return generic if hint is None else st.one_of(hint(caps), generic)


def _generic_values(field: FieldDescriptor, caps: Caps, service: str, depth: int) -> st.SearchStrategy:
    kind = field.type
    if kind in _INT_BOUNDS:
        low, high = _INT_BOUNDS[kind]
        edges = [v for v in (low, high, low + 1, high - 1, -1, *caps.edge_ints()) if low <= v <= high]
        return st.one_of(st.sampled_from(edges), st.integers(low, high))
    if kind == FieldDescriptor.TYPE_FLOAT:
        return st.one_of(st.sampled_from(_EDGE_FLOATS), st.floats(width=32))
    if kind == FieldDescriptor.TYPE_DOUBLE:
        return st.one_of(st.sampled_from(_EDGE_FLOATS), st.floats())
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind == FieldDescriptor.TYPE_STRING:
        return texts(caps.edge_lengths(service))
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.builds(_tiled, st.binary(min_size=1, max_size=4), sizes(caps.edge_lengths(service)))
    if kind == FieldDescriptor.TYPE_ENUM:  # proto3 enums are open: an unknown number is sent as is
        known = [value.number for value in field.enum_type.values]
        return st.one_of(st.sampled_from(known), st.integers(-(2**31), 2**31 - 1))
    if kind == FieldDescriptor.TYPE_MESSAGE:
        if depth >= _MAX_DEPTH:
            return st.just(GetMessageClass(field.message_type)())
        return messages(field.message_type, caps, service, depth + 1)
    raise TypeError(f"no strategy for {field.full_name} of type {kind}")


def sizes(edges: Sequence[int]) -> st.SearchStrategy[int]:
    """Mostly small, sometimes medium, sometimes at an edge."""
    return st.one_of(st.integers(0, _MAX_SMALL_SIZE), st.integers(0, 300), st.sampled_from(edges))


def texts(edge_lengths: Sequence[int]) -> st.SearchStrategy[str]:
    """Any text, of any length up to past the caps (a drawn unit repeated: hypothesis draws
    short values only)."""
    return st.builds(_tiled, st.text(_CHARACTERS, min_size=1, max_size=4), sizes(edge_lengths))


def _tiled(unit, length: int):
    """`unit` (a str, bytes or list) repeated and cut to `length` items."""
    return (unit * (length // len(unit) + 1))[:length]


def set_field(message: Message, field: FieldDescriptor, value) -> None:
    if field.is_repeated:
        container = getattr(message, field.name)
        del container[:]
        container.extend(value)
    elif field.type == FieldDescriptor.TYPE_MESSAGE:
        getattr(message, field.name).CopyFrom(value)
    else:
        setattr(message, field.name, value)


# Values a field means, mixed with the arbitrary ones so that a generic or perturbed request gets
# past the first check often enough to reach the next.
def _token_ids(caps: Caps) -> st.SearchStrategy[int]:
    return st.integers(0, caps.vocab_size - 1)


_HINTS: dict[str, Callable[[Caps], st.SearchStrategy]] = {
    "llmserve.v1.ChatMessage.role": lambda caps: st.sampled_from(ALLOWED_ROLES),
    "llmserve.v1.GenerateParams.model": lambda caps: st.just(caps.model_name),
    "llmserve.v1.GenerateTokensRequest.request_id": lambda caps: st.sampled_from(REQUEST_IDS),
    "llmserve.v1.AbortRequest.request_id": lambda caps: st.sampled_from(REQUEST_IDS),
    "llmserve.v1.SamplingParams.max_tokens": lambda caps: st.integers(1, 4),
    "llmserve.v1.SamplingParams.min_tokens": lambda caps: st.integers(0, 8),  # either side of max_tokens
    "llmserve.v1.TokenIdsInput.token_ids": _token_ids,
    "llmserve.v1.GenerateTokensRequest.prompt_token_ids": _token_ids,
    "llmserve.v1.GenerateTokensRequest.prompt_token_id_bytes": lambda caps: _prompt_ids(caps).map(token_id_bytes.pack),
    "llmserve.v1.DetokenizeRequest.token_ids": _token_ids,
    "llmserve.v1.SamplingParams.stop_token_ids": _token_ids,
    "llmserve.v1.GenerateTokensRequest.prompt_token_ids_in_region": lambda caps: _region_refs(caps),
    "llmserve.v1.PromptIdsInRegion.region_name": lambda caps: _region_refs(caps).map(lambda ref: ref.region_name),
}


def _region_refs(caps: Caps) -> st.SearchStrategy[common_pb2.PromptIdsInRegion]:
    return st.sampled_from(caps.prompt_ids_in_region) if caps.prompt_ids_in_region else st.nothing()


# --- valid requests, and valid ones with a few fields changed --------------------------------

_SHORT_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1, max_size=24)


_RESPONSE_FORMATS = (
    common_pb2.ResponseFormat(json_object=common_pb2.JsonObjectFormat()),
    common_pb2.ResponseFormat(
        json_schema=common_pb2.JsonSchemaFormat(name="fuzz", schema='{"type": "object", "properties": {"a": {"type": "integer"}}}')
    ),
)


@st.composite
def _sampling(draw, caps: Caps, max_n: int = 1):
    sampling = common_pb2.SamplingParams()
    sampling.max_tokens = draw(st.integers(1, 4))
    if draw(st.booleans()):
        sampling.temperature = draw(st.sampled_from([0.0, 0.7, 1.0]))
    if draw(st.booleans()):
        sampling.seed = draw(st.integers(0, 2**32))
    if draw(st.booleans()):
        sampling.logprobs = draw(st.integers(0, 2))
    if max_n > 1 and draw(st.booleans()):
        sampling.n = draw(st.integers(1, max_n))
    sampling.stop.extend(draw(st.lists(_SHORT_TEXT, max_size=2)))
    sampling.ignore_eos = draw(st.booleans())
    if draw(st.integers(0, 5)) == 0:  # now and then the grammar path: compile, masks, its end
        sampling.response_format.CopyFrom(draw(st.sampled_from(_RESPONSE_FORMATS)))
    return sampling


@st.composite
def _chat(draw):
    chat = common_pb2.ChatInput()
    for _ in range(draw(st.integers(1, 3))):
        chat.messages.add(role=draw(st.sampled_from(ALLOWED_ROLES)), content=draw(_SHORT_TEXT))
    if draw(st.booleans()):
        chat.add_generation_prompt = draw(st.booleans())
    return chat


def _prompt_ids(caps: Caps):
    return st.lists(_token_ids(caps), min_size=1, max_size=16)


@st.composite
def _set_input(draw, message: Message, caps: Caps, text_field: str, with_token_ids: bool = True):
    """Set `message`'s `oneof input` to a valid text, chat or (when it has them) token ids."""
    choice = draw(st.sampled_from([text_field, "chat", *(["prompt_token_ids"] if with_token_ids else [])]))
    if choice == text_field:
        setattr(message, text_field, draw(_SHORT_TEXT))
    elif choice == "chat":
        message.chat.CopyFrom(draw(_chat()))
    else:
        message.prompt_token_ids.token_ids.extend(draw(_prompt_ids(caps)))
    return message


@st.composite
def _generate_params(draw, caps: Caps):
    params = gateway_pb2.GenerateParams(model=draw(st.sampled_from(["", caps.model_name])))
    draw(_set_input(params, caps, "prompt"))
    params.sampling.CopyFrom(draw(_sampling(caps)))
    params.return_token_ids = draw(st.booleans())
    params.cache_salt = draw(st.sampled_from(["", "tenant-a"]))
    return params


@st.composite
def _generate_tokens(draw, caps: Caps):
    request = inference_pb2.GenerateTokensRequest(
        request_id=draw(st.sampled_from(REQUEST_IDS)),
        sampling=draw(_sampling(caps, max_n=2)), priority=draw(st.integers(-2, 2)),
        cache_salt=draw(st.sampled_from(["", "tenant-a"])),
    )
    # As the gateway sends them (bytes, or a reference into preprocess's ring), or as a direct
    # caller may.
    form = draw(st.sampled_from(["bytes", "ids", *(["region"] if caps.prompt_ids_in_region else [])]))
    if form == "region":
        request.prompt_token_ids_in_region.CopyFrom(draw(_region_refs(caps)))
        return request
    ids = draw(_prompt_ids(caps))
    if form == "bytes":
        request.prompt_token_id_bytes = token_id_bytes.pack(ids)
    else:
        request.prompt_token_ids.extend(ids)
    return request


@st.composite
def _preprocess(draw, caps: Caps):
    request = preprocess_pb2.PreprocessRequest(
        request_id=draw(st.sampled_from(REQUEST_IDS)), token_ids_as_bytes=draw(st.booleans())
    )
    draw(_set_input(request, caps, "prompt"))
    if draw(st.booleans()):
        request.max_tokens = draw(st.integers(1, 4))
    return request


@st.composite
def _tokenize(draw, caps: Caps):
    request = draw(_set_input(preprocess_pb2.TokenizeRequest(), caps, "text", with_token_ids=False))
    if draw(st.booleans()):
        request.add_special_tokens = draw(st.booleans())
    return request


@st.composite
def _detokenize(draw, caps: Caps):
    request = preprocess_pb2.DetokenizeRequest(token_ids=draw(_prompt_ids(caps)))
    if draw(st.booleans()):
        request.skip_special_tokens = draw(st.booleans())
    return request


def _preprocess_stream(caps: Caps):
    return st.builds(preprocess_pb2.PreprocessStreamRequest, request=_preprocess(caps),
                     timeout_ms=st.one_of(st.just(0), st.integers(1, 60_000)))


def _multiplex(caps: Caps):
    abort = st.sampled_from(REQUEST_IDS).map(lambda i: inference_pb2.MultiplexRequest(abort=inference_pb2.AbortRequest(request_id=i)))
    return st.one_of(_generate_tokens(caps).map(lambda g: inference_pb2.MultiplexRequest(generate=g)), abort)


def _watch_kv_events(caps: Caps):
    return st.builds(
        inference_pb2.WatchKvEventsRequest,
        heartbeat_interval_ms=st.one_of(st.just(0), st.integers(10, 600_000)), load_only=st.booleans(),
    )


# By request type; a type not named (the parameterless requests) is valid empty.
_VALID: dict[str, Callable[[Caps], st.SearchStrategy[Message]]] = {
    "llmserve.v1.GenerateRequest": lambda caps: st.builds(gateway_pb2.GenerateRequest, params=_generate_params(caps)),
    "llmserve.v1.GenerateStreamRequest": lambda caps: st.builds(
        gateway_pb2.GenerateStreamRequest, params=_generate_params(caps)
    ),
    "llmserve.v1.PreprocessRequest": _preprocess,
    "llmserve.v1.TokenizeRequest": _tokenize,
    "llmserve.v1.DetokenizeRequest": _detokenize,
    "llmserve.v1.GenerateTokensRequest": _generate_tokens,
    "llmserve.v1.MultiplexRequest": _multiplex,
    "llmserve.v1.PreprocessStreamRequest": _preprocess_stream,
    "llmserve.v1.AbortRequest": lambda caps: st.builds(inference_pb2.AbortRequest, request_id=st.sampled_from(REQUEST_IDS)),
    "llmserve.v1.WatchKvEventsRequest": _watch_kv_events,
}


def valid_messages(descriptor: Descriptor, caps: Caps) -> st.SearchStrategy[Message]:
    make = _VALID.get(descriptor.full_name)
    return make(caps) if make is not None else st.builds(GetMessageClass(descriptor))


def field_paths(descriptor: Descriptor, depth: int = 0) -> list[tuple[FieldDescriptor, ...]]:
    """Every field reachable from `descriptor`, as the path of fields that leads to it; a
    repeated message field on the way stands for its first element (one chat turn's role)."""
    paths = []
    for field in descriptor.fields:
        paths.append((field,))
        if field.type == FieldDescriptor.TYPE_MESSAGE and depth < _MAX_DEPTH:
            paths.extend((field, *sub) for sub in field_paths(field.message_type, depth + 1))
    return paths


def _parent_of(message: Message, path: Sequence[FieldDescriptor]) -> Message:
    """The message that holds the path's last field (created on the way where unset)."""
    for field in path[:-1]:
        child = getattr(message, field.name)
        message = child if not field.is_repeated else (child[0] if len(child) else child.add())
    return message


def perturbed_messages(
    valid: st.SearchStrategy[Message], descriptor: Descriptor, caps: Caps, service: str
) -> st.SearchStrategy[Message]:
    """A valid message with 1 to 3 fields (at any depth) set to arbitrary values or cleared."""
    paths = field_paths(descriptor)
    if not paths:
        return valid

    @st.composite
    def draw_perturbed(draw):
        message = draw(valid)
        for _ in range(draw(st.integers(1, _MAX_PERTURBATIONS))):
            path = draw(st.sampled_from(paths))
            parent, leaf = _parent_of(message, path), path[-1]
            if draw(st.integers(0, 3)) == 0:
                parent.ClearField(leaf.name)
            else:
                set_field(parent, leaf, draw(field_values(leaf, caps, service, len(path) - 1)))
        return message

    return draw_perturbed()


def long_string_messages(
    valid: st.SearchStrategy[Message], descriptor: Descriptor, caps: Caps, service: str
) -> st.SearchStrategy[Message]:
    """A valid message with one string (at any depth) as long as a cap or past it: what a
    service must not echo whole into a status, its details or a log line."""
    paths = [path for path in field_paths(descriptor) if path[-1].type == FieldDescriptor.TYPE_STRING]
    if not paths:
        return valid
    long_lengths = [length for length in caps.edge_lengths(service) if length >= MAX_STOP_STRING_CHARS]

    @st.composite
    def draw_long(draw):
        message = draw(valid)
        path = draw(st.sampled_from(paths))
        parent, leaf = _parent_of(message, path), path[-1]
        text = _tiled(draw(st.text(_CHARACTERS, min_size=1, max_size=4)), draw(st.sampled_from(long_lengths)))
        set_field(parent, leaf, [text] if leaf.is_repeated else text)
        return message

    return draw_long()


# --- raw wire bytes --------------------------------------------------------------------------

_VARINT, _I64, _LEN, _START_GROUP, _END_GROUP, _I32 = 0, 1, 2, 3, 4, 5
_INVALID_UTF8 = (
    b"\xff", b"\x80", b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82", b"\xf8\x88\x80\x80\x80",
)


def varint(value: int) -> bytes:
    """`value` as a protobuf varint (a negative one as its 64-bit two's complement)."""
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def tag(field_number: int, wire_type: int) -> bytes:
    return varint(field_number << 3 | wire_type)


def length_delimited(field_number: int, payload: bytes) -> bytes:
    return tag(field_number, _LEN) + varint(len(payload)) + payload


def raw_bytes(
    valid: st.SearchStrategy[Message], descriptor: Descriptor, caps: Caps, service: str
) -> st.SearchStrategy[bytes]:
    """Wire bytes that may not parse: a valid message's bytes or hand-made fields, then maybe
    mutated (cut, a byte flipped, junk appended)."""
    base = st.one_of(valid.map(lambda m: m.SerializeToString()), wire_fields(descriptor, caps, service))
    return st.builds(lambda data, mutate: mutate(data), base, _mutations())


def wire_fields(descriptor: Descriptor, caps: Caps, service: str, depth: int = 0) -> st.SearchStrategy[bytes]:
    """0 to 6 fields of `descriptor` on the wire, each well-formed or not."""
    known = [field.number for field in descriptor.fields]
    strings = [field for field in descriptor.fields if field.type == FieldDescriptor.TYPE_STRING]
    nested = [field for field in descriptor.fields if field.type == FieldDescriptor.TYPE_MESSAGE]
    pieces = [
        messages(descriptor, caps, service, depth).map(lambda m: m.SerializeToString()),
        _unknown_field(known),
        _oversized_field(caps.receive_limit_bytes[service]),
    ]
    if known:
        pieces.append(_wrong_wire_type(known))
    if strings:
        pieces.append(_invalid_utf8_field(strings))
    if nested and depth < _MAX_DEPTH:
        pieces.append(
            st.sampled_from(nested).flatmap(
                lambda field: wire_fields(field.message_type, caps, service, depth + 1).map(
                    lambda payload: length_delimited(field.number, payload)
                )
            )
        )
    return st.lists(st.one_of(pieces), max_size=6).map(b"".join)


def _invalid_utf8_field(strings: list[FieldDescriptor]) -> st.SearchStrategy[bytes]:
    return st.builds(
        lambda field, head, bad, tail: length_delimited(field.number, head + bad + tail),
        st.sampled_from(strings), st.binary(max_size=8), st.sampled_from(_INVALID_UTF8), st.binary(max_size=8),
    )


def _payload(wire_type: int) -> st.SearchStrategy[bytes]:
    if wire_type == _VARINT:
        return st.integers(0, 2**64 - 1).map(varint)
    if wire_type == _I64:
        return st.binary(min_size=8, max_size=8)
    if wire_type == _I32:
        return st.binary(min_size=4, max_size=4)
    if wire_type == _LEN:
        return st.binary(max_size=16).map(lambda payload: varint(len(payload)) + payload)
    return st.binary(max_size=4)  # groups (deprecated) and the undefined wire types 6 and 7


def _field_with(numbers: st.SearchStrategy[int], wire_types: st.SearchStrategy[int]) -> st.SearchStrategy[bytes]:
    return st.tuples(numbers, wire_types).flatmap(
        lambda pair: _payload(pair[1]).map(lambda payload: tag(*pair) + payload)
    )


def _wrong_wire_type(known: list[int]) -> st.SearchStrategy[bytes]:
    """A known field number with any wire type, its own included or not."""
    return _field_with(st.sampled_from(known), st.integers(0, 7))


def _unknown_field(known: list[int]) -> st.SearchStrategy[bytes]:
    """A field the message does not declare (0 and the reserved 19000-19999 included)."""
    numbers = st.one_of(st.just(0), st.integers(19_000, 19_999), st.integers(1, 2**29 - 1)).filter(
        lambda number: number not in known
    )
    return _field_with(numbers, st.integers(0, 7))


def _oversized_field(receive_limit_bytes: int) -> st.SearchStrategy[bytes]:
    """An unknown field that takes the request to about the receive limit or past it."""
    sizes = st.sampled_from([receive_limit_bytes - 64, receive_limit_bytes + 1, 4 * receive_limit_bytes])
    return sizes.map(lambda size: length_delimited(19_999, bytes(size)))


def _mutations() -> st.SearchStrategy[Callable[[bytes], bytes]]:
    def cut(at: int):
        return lambda data: data[: at % (len(data) or 1)]

    def flip(at: int, mask: int):
        def flipped(data: bytes) -> bytes:
            if not data:
                return data
            i = at % len(data)
            return data[:i] + bytes([data[i] ^ mask]) + data[i + 1:]

        return flipped

    def append(junk: bytes):
        return lambda data: data + junk

    return st.one_of(
        st.just(lambda data: data),
        st.integers(0, 2**16).map(cut),
        st.builds(flip, st.integers(0, 2**16), st.integers(1, 255)),
        st.binary(min_size=1, max_size=16).map(append),
        st.just(append(b"\x80" * 11)),  # a varint longer than ten bytes
        st.just(append(tag(1, _LEN) + varint(2**31))),  # a length past the end of the message
    )
