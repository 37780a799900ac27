"""The loss a quantized tensor's record carries (format 5; see ``docs/format.md``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Lossy:
    """How far a tensor's restored elements may lie from the saved ones.

    Attributes:
        scheme: the quantization of the rows this step wrote (``rowwise8``, ``rowwise4a``...), or
            None when this step wrote them exactly (the loss comes from earlier in the chain, or
            from a compacted chain for a base).
        bound: the most any element this step wrote differs from its saved value (0 if exact).
        chain_bound: the most any element of the restored step differs from the saved one: the
            largest ``bound`` along the chain.
    """

    scheme: str | None
    bound: float
    chain_bound: float

    def to_doc(self) -> dict[str, Any]:
        return {"scheme": self.scheme, "bound": self.bound, "chain_bound": self.chain_bound}
