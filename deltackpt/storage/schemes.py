"""Opening a storage from a URL: one opener per scheme.

``file://PATH`` and plain paths open :class:`~deltackpt.storage.local.LocalStorage`, ``s3://BUCKET/PREFIX``
:class:`~deltackpt.storage.s3.S3Storage`. A backend for
another scheme registers its opener in :data:`OPENERS`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import SettingError
from .base import Storage
from .local import LocalStorage

Opener = Callable[[str, Mapping[str, Any]], Storage]
"""Makes a storage from a URL of its scheme and the caller's ``storage_options``."""


def _open_local(url: str, options: Mapping[str, Any]) -> Storage:
    if options:
        raise SettingError(f"a local store takes no storage_options, got {sorted(options)}")
    return LocalStorage(url.removeprefix("file://"))


def _open_s3(url: str, options: Mapping[str, Any]) -> Storage:
    from .s3 import open_s3  # on first use: a local store's process never loads the S3 client

    return open_s3(url, options)


OPENERS: dict[str, Opener] = {"file": _open_local, "s3": _open_s3}


def open_storage(url: str | os.PathLike[str] | Storage,
                 storage_options: Mapping[str, Any] | None = None) -> Storage:
    """The storage ``url`` names, opened by the opener of its scheme (a storage object is returned
    as it is).

    Args:
        url: ``file://PATH``, a local path, another registered scheme's URL, or a storage.
        storage_options: settings for the backend (credentials, endpoints, ...).

    Raises:
        SettingError: no backend handles the URL's scheme, or it refuses the options.
        StoreError: the backend cannot open the store.

    Example:
        >>> import tempfile
        >>> open_storage("file://" + tempfile.mkdtemp()).capabilities.persistent
        True
    """
    if not isinstance(url, (str, os.PathLike)):
        if not hasattr(url, "capabilities"):
            raise SettingError(f"a store is a path, a URL or a Storage, got {type(url).__name__}")
        if storage_options:
            raise SettingError(f"storage_options {sorted(storage_options)} given with a "
                               f"storage object ({url.url}); pass them to its constructor")
        return url
    path = os.fspath(url)
    if not isinstance(path, str) or not path:
        raise SettingError(f"a store's path must be a non-empty string, got {path!r}")
    scheme = path.split("://", 1)[0] if "://" in path else "file"
    opener = OPENERS.get(scheme)
    if opener is None:
        raise SettingError(f"no storage backend for scheme {scheme!r} in {path!r}; "
                           f"known: {sorted(OPENERS)}")
    return opener(path, storage_options or {})


def storage_options(items: list[str]) -> dict[str, str]:
    """``storage_options`` from ``KEY=VALUE`` strings (a command line's ``--storage-option``).

    Raises:
        SettingError: an item is not ``KEY=VALUE``.

    Example:
        >>> storage_options(["region=eu-west-1", "endpoint_url=http://127.0.0.1:8333"])
        {'region': 'eu-west-1', 'endpoint_url': 'http://127.0.0.1:8333'}
    """
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SettingError(f"--storage-option takes KEY=VALUE, got {item!r}")
        options[key] = value
    return options
