"""``/openapi.json`` against the server it describes: schemathesis generates requests for every operation
from the document and checks each answer (no 5xx, documented status, content type, headers and body schema)."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi import checks

pytest.register_assert_rewrite("tests.server_helpers")
from tests.server_helpers import start_server, tiny_server_args, wait_until_idle  # noqa: E402

pytest_plugins = ["tests.server_helpers"]
pytestmark = pytest.mark.usefixtures("server_logs_on_failure")

API_KEY = "openapi-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def described(tmp_path_factory, tiny_model_path):
    args = tiny_server_args(tiny_model_path) + ["--api-key", API_KEY, "--max-tokens-limit", "8",
                                                  "--max-choices-per-request", "8"]
    server = start_server(tmp_path_factory.mktemp("servers"), "openapi", args)
    yield server
    server.stop()


def test_every_operation_answers_as_documented(described):
    """Hypothesis draws requests from each operation's documented parameters and bodies, valid and
    not. Data that fits the schema may still be unservable (a prompt longer than the context, top_p
    0), so the check that such data is accepted is left out: it gets a documented 400."""
    api_schema = schemathesis.openapi.from_url(f"{described.url}/openapi.json")
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 9
    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case):
            case.call_and_validate(base_url=described.url, headers=AUTH,
                                   excluded_checks=[checks.positive_data_acceptance])

        check()


def test_the_document_names_errors_sse_security_and_text_metrics(described):
    doc = httpx.get(f"{described.url}/openapi.json", timeout=10).json()
    completions = doc["paths"]["/v1/completions"]["post"]
    assert {"200", "400", "401", "404", "413", "503"} <= set(completions["responses"])
    assert "422" not in completions["responses"]
    assert set(completions["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert completions["security"] == [{"APIKey": []}]
    assert doc["components"]["securitySchemes"]["APIKey"] == {"type": "http", "scheme": "bearer"}
    assert "security" not in doc["paths"]["/health"]["get"]
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    wait_until_idle(described.url)


def test_invocations_documents_both_of_its_answers(described):
    """/invocations is a completion for a ``prompt`` body and a chat completion for ``messages``: each answer
    fits the document."""
    api_schema = schemathesis.openapi.from_url(f"{described.url}/openapi.json")
    operation = api_schema["/invocations"]["POST"]
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for body in ({"prompt": "Hello", "max_tokens": 2}, chat):
        response = operation.Case(body=body, media_type="application/json").call_and_validate(
            base_url=described.url, headers=AUTH)
        assert response.status_code == 200
    wait_until_idle(described.url)
