"""Where an ``s3://`` store is and how to reach it: from ``storage_options``, else the standard
AWS environment variables, else the AWS shared files.

========================  =========================  ==========================================
``storage_options`` key   environment variable       AWS files (profile ``AWS_PROFILE``/default)
========================  =========================  ==========================================
``endpoint_url``          ``AWS_ENDPOINT_URL``       ``endpoint_url`` in ``~/.aws/config``
``region``                ``AWS_REGION``,            ``region`` in ``~/.aws/config``
                          ``AWS_DEFAULT_REGION``
``access_key_id``         ``AWS_ACCESS_KEY_ID``      ``aws_access_key_id`` in ``~/.aws/credentials``
``secret_access_key``     ``AWS_SECRET_ACCESS_KEY``  ``aws_secret_access_key``
``session_token``         ``AWS_SESSION_TOKEN``      ``aws_session_token``
========================  =========================  ==========================================

``AWS_CONFIG_FILE`` and ``AWS_SHARED_CREDENTIALS_FILE`` move the files. Credentials are taken as a
pair from the first source that has a key id. Other keys tune the backend:
``conditional_writes`` (default True; False goes on with a server that ignores ``If-None-Match``,
unsafe with two writers), ``retry_timeout`` (seconds of retrying one request, default 60; keep it
below the checkpointer's ``timeout``), ``multipart_bytes`` (objects from this size are uploaded in
parts, default 16 MiB), ``part_bytes`` (default 8 MiB) and ``part_concurrency`` (parts in flight
per object, default 8).
"""

from __future__ import annotations

import configparser
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import SettingError, StoreError

MiB = 1 << 20
_STRINGS = ("endpoint_url", "region", "access_key_id", "secret_access_key", "session_token")
_TUNING = ("conditional_writes", "retry_timeout", "multipart_bytes", "part_bytes", "part_concurrency")


@dataclass(frozen=True)
class S3Config:
    """One store's bucket, prefix, endpoint, credentials and tuning.

    Attributes:
        bucket: the bucket (it must exist).
        prefix: the store's folder in the bucket, without slashes at the ends ("" for the root).
        endpoint_url: the server (empty: AWS's endpoint for ``region``).
        region: the region to sign requests for.
        access_key_id: the key id (empty: unsigned requests).
        secret_access_key: its secret.
        session_token: a temporary credential's token, or empty.
        conditional_writes: whether commits rely on ``If-None-Match`` (checked before the first).
        retry_timeout: seconds one request is retried for.
        multipart_bytes: objects from this size are uploaded in parts.
        part_bytes: the size of each part.
        part_concurrency: parts of one object in flight at once.
    """

    bucket: str
    prefix: str
    endpoint_url: str = ""
    region: str = "us-east-1"
    access_key_id: str = ""
    secret_access_key: str = ""
    session_token: str = ""
    conditional_writes: bool = True
    retry_timeout: float = 60.0
    multipart_bytes: int = 16 * MiB
    part_bytes: int = 8 * MiB
    part_concurrency: int = 8

    def __post_init__(self) -> None:
        if self.retry_timeout <= 0:
            raise SettingError(f"retry_timeout must be > 0 seconds, got {self.retry_timeout!r}")
        if self.part_bytes < 5 * MiB:
            raise SettingError(f"part_bytes must be at least 5 MiB (S3's minimum part), got "
                               f"{self.part_bytes!r}")
        if self.multipart_bytes < self.part_bytes:
            raise SettingError(f"multipart_bytes ({self.multipart_bytes}) must be at least "
                               f"part_bytes ({self.part_bytes})")
        if self.part_concurrency < 1:
            raise SettingError(f"part_concurrency must be >= 1, got {self.part_concurrency!r}")

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    @property
    def server(self) -> str:
        """The server in words, for messages."""
        return self.endpoint_url or f"AWS S3 ({self.region})"

    @classmethod
    def resolve(cls, url: str, options: Mapping[str, Any],
                env: Mapping[str, str] | None = None) -> S3Config:
        """The configuration of ``url`` (``s3://BUCKET[/PREFIX]``) from ``options``, the
        environment ``env`` (default ``os.environ``) and the AWS files.

        Raises:
            SettingError: the URL has no bucket, or an option is unknown, of the wrong type or out
                of range.
            StoreError: an AWS file cannot be parsed.
        """
        env = os.environ if env is None else env
        rest = url.removeprefix("s3://")
        bucket, _, prefix = rest.partition("/")
        if not bucket or rest == url:
            raise SettingError(f"an S3 URL is s3://BUCKET[/PREFIX], got {url!r}")
        unknown = sorted(set(options) - set(_STRINGS) - set(_TUNING))
        if unknown:
            raise SettingError(f"unknown S3 storage_options {unknown}; known: "
                               f"{sorted(_STRINGS + _TUNING)}")
        profile = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE") or "default"
        files = _aws_files(env, profile)
        got: dict[str, Any] = {}
        for key, names in (("endpoint_url", ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")),
                           ("region", ("AWS_REGION", "AWS_DEFAULT_REGION"))):
            value = options.get(key) or next((env[n] for n in names if env.get(n)), "") or files.get(key, "")
            if value:
                got[key] = _string(key, value)
        if options.get("access_key_id"):
            source: Mapping[str, Any] = options
        elif env.get("AWS_ACCESS_KEY_ID"):
            source = {"access_key_id": env["AWS_ACCESS_KEY_ID"],
                      "secret_access_key": env.get("AWS_SECRET_ACCESS_KEY", ""),
                      "session_token": env.get("AWS_SESSION_TOKEN", "")}
        else:
            source = files
        for key in ("access_key_id", "secret_access_key", "session_token"):
            if source.get(key):
                got[key] = _string(key, source[key])
        if got.get("access_key_id") and not got.get("secret_access_key"):
            raise SettingError(f"S3 access key id {got['access_key_id']!r} has no secret access key")
        for key in _TUNING:
            if key in options:
                got[key] = _tuning(key, options[key])
        return cls(bucket=bucket, prefix=prefix.strip("/"), **got)


def _string(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise SettingError(f"S3 storage option {key} must be a string, got {value!r}")
    return value


def _tuning(key: str, value: Any) -> Any:
    """Parses a tuning option, given as its type or as text (from a command line)."""
    try:
        if key == "conditional_writes":
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("true", "1", "yes"):
                return True
            if str(value).lower() in ("false", "0", "no"):
                return False
            raise ValueError(value)
        if key == "retry_timeout":
            return float(value)
        if isinstance(value, bool):
            raise ValueError(value)
        return int(value)
    except (TypeError, ValueError):
        raise SettingError(f"S3 storage option {key} has a bad value {value!r}") from None


def _aws_files(env: Mapping[str, str], profile: str) -> dict[str, str]:
    """``profile``'s settings from the AWS config and credentials files (missing files: none)."""
    home = os.path.expanduser("~")
    found: dict[str, str] = {}
    config_path = env.get("AWS_CONFIG_FILE") or os.path.join(home, ".aws", "config")
    section = profile if profile == "default" else f"profile {profile}"
    for key, value in _section(config_path, section).items():
        if key in ("region", "endpoint_url"):
            found[key] = value
    creds_path = env.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.join(home, ".aws", "credentials")
    for key, value in _section(creds_path, profile).items():
        if key in ("aws_access_key_id", "aws_secret_access_key", "aws_session_token"):
            found[key.removeprefix("aws_")] = value
    return found


def _section(path: str, name: str) -> dict[str, str]:
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read(path)
    except configparser.Error as e:
        raise StoreError(None, f"cannot parse AWS file {path}: {' '.join(str(e).split())}") from None
    return dict(parser[name]) if parser.has_section(name) else {}
