"""Seeded synthetic workloads for delta-checkpoint tests and benchmarks.

Installed as ``deltackpt.datasets`` (never import it as top-level ``datasets``: that name is
Hugging Face's). Three generators, each driven by a validated frozen config:

* :class:`CriteoStream`: DLRM click-log batches shaped like Criteo Kaggle, power-law ids;
  :func:`touched_fraction` and :func:`expected_touched_fraction` report the rows each checkpoint
  interval touches.
* :class:`TokenStream`: Zipf-distributed token batches with next-token targets.
* :class:`MoERoutingTrace`: per-token top-k expert choices with drifting popularity and cold
  experts; :func:`routed_fraction` reports the experts each interval reaches.

Example:
    >>> from deltackpt.datasets import CriteoConfig, CriteoStream
    >>> CriteoStream(CriteoConfig(scale=0.001, batch_size=8)).batch(0).indices.shape
    torch.Size([26, 8])
"""

from __future__ import annotations

from .criteo import (
    CRITEO_KAGGLE_TABLE_SIZES,
    NUM_DENSE,
    CriteoBatch,
    CriteoConfig,
    CriteoStream,
    table_sizes,
)
from .llm import (
    MoERoutingConfig,
    MoERoutingTrace,
    RoutingBatch,
    TokenBatch,
    TokenStream,
    TokenStreamConfig,
    routed_fraction,
)
from .touched import TouchedFraction, expected_touched_fraction, touched_fraction

__all__ = [
    "CRITEO_KAGGLE_TABLE_SIZES",
    "NUM_DENSE",
    "CriteoBatch",
    "CriteoConfig",
    "CriteoStream",
    "MoERoutingConfig",
    "MoERoutingTrace",
    "RoutingBatch",
    "TokenBatch",
    "TokenStream",
    "TokenStreamConfig",
    "TouchedFraction",
    "expected_touched_fraction",
    "routed_fraction",
    "table_sizes",
    "touched_fraction",
]
