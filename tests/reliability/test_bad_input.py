"""Bad input: generated malformed and hostile requests get 4xx errors, never a 500 or a crash.

Hypothesis generates each batch (wrong types, out-of-range numbers, huge max_tokens, bad
chat messages, invalid UTF-8, oversized bodies, thousands of stop strings, broken JSON,
unknown fields). Every answer must be a 4xx in OpenAI's error shape
(`{"error": {"message", "type", "param", "code"}}`) and come back within the client
timeout; after each batch the replica is healthy and serves a normal request, and at the
end it is still the same replica (nothing crashed and was replaced).

Generation is derandomized (the same requests every run) and never shrinks, so the time
is bounded by the example counts below.
"""
from __future__ import annotations

import json
import math

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from .helpers import MAX_MODEL_LEN, MODEL, record

pytestmark = pytest.mark.slow

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
COMPLETION = {"model": MODEL, "prompt": "hello there", "max_tokens": 2}
CHAT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
JSON = {"content-type": "application/json"}
SENT = {"requests": 0, "by_status": {}}


def fuzz(max_examples: int):
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                    phases=(Phase.explicit, Phase.generate), print_blob=False,
                    suppress_health_check=list(HealthCheck))


@pytest.fixture
def app(shared_app):
    return shared_app


@pytest.fixture
def http(app):
    with httpx.Client(base_url=app.url, timeout=60) as client:
        yield client


_FIRST_REPLICA: dict = {}


@pytest.fixture(scope="module", autouse=True)
def figures():
    """The module's totals, recorded however many of its tests ran and in whatever order
    (each test checks its own answers are 4xx and that the first replica still serves)."""
    yield
    record("bad_input", requests=SENT["requests"],
           by_status={str(k): v for k, v in sorted(SENT["by_status"].items())},
           server_errors=sum(v for k, v in SENT["by_status"].items() if k >= 500))


@pytest.fixture
def replica_at_start(app):
    """The replica that served this module's first test; every later test checks it is
    still the one serving (a crash would have had Serve replace it)."""
    return _FIRST_REPLICA.setdefault("id", app.status()["replica"])


def post(http: httpx.Client, path: str, body=None, *, content: bytes | None = None,
         headers: dict | None = None) -> httpx.Response:
    if content is None:
        content = json.dumps(body, allow_nan=True).encode()
    response = http.post(path, content=content, headers=headers or JSON)
    SENT["requests"] += 1
    SENT["by_status"][response.status_code] = SENT["by_status"].get(response.status_code, 0) + 1
    return response


def assert_4xx(response: httpx.Response) -> None:
    what = f"{response.request.method} {response.request.url.path} -> {response.status_code}: " \
           f"{response.text[:300]}"
    assert 400 <= response.status_code < 500, what
    body = response.json()
    assert set(body) == {"error"}, what
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"], what
    assert isinstance(error["type"], str) and error["type"], what
    assert error["code"] == response.status_code, what
    assert "param" in error, what


def assert_still_serving(app, http, replica_at_start) -> None:
    assert http.get("/health").status_code == 200
    result = http.post(COMPLETIONS, json={**COMPLETION, "max_tokens": 3, "ignore_eos": True})
    assert result.status_code == 200, result.text
    assert result.json()["usage"]["completion_tokens"] == 3
    assert app.status()["replica"] == replica_at_start


# Values of the wrong JSON type for each field. Lax pydantic turns "5" into 5 and "yes"
# into True, so the text here has no digits and no boolean words.
_BOOL_WORDS = {"true", "false", "yes", "no", "on", "off", "t", "f", "y", "n", "1", "0"}
text_no_digits = st.text(alphabet=st.characters(exclude_categories=("Nd", "Cs")), max_size=12)
not_bool_text = text_no_digits.filter(lambda s: s.strip().lower() not in _BOOL_WORDS)
containers = st.one_of(st.lists(st.integers(-3, 3), max_size=3),
                       st.dictionaries(st.text(max_size=4), st.integers(), max_size=3))
fraction = st.floats(allow_nan=False, allow_infinity=False).filter(lambda f: not f.is_integer())
not_int = st.one_of(not_bool_text, containers, fraction)
not_number = st.one_of(not_bool_text.filter(
    lambda s: s.strip().lower().lstrip("+-") not in {"inf", "infinity", "nan"}), containers)
not_bool = st.one_of(not_bool_text, containers, st.integers().filter(lambda i: i not in (0, 1)))
not_str = st.one_of(st.integers(), fraction, st.booleans(),
                    st.dictionaries(st.text(max_size=4), st.integers(), min_size=1, max_size=3))
not_prompt = st.one_of(st.integers(), fraction, st.booleans(), st.none(),
                       st.dictionaries(st.text(max_size=4), st.integers(), max_size=3),
                       st.lists(st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
                                min_size=1, max_size=3))
not_stop = st.one_of(st.integers(), fraction, st.booleans(),
                     st.dictionaries(st.text(max_size=4), st.integers(), min_size=1, max_size=2),
                     st.lists(st.integers(), min_size=1, max_size=3))
WRONG_TYPES = {
    COMPLETIONS: {"model": not_str, "prompt": not_prompt, "max_tokens": not_int,
                  "temperature": not_number, "top_p": not_number, "n": not_int,
                  "stream": not_bool, "stop": not_stop, "logprobs": not_int, "seed": not_int,
                  "echo": not_bool, "presence_penalty": not_number, "ignore_eos": not_bool},
    CHAT: {"model": not_str, "max_tokens": not_int, "max_completion_tokens": not_int,
           "temperature": not_number, "top_p": not_number, "n": not_int, "stream": not_bool,
           "stop": not_stop, "logprobs": not_bool, "top_logprobs": not_int, "seed": not_int,
           "frequency_penalty": not_number},
}
BASE = {COMPLETIONS: COMPLETION, CHAT: CHAT_BODY}


@st.composite
def wrong_type_request(draw):
    path = draw(st.sampled_from(sorted(WRONG_TYPES)))
    field = draw(st.sampled_from(sorted(WRONG_TYPES[path])))
    return path, {**BASE[path], field: draw(WRONG_TYPES[path][field])}


def test_wrong_types(app, http, replica_at_start):
    @fuzz(150)
    @given(wrong_type_request())
    def check(request):
        path, body = request
        assert_4xx(post(http, path, body))
    check()
    assert_still_serving(app, http, replica_at_start)


# Out-of-range numbers, as JSON numbers (NaN and Infinity too: vLLM's parser takes them).
huge = st.integers(MAX_MODEL_LEN + 1, 2**200)
OUT_OF_RANGE = {
    "max_tokens": st.one_of(huge, st.integers(max_value=0)),
    "temperature": st.one_of(st.floats(max_value=-1e-9, allow_infinity=False),
                             st.just(math.nan), st.just(math.inf), st.just(-math.inf)),
    "top_p": st.one_of(st.floats(min_value=1.0001, max_value=1e300),
                       st.floats(max_value=0.0, allow_infinity=False)),
    "top_k": st.integers(max_value=-2),
    "n": st.integers(max_value=0),
    "logprobs": st.integers(min_value=21, max_value=2**63),
    "presence_penalty": st.one_of(st.floats(min_value=2.0001, max_value=1e300),
                                  st.floats(max_value=-2.0001, min_value=-1e300)),
    "repetition_penalty": st.floats(max_value=0.0, min_value=-1e300),
    "min_tokens": st.integers(min_value=3, max_value=2**40),  # more than max_tokens=2
    "seed": st.integers(min_value=2**64, max_value=2**200),
    "prompt": st.one_of(st.lists(st.integers(min_value=512, max_value=2**80), min_size=1,
                                 max_size=4),                  # token ids out of the vocab
                        st.lists(st.integers(max_value=-1), min_size=1, max_size=4)),
    "logit_bias": st.dictionaries(st.integers(512, 2**40).map(str), st.floats(-100, 100),
                                  min_size=1, max_size=3),
}


@st.composite
def out_of_range_request(draw):
    if draw(st.booleans()):
        field = draw(st.sampled_from(sorted(OUT_OF_RANGE)))
        return COMPLETIONS, {**COMPLETION, field: draw(OUT_OF_RANGE[field])}
    field = draw(st.sampled_from(["max_tokens", "max_completion_tokens", "temperature",
                                  "top_p", "n", "top_logprobs"]))
    value = {"max_tokens": OUT_OF_RANGE["max_tokens"],
             "max_completion_tokens": OUT_OF_RANGE["max_tokens"],
             "temperature": OUT_OF_RANGE["temperature"], "top_p": OUT_OF_RANGE["top_p"],
             "n": OUT_OF_RANGE["n"], "top_logprobs": st.integers(21, 2**40)}[field]
    body = {**CHAT_BODY, field: draw(value)}
    if field == "top_logprobs":
        body["logprobs"] = True
    if field == "max_completion_tokens":
        body.pop("max_tokens")
    return CHAT, body


def test_out_of_range_numbers_and_huge_max_tokens(app, http, replica_at_start):
    @fuzz(120)
    @given(out_of_range_request())
    def check(request):
        path, body = request
        assert_4xx(post(http, path, body))
    check()
    assert_still_serving(app, http, replica_at_start)


bad_content = st.one_of(st.integers(), st.booleans(), st.dictionaries(
    st.sampled_from(["x", "type", "text"]), st.integers(), min_size=1, max_size=2))
bad_message = st.one_of(
    st.just({}),
    st.fixed_dictionaries({"role": st.just("user"), "content": bad_content}),
    st.fixed_dictionaries({"role": st.one_of(st.integers(), st.none(), st.lists(st.text())),
                           "content": st.text(max_size=5)}),
    st.fixed_dictionaries({"content": st.text(max_size=5)}),        # no role
    st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(
        st.fixed_dictionaries({"type": st.sampled_from(["banana", "image_url", "input_audio"])}),
        min_size=1, max_size=2)}),
    st.text(max_size=5), st.integers(), st.none())
messages = st.one_of(
    st.just([]),                                              # empty conversation
    st.lists(bad_message, min_size=1, max_size=3),
    st.text(max_size=10), st.integers(), st.none(), st.dictionaries(st.text(max_size=3),
                                                                    st.text(max_size=3)))


def test_empty_and_malformed_chat_messages(app, http, replica_at_start):
    @fuzz(80)
    @given(messages)
    def check(msgs):
        assert_4xx(post(http, CHAT, {**CHAT_BODY, "messages": msgs}))
    check()
    assert_still_serving(app, http, replica_at_start)


def _not_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


invalid_utf8 = st.binary(min_size=1, max_size=24).map(
    lambda b: b.replace(b'"', b"").replace(b"\\", b"")).filter(_not_utf8)


def raw_body(path: str, prompt_bytes: bytes) -> bytes:
    if path == COMPLETIONS:
        return b'{"model": "' + MODEL.encode() + b'", "max_tokens": 2, "prompt": "' + \
               prompt_bytes + b'"}'
    return b'{"model": "' + MODEL.encode() + b'", "max_tokens": 2, "messages": ' \
           b'[{"role": "user", "content": "' + prompt_bytes + b'"}]}'


def test_invalid_utf8_bodies_get_4xx(app, http, replica_at_start):
    @fuzz(50)
    @given(st.sampled_from([COMPLETIONS, CHAT]), invalid_utf8)
    def check(path, junk):
        assert_4xx(post(http, path, content=raw_body(path, b"hi " + junk)))
    check()
    assert_still_serving(app, http, replica_at_start)


surrogate = st.integers(0xD800, 0xDFFF).map(lambda c: f"\\u{c:04x}".encode())


def test_lone_surrogate_escapes_get_openai_errors(app, http, replica_at_start):
    @fuzz(30)
    @given(st.sampled_from([COMPLETIONS, CHAT]), st.lists(surrogate, min_size=1, max_size=3))
    def check(path, escapes):
        assert_4xx(post(http, path, content=raw_body(path, b"x".join(escapes))))
    check()
    assert_still_serving(app, http, replica_at_start)


@st.composite
def oversized_request(draw):
    size = draw(st.integers(300_000, 6_000_000))        # bytes of prompt text
    kind = draw(st.sampled_from(["prompt", "prompt_list", "messages", "chat_content"]))
    if kind == "prompt":
        return COMPLETIONS, {**COMPLETION, "prompt": "big " * (size // 4)}
    if kind == "prompt_list":                           # more prompts than vLLM takes
        return COMPLETIONS, {**COMPLETION, "prompt": ["hi"] * draw(st.integers(1025, 200_000))}
    if kind == "messages":
        return CHAT, {**CHAT_BODY, "messages": [{"role": "user", "content": "hi there"}]
                      * (size // 40)}
    return CHAT, {**CHAT_BODY, "messages": [{"role": "user", "content": "big " * (size // 4)}]}


def test_oversized_bodies(app, http, replica_at_start):
    @fuzz(12)
    @given(oversized_request())
    def check(request):
        path, body = request
        assert_4xx(post(http, path, body))
    check()
    assert_still_serving(app, http, replica_at_start)


@st.composite
def many_stop_strings(draw):
    count = draw(st.integers(1000, 20_000))
    prefix = draw(st.text(min_size=0, max_size=4))
    stops = [f"{prefix}{i}" for i in range(count)]
    if draw(st.booleans()):
        return COMPLETIONS, {**COMPLETION, "stop": stops}
    return CHAT, {**CHAT_BODY, "stop": stops}


def test_thousands_of_stop_strings(app, http, replica_at_start):
    @fuzz(15)
    @given(many_stop_strings())
    def check(request):
        path, body = request
        assert_4xx(post(http, path, body))
    check()
    assert_still_serving(app, http, replica_at_start)


@st.composite
def broken_json(draw):
    path = draw(st.sampled_from([COMPLETIONS, CHAT]))
    good = json.dumps(BASE[path]).encode()
    kind = draw(st.sampled_from(["truncated", "garbage", "not_an_object", "empty",
                                 "content_type"]))
    if kind == "truncated":
        return path, good[:draw(st.integers(1, len(good) - 1))], JSON
    if kind == "garbage":
        text = draw(st.text(min_size=1, max_size=40).filter(lambda s: not _is_object(s)))
        return path, text.encode(), JSON
    if kind == "not_an_object":
        value = draw(st.one_of(st.lists(st.integers(), max_size=3), st.integers(),
                               st.text(max_size=5), st.none(), st.booleans()))
        return path, json.dumps(value).encode(), JSON
    if kind == "empty":
        return path, b"", JSON
    content_type = draw(st.sampled_from(["text/plain", "application/x-www-form-urlencoded",
                                         "multipart/form-data; boundary=x", "application/xml",
                                         "image/png"]))
    return path, good, {"content-type": content_type}


def _is_object(s: str) -> bool:
    try:
        return isinstance(json.loads(s), dict)
    except ValueError:
        return False


def test_broken_json_and_wrong_content_types(app, http, replica_at_start):
    @fuzz(80)
    @given(broken_json())
    def check(request):
        path, content, headers = request
        assert_4xx(post(http, path, content=content, headers=headers))
    check()
    assert_still_serving(app, http, replica_at_start)


unknown_fields = st.dictionaries(
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=3, max_size=12).map(
        lambda s: f"zz_{s}"),                            # never a real OpenAI or vLLM field
    st.one_of(st.integers(), st.text(max_size=8), st.booleans(), st.none(),
              st.lists(st.integers(), max_size=3)), min_size=1, max_size=3)


def test_unknown_fields_are_refused_with_an_openai_error(app, http, replica_at_start):
    """Was a bug (vLLM keeps unknown fields and ignores them); openai_api.py refuses them now,
    as OpenAI's API does, naming the field."""
    @fuzz(40)
    @given(st.sampled_from([COMPLETIONS, CHAT]), unknown_fields)
    def check(path, extra):
        response = post(http, path, {**BASE[path], **extra})
        assert_4xx(response)
        assert all(name in response.json()["error"]["message"] for name in extra), response.text
    check()
    assert_still_serving(app, http, replica_at_start)


@pytest.mark.parametrize("case", ["invalid_utf8", "deep_nesting", "unknown_route", "method"])
def test_framework_errors_are_openai_style(app, http, case):
    """Was a bug: Starlette's own errors came back as {"detail": ...} (vLLM's handler is for
    fastapi.HTTPException; Starlette raises its base class); openai_api.py maps them now."""
    if case == "invalid_utf8":
        response = post(http, COMPLETIONS, content=raw_body(COMPLETIONS, b"\xff\xfe"))
    elif case == "deep_nesting":
        response = post(http, COMPLETIONS, content=b'{"model": "' + MODEL.encode() +
                        b'", "prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}")
    elif case == "unknown_route":
        response = post(http, "/v1/no-such-route", COMPLETION)
    else:
        response = http.get(COMPLETIONS)
    assert_4xx(response)
