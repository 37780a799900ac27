"""Base-cadence policies: whether a save writes a full base or a delta.

A policy is a small object with a ``name`` and a ``decide`` method; the commit record keeps its
name, decision and reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


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
    """Decides base or delta for a save that may be a delta."""

    name: str

    def decide(self, chain: ChainState, delta_bytes: int, full_bytes: int) -> Decision:
        """Args: the chain so far, the bytes the delta would write, the bytes of a full base."""


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
            raise ValueError(f"every must be a positive int, got {self.every!r}")
        if not 0 < self.max_delta_fraction <= 1:
            raise ValueError(f"max_delta_fraction must be in (0, 1], got {self.max_delta_fraction!r}")

    def decide(self, chain: ChainState, delta_bytes: int, full_bytes: int) -> Decision:
        if chain.deltas + 1 >= self.every:
            return Decision("base", f"save {self.every} since the last base")
        if delta_bytes > self.max_delta_fraction * full_bytes:
            return Decision(
                "base", f"delta of {delta_bytes} B exceeds {self.max_delta_fraction:g} of a base"
            )
        return Decision("delta", f"delta of {delta_bytes} B of a {full_bytes} B state")
