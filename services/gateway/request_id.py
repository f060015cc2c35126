"""The request id: minted by the gateway, sent to the client and to every hop as metadata."""

from __future__ import annotations

import uuid

REQUEST_ID_METADATA_KEY = "x-request-id"


def new_request_id() -> str:
    return uuid.uuid4().hex


def request_metadata(request_id: str) -> tuple[tuple[str, str], ...]:
    return ((REQUEST_ID_METADATA_KEY, request_id),)
