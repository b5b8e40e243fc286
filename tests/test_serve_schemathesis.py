"""The published API (``/openapi.json``) fuzzed by schemathesis: bodies that fit the schema and bodies
that do not, a bounded number per operation, against a real server on loopback (uvicorn on a thread,
over the scripted model: fast, and its output ends). The one check: no server error, ever -- a
client's mistake is a 4xx in the route's own shape."""
import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from serve_testing import InProcessServer, scripted_engine  # noqa: E402

OPERATIONS = [("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models"), ("GET", "/v1/models/{model_id}"),
              ("POST", "/chat"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
              ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens")]
EXAMPLES = {"GET": 10, "POST": 30}   # per operation and mode: the whole file runs in well under a minute


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    engine, tok = scripted_engine(str(tmp_path_factory.mktemp("fuzz_tok")), max_batch=8, max_seq_len=1024)
    srv = InProcessServer(engine, tok, api_key="fuzz-key")
    spec = httpx.get(srv.url + "/openapi.json", headers={"x-api-key": "fuzz-key"}).json()
    yield srv, schemathesis.openapi.from_dict(spec)
    srv.stop()


def test_every_route_is_published(api):
    _, schema = api
    published = {(method.upper(), path) for path, ops in schema.raw_schema["paths"].items() for method in ops}
    assert published == set(OPERATIONS)


# negative cases need something to break: a body or a path parameter
CASES = [(m, p, mode) for m, p in OPERATIONS for mode in ("positive", "negative") if mode == "positive" or m == "POST"]


@pytest.mark.parametrize("method,path,mode", CASES, ids=[f"{m} {p} {mode}" for m, p, mode in CASES])
def test_no_server_errors(api, method, path, mode):
    srv, schema = api
    operation = schema[path][method]
    strategy = operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode))
    seen = []

    @settings(max_examples=EXAMPLES[method], deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def run(case):
        response = case.call_and_validate(base_url=srv.url, headers={"x-api-key": "fuzz-key"},
                                          checks=[not_a_server_error], timeout=30)
        seen.append(response.status_code)

    run()
    assert seen and all(code < 500 for code in seen)


@pytest.mark.parametrize("method,path", [op for op in OPERATIONS if op[0] == "POST"], ids=lambda x: x)
def test_published_examples(api, method, path):
    """The example bodies the schema publishes (the ones ``/docs`` offers) all succeed."""
    srv, schema = api
    strategies = schema.get_strategies_from_examples(schema[path][method])
    if path in ("/chat",):
        assert not strategies
        return
    assert strategies
    for strategy in strategies:
        @settings(max_examples=5, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=strategy)
        def run(case):
            response = case.call_and_validate(base_url=srv.url, headers={"x-api-key": "fuzz-key"},
                                              checks=[not_a_server_error], timeout=30)
            assert response.status_code == 200, response.text
        run()


# bodies that once got a 500 (found by fuzzing): each a 400 naming its field now
KNOWN = [("/v1/completions", {"prompt": [-1], "echo": True}, "prompt"),
         ("/v1/completions", {"prompt": [2**63], "echo": True}, "prompt"),
         ("/v1/completions", {"prompt": [[5], [2**64]], "echo": True, "max_tokens": 1}, "prompt"),
         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                   "top_logprobs": 10**6}, "top_logprobs"),
         ("/v1/completions", {"prompt": ["a"] * 64, "n": 64}, "n")]


@pytest.mark.parametrize("path,body,param", KNOWN, ids=[str(b)[:40] for _, b, _ in KNOWN])
def test_known_server_errors_are_client_errors(api, path, body, param):
    srv, schema = api
    case = schema[path]["POST"].Case(body=body, media_type="application/json")
    response = case.call_and_validate(base_url=srv.url, headers={"x-api-key": "fuzz-key"},
                                      checks=[not_a_server_error], timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == param
