"""The S3 requests the client library has no call for, signed here (AWS Signature Version 4):
a ``DELETE`` conditional on the object's ETag, and listing and aborting multipart uploads.

Path-style addressing (``ENDPOINT/BUCKET/KEY``), as for the rest of the backend.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import http.client
import time
import urllib.parse
import xml.etree.ElementTree as ET
from dataclasses import dataclass

from ..errors import StoreError
from .s3_config import S3Config

_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"


@dataclass(frozen=True)
class Upload:
    """A multipart upload begun and neither completed nor aborted."""

    key: str  # the object's key in the bucket (prefix included)
    upload_id: str
    initiated: float  # Unix time


class SignedRequests:
    """Signs and sends single requests to one bucket.

    Args:
        config: the bucket, endpoint and credentials.
    """

    def __init__(self, config: S3Config):
        self.config = config
        endpoint = config.endpoint_url or f"https://s3.{config.region}.amazonaws.com"
        parts = urllib.parse.urlsplit(endpoint)
        self._https = parts.scheme == "https"
        self._host = parts.netloc
        self._base = parts.path.rstrip("/")

    def delete_if_match(self, key: str, etag: str) -> bool:
        """Deletes ``key`` if its ETag is ``etag``; returns whether it did (False: the object
        changed or is gone)."""
        status, _ = self._send("DELETE", key, {}, {"If-Match": etag})
        if status in (200, 204):
            return True
        if status in (404, 412):
            return False
        raise StoreError(None, f"conditional delete of {self.config.url}/{key}: HTTP {status}")

    def uploads(self, prefix: str) -> list[Upload]:
        """Multipart uploads in progress under ``prefix`` (a key prefix in the bucket)."""
        found: list[Upload] = []
        query = {"uploads": "", "prefix": prefix}
        while True:
            status, body = self._send("GET", "", query, {})
            if status != 200:
                raise StoreError(None, f"listing multipart uploads of {self.config.url}: HTTP {status}")
            root = ET.fromstring(body)
            for up in root.iter(f"{_NS}Upload"):
                when = up.findtext(f"{_NS}Initiated") or ""
                found.append(Upload(up.findtext(f"{_NS}Key") or "", up.findtext(f"{_NS}UploadId") or "",
                                    _timestamp(when)))
            if (root.findtext(f"{_NS}IsTruncated") or "false").lower() != "true":
                return found
            query = {"uploads": "", "prefix": prefix,
                     "key-marker": root.findtext(f"{_NS}NextKeyMarker") or "",
                     "upload-id-marker": root.findtext(f"{_NS}NextUploadIdMarker") or ""}

    def abort(self, upload: Upload) -> None:
        """Aborts ``upload`` (its parts are freed); an upload already gone is fine."""
        status, _ = self._send("DELETE", upload.key, {"uploadId": upload.upload_id}, {}, absolute=True)
        if status not in (200, 204, 404):
            raise StoreError(None, f"aborting the upload of {self.config.bucket}/{upload.key}: HTTP {status}")

    # -- signing -------------------------------------------------------------------------------

    def _send(self, method: str, key: str, query: dict[str, str], headers: dict[str, str],
              *, absolute: bool = False) -> tuple[int, bytes]:
        """Sends one request, retrying 5xx answers and broken connections until the deadline."""
        if key and not absolute:
            key = f"{self.config.prefix}/{key}" if self.config.prefix else key
        path = f"{self._base}/{self.config.bucket}" + (f"/{key}" if key else "")
        deadline = time.monotonic() + self.config.retry_timeout
        delay = 0.05
        while True:
            try:
                status, body = self._once(method, path, query, headers)
                if status < 500 or time.monotonic() + delay > deadline:
                    return status, body
            except OSError as e:
                if time.monotonic() + delay > deadline:
                    raise StoreError(None, f"{method} {self.config.url}: {e}") from None
            time.sleep(delay)
            delay = min(delay * 2, 5.0)

    def _once(self, method: str, path: str, query: dict[str, str],
              headers: dict[str, str]) -> tuple[int, bytes]:
        now = datetime.datetime.now(datetime.timezone.utc)
        amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
        canonical_path = urllib.parse.quote(path, safe="/-_.~")
        canonical_query = "&".join(
            f"{urllib.parse.quote(k, safe='-_.~')}={urllib.parse.quote(v, safe='-_.~')}"
            for k, v in sorted(query.items()))
        all_headers = {"host": self._host, "x-amz-date": amz_date, "x-amz-content-sha256": _EMPTY_SHA256,
                       **{k.lower(): v for k, v in headers.items()}}
        if self.config.session_token:
            all_headers["x-amz-security-token"] = self.config.session_token
        if self.config.access_key_id:
            signed = ";".join(sorted(all_headers))
            canonical = "\n".join([method, canonical_path, canonical_query,
                                   "".join(f"{k}:{all_headers[k].strip()}\n" for k in sorted(all_headers)),
                                   signed, _EMPTY_SHA256])
            scope = f"{day}/{self.config.region}/s3/aws4_request"
            to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope,
                                 hashlib.sha256(canonical.encode()).hexdigest()])
            key = f"AWS4{self.config.secret_access_key}".encode()
            for part in (day, self.config.region, "s3", "aws4_request"):
                key = hmac.new(key, part.encode(), hashlib.sha256).digest()
            signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
            all_headers["authorization"] = (f"AWS4-HMAC-SHA256 Credential={self.config.access_key_id}/"
                                            f"{scope}, SignedHeaders={signed}, Signature={signature}")
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = cls(self._host, timeout=30)
        try:
            target = canonical_path + (f"?{canonical_query}" if canonical_query else "")
            conn.request(method, target, headers=all_headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()


def _timestamp(text: str) -> float:
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0
