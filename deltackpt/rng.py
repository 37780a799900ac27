"""The random number generator's state as a checkpointable object."""

from __future__ import annotations

from collections.abc import Mapping

import torch


class RngState:
    """The default torch generator's state, as a checkpointable object.

    ``state_dict()`` reads the generator (a uint8 tensor from :func:`torch.get_rng_state`) and
    ``load_state_dict()`` sets it, so saving and restoring a state that holds an ``RngState``
    carries the random stream (dropout masks, sampling) across a restart.

    Example:
        >>> rng = RngState()
        >>> saved = rng.state_dict()
        >>> a = torch.rand(1)
        >>> rng.load_state_dict(saved)
        >>> bool(torch.equal(a, torch.rand(1)))
        True
    """

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"torch": torch.get_rng_state()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        torch.set_rng_state(state["torch"])
