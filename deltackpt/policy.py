"""Base-cadence policies: whether a save writes a full base or a delta.

A policy is a small object with a ``name`` and a ``decide`` method; the commit record keeps its
name, decision and reason. Deltas are incremental (relative to the previous step) unless the
policy has ``differential = True`` (relative to the base). Policies:

* :class:`EveryK`: a base every K saves, or when a delta would exceed a fraction of a base.
* :class:`Intermittent`: Check-N-Run's intermittent baseline, a base once the deltas since the
  last one add up to a fraction of it.
* :class:`Differential`: every delta relative to the base (restore reads two records).
* :class:`ChainLimit`: a bound on chain length, for a restore-time target.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .errors import SettingError


@dataclass(frozen=True)
class ChainState:
    """The chain a new save would extend.

    Attributes:
        deltas: deltas since the base.
        delta_bytes: bytes written by those deltas.
        base_bytes: bytes written by the base.
    """

    deltas: int
    delta_bytes: int
    base_bytes: int


@dataclass(frozen=True)
class Decision:
    kind: str  # "base" or "delta"
    reason: str


class BasePolicy(Protocol):
    """Decides base or delta for a save that may be a delta.

    A policy may also have ``differential = True``: its deltas are then relative to the base.
    """

    @property
    def name(self) -> str:
        """The policy's name, recorded in each commit record."""

    def decide(self, chain: ChainState, delta_bytes: int, full_bytes: int) -> Decision:
        """Args: the chain so far, the bytes the delta would write, the bytes of a full base."""


def check_policy(policy: object, name: str = "policy") -> BasePolicy:
    """``policy``, if it is one (a ``decide`` method and a ``name``); else SettingError."""
    if not callable(getattr(policy, "decide", None)) or not isinstance(getattr(policy, "name", None), str):
        raise SettingError(f"{name} must be a policy (EveryK, Differential, ChainLimit...: an object "
                           f"with decide() and a name), got {policy!r}")
    return policy  # type: ignore[return-value]  # checked just above


@dataclass(frozen=True)
class EveryK:
    """A base every ``every`` saves, or when a delta would exceed ``max_delta_fraction`` of a base.

    Example:
        >>> EveryK(every=2).decide(ChainState(1, 10, 100), 10, 100).kind
        'base'
    """

    every: int = 10
    max_delta_fraction: float = 0.5
    name: str = "every_k"

    def __post_init__(self) -> None:
        if not isinstance(self.every, int) or self.every < 1:
            raise SettingError(f"every must be a positive int, got {self.every!r}")
        if not 0 < self.max_delta_fraction <= 1:
            raise SettingError(f"max_delta_fraction must be in (0, 1], got {self.max_delta_fraction!r}")

    def decide(self, chain: ChainState, delta_bytes: int, full_bytes: int) -> Decision:
        if chain.deltas + 1 >= self.every:
            return Decision("base", f"save {self.every} since the last base")
        if delta_bytes > self.max_delta_fraction * full_bytes:
            return Decision(
                "base", f"delta of {delta_bytes} B exceeds {self.max_delta_fraction:g} of a base"
            )
        return Decision("delta", f"delta of {delta_bytes} B of a {full_bytes} B state")


@dataclass(frozen=True)
class Intermittent:
    """Check-N-Run's intermittent baseline: a new base once the deltas since the last base
    (this one included) add up to ``max_fraction`` of the base's size.

    Example:
        >>> Intermittent(0.5).decide(ChainState(3, 40, 100), 20, 100).kind
        'base'
    """

    max_fraction: float = 1.0
    name: str = "intermittent"

    def __post_init__(self) -> None:
        if not self.max_fraction > 0:
            raise SettingError(f"max_fraction must be positive, got {self.max_fraction!r}")

    def decide(self, chain: ChainState, delta_bytes: int, full_bytes: int) -> Decision:
        total = chain.delta_bytes + delta_bytes
        base = chain.base_bytes or full_bytes
        if total >= self.max_fraction * base:
            return Decision("base", f"deltas since the base would reach {total} B, "
                                    f"{self.max_fraction:g} of the {base} B base")
        return Decision("delta", f"deltas since the base: {total} B of a {base} B base")


@dataclass(frozen=True)
class Differential:
    """Every delta relative to the base (Check-N-Run's one-shot), so a restore reads the base
    and one delta; ``inner`` decides when to start a new base.

    Example:
        >>> Differential(EveryK(every=4)).differential
        True
    """

    inner: BasePolicy = EveryK()
    name: str = "differential"
    differential: bool = True

    def __post_init__(self) -> None:
        check_policy(self.inner, "inner")

    def decide(self, chain: ChainState, delta_bytes: int, full_bytes: int) -> Decision:
        d = self.inner.decide(chain, delta_bytes, full_bytes)
        return Decision(d.kind, f"{d.reason} (relative to the base)")


@dataclass(frozen=True)
class ChainLimit:
    """A bound on the chain a restore replays: a base once ``max_deltas`` deltas follow the last
    one; ``inner`` decides otherwise.

    Example:
        >>> ChainLimit(2).decide(ChainState(2, 10, 100), 1, 100).kind
        'base'
    """

    max_deltas: int
    inner: BasePolicy = EveryK(every=1_000_000, max_delta_fraction=1.0)
    name: str = "chain_limit"

    def __post_init__(self) -> None:
        if not isinstance(self.max_deltas, int) or self.max_deltas < 0:
            raise SettingError(f"max_deltas must be a non-negative int, got {self.max_deltas!r}")
        check_policy(self.inner, "inner")

    @property
    def differential(self) -> bool:
        return getattr(self.inner, "differential", False)

    def decide(self, chain: ChainState, delta_bytes: int, full_bytes: int) -> Decision:
        if chain.deltas >= self.max_deltas:
            return Decision("base", f"the chain holds {chain.deltas} deltas, the bound is {self.max_deltas}")
        return self.inner.decide(chain, delta_bytes, full_bytes)
