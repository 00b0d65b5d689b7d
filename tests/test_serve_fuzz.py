"""The server's published OpenAPI schema, and schemathesis fuzzing every route from it.

The schema's request fields are exactly the parser's. Then schemathesis generates requests for each
route, conforming to the schema and not (wrong types, out of range, missing and extra fields), a bounded
number per route, against the in-process server (tests/serve_inprocess.py): none may get a 5xx, and the
server is healthy and idle at the end. (Dropping the parser's type check of ``stop`` makes ``"stop": 5``
a TypeError inside the parse: this fuzzing finds it as a 500 on both generation routes.)
"""

import json
import urllib.request

import pytest
from hypothesis import HealthCheck, settings
from serve_inprocess import idle, serving

from jaxpar.inference.api import FIELDS
from jaxpar.inference.limits import Limits
from jaxpar.inference.openapi import REQUESTS, schema

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.checks import CHECKS  # noqa: E402

LIMITS = Limits(request_timeout=30.0, max_pending=64)
EXAMPLES = 150  # per route
API = schemathesis.openapi.from_dict(schema(["tiny"], 256, LIMITS))
API.config.generation.update(modes=[schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE])
NOT_A_SERVER_ERROR = [c for c in CHECKS.get_all() if c.__name__ == "not_a_server_error"]


@pytest.fixture(scope="module")
def served():
    with serving(LIMITS) as running:
        yield running


def test_the_schema_names_exactly_the_fields_the_parser_accepts(served):
    _, port = served
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/openapi.json", timeout=30) as response:
        published = json.load(response)
    assert published == json.loads(json.dumps(schema(["tiny"], 256, LIMITS)))
    for kind, fields in FIELDS.items():
        assert set(REQUESTS[kind]) == fields, kind


@API.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_request_gets_a_server_error(served, case):
    _, port = served
    response = case.call(base_url=f"http://127.0.0.1:{port}", timeout=60)
    case.validate_response(response, checks=NOT_A_SERVER_ERROR)


def test_the_server_is_healthy_and_idle_after_the_fuzzing(served):
    service, port = served
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as response:
        assert response.status == 200
    assert idle(service, wait=30)
