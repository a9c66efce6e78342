"""Compressed REST bodies, as tritonclient.http sends and asks for them: a request body in
``Content-Encoding: gzip`` or ``deflate`` (zlib) is inflated before it is read, never past the
message limit (a small body that would inflate to gigabytes is a 413, not an allocation), and
an answer is compressed when ``Accept-Encoding`` names one of the two. Binary-data offsets
(``Inference-Header-Content-Length``) count the uncompressed bytes, as Triton's do.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Mapping, Sequence

from cuvil_sidecar.errors import InvalidInput, RequestTooLarge, UnsupportedEncoding

WINDOW_BITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def decoded_body(body: bytes, headers: Mapping[str, str], limit: int) -> bytes:
    encoding = headers.get("content-encoding", "identity").strip().lower()
    if encoding == "identity":
        return body
    bits = WINDOW_BITS.get(encoding)
    if bits is None:
        raise UnsupportedEncoding(
            f"Content-Encoding {encoding[:40]!r} is not accepted: send gzip, deflate or identity"
        )
    inflater = zlib.decompressobj(bits)
    try:
        plain = inflater.decompress(body, limit + 1)
    except zlib.error as error:
        raise InvalidInput(f"the {encoding} body does not inflate: {error}") from None
    if len(plain) > limit or inflater.unconsumed_tail:
        raise RequestTooLarge(f"the {encoding} body inflates to more than {limit} bytes")
    if not inflater.eof:
        raise InvalidInput(f"the {encoding} body ends before its compressed stream does")
    return plain


def encoded_answer(
    body: Sequence[bytes | memoryview], headers: Mapping[str, str]
) -> tuple[Sequence[bytes | memoryview], str | None]:
    """The answer's body, compressed as the client accepts (gzip first), and its encoding."""
    accepted = {
        part.split(";")[0].strip().lower() for part in headers.get("accept-encoding", "").split(",")
    }
    if "gzip" in accepted:
        return [gzip.compress(b"".join(body), compresslevel=1)], "gzip"
    if "deflate" in accepted:
        return [zlib.compress(b"".join(body), 1)], "deflate"
    return body, None
