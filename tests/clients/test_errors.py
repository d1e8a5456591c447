from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2

from clients import Client, InvalidArgument, KvfenceError, ResourceExhausted
from clients.errors import ErrorDetails, error_for
from tests.clients.fakeserver import GOOD_KEY, Fail, FakeInference


def test_every_status_code_but_ok_has_its_own_exception_type() -> None:
    codes = [c for c in grpc.StatusCode if c != grpc.StatusCode.OK]
    types = {type(error_for(c, "m")) for c in codes}
    assert len(types) == len(codes) and KvfenceError not in types
    assert all(
        t.__name__.lower() == c.name.replace("_", "").lower()
        for t, c in ((type(error_for(c, "m")), c) for c in codes)
    )


def test_rich_details_are_parsed_from_the_trailer(fake: FakeInference, target: str) -> None:
    bad = error_details_pb2.BadRequest(
        field_violations=[
            error_details_pb2.BadRequest.FieldViolation(
                field="sampling.top_p", description="must be in (0, 1]"
            )
        ]
    )
    info = error_details_pb2.ErrorInfo(
        reason="TOP_P_RANGE", domain="kvfence", metadata={"max": "1"}
    )
    fake.failures = [Fail(grpc.StatusCode.INVALID_ARGUMENT, "bad top_p", details=(bad, info))]
    with Client(target, api_key=GOOD_KEY) as client, pytest.raises(InvalidArgument) as caught:
        client.generate_text("hi", top_p=1.5)
    details = caught.value.details
    assert details.bad_request is not None
    assert [(v.field, v.description) for v in details.bad_request.field_violations] == [
        ("sampling.top_p", "must be in (0, 1]")
    ]
    assert details.error_info is not None
    assert (
        details.error_info.reason,
        details.error_info.domain,
        dict(details.error_info.metadata),
    ) == ("TOP_P_RANGE", "kvfence", {"max": "1"})
    assert details.retry_info is None and details.quota_failure is None
    assert caught.value.retry_delay is None


def test_quota_failure_and_retry_info(fake: FakeInference, target: str) -> None:
    quota = error_details_pb2.QuotaFailure(
        violations=[
            error_details_pb2.QuotaFailure.Violation(subject="kv_pages", description="100 max")
        ]
    )
    fake.failures = [
        Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, "quota", retry_delay_s=1.25, details=(quota,))
    ]
    with (
        Client(target, api_key=GOOD_KEY, retries=0) as client,
        pytest.raises(ResourceExhausted) as caught,
    ):
        client.tokenize("a")
    details = caught.value.details
    assert details.quota_failure is not None
    assert [(v.subject, v.description) for v in details.quota_failure.violations] == [
        ("kv_pages", "100 max")
    ]
    assert details.retry_delay == caught.value.retry_delay == 1.25


def test_no_trailer_means_empty_details(fake: FakeInference, target: str) -> None:
    with Client(target, api_key="wrong") as client, pytest.raises(KvfenceError) as caught:
        client.purge()
    assert caught.value.details == ErrorDetails()
    assert str(caught.value) == "UNAUTHENTICATED: invalid API key"
