"""Schemathesis over the live OpenAPI schema of a running server (the embedded nano model).

Every operation, with data made from the schema and data that breaks it: no answer is a server error,
every status and body is one the schema documents. Requests the schema calls valid are accepted
(2xx) wherever the schema can say what valid is: JSON bodies and parameters. An image, a PDF or a
codes file is binary whose validity no JSON schema states; those bodies are held to the other checks.
"""
from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, positive_data_acceptance,
                                               response_schema_conformance, status_code_conformance)

from conftest import serving

pytestmark = pytest.mark.slow  # starts servers (~10 s each): left out of the fast lane, `./test.sh -m "not slow"`

SHORT = 8  # /decode's max_tokens here: the checks are of statuses and bodies, not of long readings
BINARY = ("image/", "application/pdf", "application/octet-stream", "application/vnd.ocr-latent.codes",
          "multipart/form-data")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("schema"), "nano", MAX_BODY_BYTES=2_000_000, MAX_PAGES=2) as srv:
        yield srv


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


def number(value) -> float:
    """A generated value as the number it spells (a query parameter's may be text); else -inf."""
    try:
        return float(value) if type(value) is not bool else float("-inf")
    except (TypeError, ValueError):
        return float("-inf")


@schema.parametrize()
@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_the_api_keeps_its_schema(case, server):
    if case.operation.path == "/decode":  # short generations, still schema-valid: the time goes to the checks
        case.query = {**(case.query or {}), "max_tokens": SHORT}
        body = case.body if isinstance(case.body, dict) else {}
        if type(body.get("max_tokens")) is int and body["max_tokens"] > SHORT:
            body["max_tokens"] = SHORT
        # min_tokens <= max_tokens relates two fields, which JSON Schema cannot state: generated ones keep to it
        most = body["max_tokens"] if type(body.get("max_tokens")) in (int, float) else SHORT
        for fields in (case.query, body):
            if number(fields.get("min_tokens")) > most:
                fields["min_tokens"] = int(most)
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    binary = case.media_type is not None and case.media_type.startswith(BINARY)
    if case.operation.path != "/encode" and not binary:  # /encode's JSON carries an image too
        checks.append(positive_data_acceptance)
    response = case.call(base_url=server.url, timeout=120)
    case.validate_response(response, checks=checks)
