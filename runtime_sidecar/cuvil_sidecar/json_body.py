"""A REST request's body read as one JSON object, or ``InvalidInput`` saying why not (400)."""

from __future__ import annotations

import json
from typing import Any

from cuvil_sidecar.errors import InvalidInput


def json_object(body: bytes, what: str = "the request body") -> dict[str, Any]:
    try:
        value = json.loads(body)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise InvalidInput(f"the request's JSON does not parse: {error}") from None
    if not isinstance(value, dict):
        raise InvalidInput(f"{what} must be a JSON object")
    return value
