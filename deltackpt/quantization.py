"""Opt-in quantization of the rows a delta writes: which tensors, at how many bits, and why.

A store is exact unless the user asks: ``Checkpointer(..., quantize={"model/emb*":
deltackpt.Rowwise(bits=8)})`` quantizes the rows that deltas write for the tensors whose flat key
matches a pattern (``fnmatch``, first match wins); every other tensor, optimizer state included
unless a pattern names it, stays bit-exact, and bases stay exact. A quantized tensor's record
carries the scheme and the bound every restored element honours (see ``docs/format.md``).

Two kinds of rule:

* :class:`Rowwise`: a fixed bit width (8, 4 or 2), optionally with Check-N-Run's adaptive range.
* :class:`ByRestores`: Check-N-Run's rule, the bit width from the number of restores a run
  expects (each restore of a lossy step adds its error once); when the restores so far exceed
  the plan, it raises the bit width for what is saved next.

Example:
    >>> import deltackpt
    >>> q = QuantizePlan({"model/emb*": deltackpt.Rowwise(bits=4, adaptive=True)})
    >>> q.choose("model/emb.0.weight", restores=0).rule.bits
    4
    >>> q.choose("optim/state/0/exp_avg", restores=0) is None
    True
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .errors import DeltackptError
from .kernels import rowwise


class QuantizationError(DeltackptError, ValueError):
    """A quantization rule is malformed, or a tensor it names cannot be quantized."""


@dataclass(frozen=True)
class Rowwise:
    """Row-wise asymmetric quantization: each row's elements as ``bits``-bit codes with one scale
    and bias (float32 at 8 bits, float16 below; see :mod:`deltackpt.kernels.rowwise`).

    Args:
        bits: 8, 4 or 2.
        adaptive: narrow each row's range greedily to cut its L2 error (Check-N-Run's adaptive
            range); only for 4 bits and below, where it pays.

    Example:
        >>> Rowwise(bits=4, adaptive=True).scheme
        'rowwise4a'
    """

    bits: int = 8
    adaptive: bool = False

    def __post_init__(self) -> None:
        if self.bits not in rowwise.BITS:
            raise QuantizationError(f"Rowwise bits must be one of {rowwise.BITS}, got {self.bits!r}")
        if not isinstance(self.adaptive, bool):
            raise QuantizationError(f"Rowwise adaptive must be a bool, got {self.adaptive!r}")
        if self.adaptive and self.bits > 4:
            raise QuantizationError(f"the adaptive range is for 4 bits or fewer, got bits={self.bits}")

    @property
    def scheme(self) -> str:
        """The scheme's name in a commit record: ``rowwise8``, ``rowwise4a``, ..."""
        return f"rowwise{self.bits}{'a' if self.adaptive else ''}"

    @property
    def scale_dtype(self) -> torch.dtype:
        return rowwise.default_scale_dtype(self.bits)

    @classmethod
    def from_scheme(cls, scheme: object) -> Rowwise:
        """The rule of a recorded scheme name.

        Raises:
            QuantizationError: not a scheme this version writes.
        """
        for bits in rowwise.BITS:
            for adaptive in (False, True) if bits <= 4 else (False,):
                if scheme == f"rowwise{bits}{'a' if adaptive else ''}":
                    return cls(bits, adaptive)
        raise QuantizationError(f"unknown quantization scheme {scheme!r}")


# Check-N-Run's rule (NSDI '22, section 5): fewer restores tolerate fewer bits, since each restore
# of a quantized checkpoint puts its error into the model once. Upper bound on restores -> rule.
RESTORE_TIERS: tuple[tuple[float, Rowwise], ...] = (
    (1, Rowwise(2, adaptive=True)),
    (20, Rowwise(4, adaptive=True)),
    (float("inf"), Rowwise(8)),
)


@dataclass(frozen=True)
class ByRestores:
    """The bit width from the restores a run expects: 2 bits (adaptive) for at most one, 4 bits
    (adaptive) for up to 20, 8 bits beyond; once the run has restored more often than it
    expected, the tier of the restores so far plus one.

    Args:
        expected: restores the run plans for (failures it expects to recover from).

    Example:
        >>> ByRestores(expected=3).decide(restores=0)[0].bits
        4
        >>> ByRestores(expected=1).decide(restores=2)[0].bits
        4
    """

    expected: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.expected, int) or isinstance(self.expected, bool) or self.expected < 0:
            raise QuantizationError(f"ByRestores expected must be an int >= 0, got {self.expected!r}")

    def decide(self, restores: int) -> tuple[Rowwise, str]:
        """The rule for the next save after ``restores`` restores, and why."""
        plan = self.expected
        if restores >= plan:
            plan = restores + 1
            why = f"{restores} restores so far use up the {self.expected} expected; planning for {plan}"
        else:
            why = f"{restores} of {plan} expected restores so far"
        for upto, rule in RESTORE_TIERS:
            if plan <= upto:
                return rule, f"{why}: {rule.scheme} (Check-N-Run: up to {upto:g} restores)"
        raise AssertionError("the last tier is unbounded")  # pragma: no cover


Rule = Rowwise | ByRestores


@dataclass(frozen=True)
class Choice:
    """What one tensor of one save is quantized with, and why (kept in the commit record)."""

    pattern: str
    rule: Rowwise
    reason: str

    def to_doc(self) -> dict[str, Any]:
        return {"pattern": self.pattern, "scheme": self.rule.scheme, "reason": self.reason}


class TensorInfo(Protocol):
    """What a rule needs to know of a tensor (a save plan's tensor has it)."""

    @property
    def key(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def global_shape(self) -> tuple[int, ...]: ...


class QuantizePlan:
    """The ``quantize=`` argument of a Checkpointer, checked (patterns over flat tensor keys),
    and the restores the run has made (:class:`ByRestores` chooses by them).

    Args:
        rules: ``{fnmatch pattern: Rowwise | ByRestores}``, or None for an exact store.

    Raises:
        QuantizationError: a pattern that is not a string or a rule of another type.
    """

    def __init__(self, rules: Mapping[str, Rule] | None):
        if rules is not None and not isinstance(rules, Mapping):
            raise QuantizationError(f"quantize must map patterns to rules, got {rules!r}")
        rules = dict(rules or {})
        for pattern, rule in rules.items():
            if not isinstance(pattern, str) or not pattern:
                raise QuantizationError(f"quantize patterns must be non-empty strings, got {pattern!r}")
            if not isinstance(rule, (Rowwise, ByRestores)):
                raise QuantizationError(f"quantize[{pattern!r}] must be deltackpt.Rowwise or "
                                        f"deltackpt.ByRestores, got {rule!r}")
        self.rules = rules
        self.restores = 0

    def __bool__(self) -> bool:
        return bool(self.rules)

    @property
    def recorded_restores(self) -> int | None:
        """What a record keeps of the restores: the count, or None for a store without rules."""
        return self.restores if self.rules else None

    def restored(self, record: dict[str, Any] | None) -> None:
        """After a restore of a step with record field ``quantize``: its count plus this one."""
        self.restores = (record or {}).get("restores", 0) + 1

    def choices(self, tensors: Mapping[str, TensorInfo]) -> dict[str, Choice]:
        """The rule of each tensor (by flat key) a pattern names, chosen with the restores so far.

        Raises:
            QuantizationError: a pattern names a tensor that cannot be quantized row-wise.
        """
        out: dict[str, Choice] = {}
        for t in tensors.values() if self.rules else ():
            choice = self.choose(t.key, restores=self.restores)
            if choice is not None:
                quantizable(t.key, t.dtype, t.global_shape)
                out[t.key] = choice
        return out

    def choose(self, key: str, *, restores: int) -> Choice | None:
        """The rule for tensor ``key`` (first matching pattern), or None: stored exactly."""
        for pattern, rule in self.rules.items():
            if fnmatch.fnmatchcase(key, pattern):
                if isinstance(rule, ByRestores):
                    chosen, reason = rule.decide(restores)
                    return Choice(pattern, chosen, reason)
                return Choice(pattern, rule, "fixed by the quantize= rule")
        return None


def quantizable(key: str, dtype: torch.dtype | str, shape: tuple[int, ...]) -> None:
    """Checks that a tensor a rule names (of a torch dtype, or its name) can be quantized row-wise.

    Raises:
        QuantizationError: not a float32/bfloat16/float16 tensor of two or more dimensions.
    """
    floats = [*rowwise.FLOATS, *(str(d).removeprefix("torch.") for d in rowwise.FLOATS)]
    if dtype not in floats or len(shape) < 2:
        raise QuantizationError(f"quantize names {key!r}, a {dtype} tensor of shape {list(shape)}: "
                                f"row-wise quantization needs float32/bfloat16/float16 rows "
                                f"(two or more dimensions)")
