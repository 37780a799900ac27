"""The error tree: every error deltackpt raises derives from :class:`DeltackptError`.

Where a standard exception fits too, the class also derives from it (``StepNotFoundError`` is a
``LookupError``), so callers can catch either.
"""

from __future__ import annotations


class DeltackptError(Exception):
    """Base of every error raised by deltackpt."""


class StoreError(DeltackptError, OSError):
    """The store cannot be opened, read or written."""

    def __str__(self) -> str:
        if self.errno is None and self.strerror:
            return str(self.strerror)  # not an OS error: no "[Errno None]" prefix
        return super().__str__()


class StorageFullError(StoreError):
    """The store ran out of space while writing."""


class StepNotFoundError(DeltackptError, LookupError):
    """The requested step is not committed."""

    def __init__(self, step: int, committed: list[int]):
        shown = ", ".join(map(str, committed[-20:])) or "none"
        more = f" (last 20 of {len(committed)})" if len(committed) > 20 else ""
        super().__init__(f"step {step} is not committed; committed steps{more}: {shown}")
        self.step = step
        self.committed = committed

    def __reduce__(self):  # errors cross between ranks pickled
        return (type(self), (self.step, self.committed))


class StepExistsError(DeltackptError, ValueError):
    """A save named a step that is already committed, or one not after the latest step."""


class ManifestError(DeltackptError, ValueError):
    """A commit record cannot be parsed or breaks the format."""


class BrokenChainError(DeltackptError):
    """A step's chain refers to a step whose commit record is missing or from another lineage."""

    def __init__(self, step: int, missing_step: int, why: str):
        super().__init__(f"chain of step {step} is broken at step {missing_step}: {why}")
        self.step = step
        self.missing_step = missing_step
        self.why = why

    def __reduce__(self):
        return (type(self), (self.step, self.missing_step, self.why))


class IntegrityError(DeltackptError):
    """A stored chunk does not match the size or checksum in its commit record."""

    def __init__(self, step: int, key: str, why: str):
        super().__init__(f"step {step}: chunk {key} is corrupt: {why}")
        self.step = step
        self.key = key
        self.why = why

    def __reduce__(self):
        return (type(self), (self.step, self.key, self.why))


class MissingChunkError(IntegrityError):
    """A chunk listed in a commit record is absent from the store."""

    def __init__(self, step: int, key: str):
        DeltackptError.__init__(self, f"step {step}: chunk {key} is missing")
        self.step = step
        self.key = key

    def __reduce__(self):
        return (type(self), (self.step, self.key))


class StateError(DeltackptError, ValueError):
    """The state passed to save or restore is not supported."""


class KeyMismatchError(StateError, KeyError):
    """The keys of a restore target differ from those saved."""

    def __init__(self, missing: list[str], unexpected: list[str]):
        def show(keys: list[str]) -> str:
            return ", ".join(keys[:10]) + (f" ... ({len(keys)} in all)" if len(keys) > 10 else "")

        parts = []
        if missing:
            parts.append(f"missing from the target: {show(missing)}")
        if unexpected:
            parts.append(f"not in the checkpoint: {show(unexpected)}")
        super().__init__("keys differ; " + "; ".join(parts))
        self.missing = missing
        self.unexpected = unexpected

    def __reduce__(self):
        return (type(self), (self.missing, self.unexpected))

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class DtypeMismatchError(StateError, TypeError):
    """A restore target's dtype differs from the saved one."""


class ShapeMismatchError(StateError):
    """A restore target's shape differs from the saved one."""


class CheckpointAborted(DeltackptError):
    """A save or restore failed on one or more ranks; every rank raises this, nothing was committed.

    Attributes:
        failures: by rank (-1 when the failing rank is unknown: a dead or hung peer), the phase
            and the error.
    """

    def __init__(self, failures: dict[int, tuple[str, str]]):
        lines = "; ".join(f"rank {r if r >= 0 else '?'} in {phase}: {err}"
                          for r, (phase, err) in sorted(failures.items()))
        super().__init__(f"aborted on {len(failures)} rank(s): {lines}")
        self.failures = failures

    def __reduce__(self):
        return (type(self), (self.failures,))


class SettingError(DeltackptError, ValueError):
    """An argument or option has a value the library cannot work with; the message names it."""


class WriterConflictError(DeltackptError):
    """Another writer holds the store's lease (see :mod:`deltackpt.ops.lease`)."""


class ClosedError(DeltackptError, RuntimeError):
    """A :class:`~deltackpt.Checkpointer` was used after :meth:`~deltackpt.Checkpointer.close`."""


class HookClosedError(ClosedError):
    """A :class:`~deltackpt.CheckpointHook` was used after it was closed."""


class ReentrantCallError(DeltackptError, RuntimeError):
    """A save, restore or close of a :class:`~deltackpt.Checkpointer` was called on the thread
    whose own save, restore or close it interrupted (from a signal handler): it cannot run
    there, inside that call. Note the request in the handler and act on it after."""


# Errors about the request itself rather than a rank's failure: the coordinator raises them the
# same way on every rank (a restore of an unknown step is a StepNotFoundError everywhere).
REQUEST_ERRORS = (StepNotFoundError, StepExistsError, StateError, BrokenChainError, ManifestError,
                  WriterConflictError, SettingError)


class ConvertError(DeltackptError, ValueError):
    """An export or import cannot be done as asked: a bad format or option, a dtype the target
    format cannot hold, a source that is not a checkpoint of the named kind."""


class OutputExistsError(ConvertError, FileExistsError):
    """An export's output exists already and overwriting was not asked for."""


class StreamGapError(DeltackptError, LookupError):
    """A delta stream cannot continue from the consumer's step: the steps after it were
    garbage-collected, so the consumer must start again from a base (``load(step)``)."""
