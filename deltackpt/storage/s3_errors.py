"""How the S3 backend reads its client's errors: a refused precondition, a range past the end of
an object, and which failures are worth another try."""

from __future__ import annotations

import errno
import re


class Refused(FileExistsError):
    """A conditional request was refused (412, or 409 on a create); ``retried``: the request had
    been sent before, so the refusal may be of its own first try."""

    def __init__(self, retried: bool, message: str):
        super().__init__(errno.EEXIST, message)
        self.retried = retried


class RangeNotSatisfiable(Exception):
    """A ranged GET started at or past the end of the object."""


_RETRIED = re.compile(r"\bretries: [1-9]")  # the client's own retries, not max_retries
_STATUS_416 = re.compile(r"status(?: code)?: 416\b")
_STATUS_RETRY = re.compile(r"status(?: code)?: (?:5\d\d|429)\b")
_BROKEN = ("SlowDown", "connection", "Connection", "timed out", "timeout", "reset", "closed",
           "broken pipe", "incomplete", "error sending request", "error decoding response body")
_XML_DOC = re.compile(r"<\?xml|<Error>")
_XML_CODE = re.compile(r"<Code>([^<]*)</Code>")
_XML_MESSAGE = re.compile(r"<Message>([^<]*)</Message>")


def retried_by_client(text: str) -> bool:
    """Whether the client's error says it sent the request more than once."""
    return _RETRIED.search(text) is not None


def past_the_end(text: str) -> bool:
    """Whether the client's error is a ranged read starting at or past the object's end."""
    return _STATUS_416.search(text) is not None or "InvalidRange" in text


def transient(text: str) -> bool:
    """Whether a client error is worth another try: throttling, 5xx, a broken connection."""
    return _STATUS_RETRY.search(text) is not None or any(w in text for w in _BROKEN)


def first_line(e: BaseException) -> str:
    """The error's text on one line, at most 300 characters, with a server's XML error document
    in it given as its code and message (its prolog alone filled the room left after the
    client's account of the request)."""
    text = " ".join(str(e).split())
    reason = ""
    if (doc := _XML_DOC.search(text)) is not None:
        found = [m.group(1) for m in (_XML_CODE.search(text, doc.start()),
                                      _XML_MESSAGE.search(text, doc.start())) if m]
        if found:
            reason = ": ".join(found)
            text = text[:doc.start()] + reason
    if len(text) > 300:
        tail = f"... {reason}" if reason else "..."
        text = text[:300 - len(tail)] + tail
    return text
