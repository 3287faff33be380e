"""Request fields the server does not know: accepted, as vLLM accepts them, but never silently.

A body may carry fields no request model declares (a newer client's, another server's, a typo
such as ``max_token``). vLLM accepts such a request and logs a warning naming the fields; this
server does the same, with the request's id in the warning, and also tells the client: the
response (plain or streamed) carries the header ``x-pagedkv-ignored-fields: a, b``. Only top-level
fields count, and only undeclared ones: a declared field is never "unknown", and neither is a
field the request model refuses by name when set (vLLM's fields not implemented here, e.g.
``use_beam_search``), which a request may send unset.

The names are the client's own strings, so they are escaped to printable ASCII (JSON's escapes,
and a space at either end of a name as ``\\u0020``: a header value may not begin or end with
one) before they reach a header or the log, and at most :data:`MAX_LISTED` are listed.
"""

from __future__ import annotations

import json
import logging

from pydantic import BaseModel

logger = logging.getLogger("pagedkv.server")

#: The response header that lists the fields a request carried and the server ignored.
HEADER = "x-pagedkv-ignored-fields"
#: Most names one header or log line lists; the rest are counted.
MAX_LISTED = 16


def ignored_fields(body: BaseModel) -> list[str]:
    """The top-level fields of ``body`` that no field of its model declares, sorted."""
    refused = getattr(type(body), "_refused", ())
    if not isinstance(refused, tuple):  # a model without the refusal list
        refused = ()
    return sorted(name for name in body.model_extra or {} if name not in refused)


def _escaped(name: str) -> str:
    """``name`` as printable ASCII (JSON's escapes, and DEL's, which JSON leaves as it is); a space
    at either end escaped too, since a header value may neither begin nor end with one (h11
    refuses such a response outright)."""
    text = json.dumps(name, ensure_ascii=True)[1:-1].replace("\x7f", "\\u007f")
    core = text.strip(" ")
    if not core:
        return "\\u0020" * len(text)
    head, tail = len(text) - len(text.lstrip(" ")), len(text) - len(text.rstrip(" "))
    return "\\u0020" * head + core + "\\u0020" * tail


def _listed(names: list[str]) -> str:
    shown = [_escaped(name) for name in names[:MAX_LISTED]]
    more = f", ... ({len(names) - MAX_LISTED} more)" if len(names) > MAX_LISTED else ""
    return ", ".join(shown) + more


def ignored_headers(body: BaseModel, request_id: str) -> dict[str, str]:
    """The headers that say which fields ``body`` carried in vain (none: ``{}``); the warning that
    names them is logged here, once per request."""
    names = ignored_fields(body)
    if not names:
        return {}
    listed = _listed(names)
    logger.warning(
        "request %s: these fields are not known to this server and were ignored: %s", request_id, listed
    )
    return {HEADER: listed}
