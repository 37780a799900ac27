"""Seeded Criteo-like click-log batches for DLRM training and delta-checkpoint benchmarks.

The shape is that of the Criteo Kaggle Display Advertising Challenge set as the reference DLRM
consumes it: 13 dense features after ``log(x + 1)``, 26 categorical features with the table
sizes of ``CRITEO_KAGGLE_TABLE_SIZES``, one binary click label. Ids follow a power law, so a few
rows take most lookups, and the fraction of rows touched between two checkpoints (see
:mod:`deltackpt.datasets.touched`) is set by the exponent, the batch size and the interval.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from ._ids import PowerLawRows, mix64
from ._validate import is_int, is_real, require

CRITEO_KAGGLE_TABLE_SIZES: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
"""Rows per categorical feature C1..C26, the reference DLRM's ``ln_emb`` for Criteo Kaggle."""

NUM_DENSE = 13
"""Integer ("dense") features I1..I13."""

# Logit spread of the hidden click model: a model that knew the true click probability would
# reach an AUC of about 0.82 (measured), near MLPerf's DLRM target of 0.8025 on Criteo 1TB.
_SIGNAL_STD = 1.5
_U53 = 2.0**-53
# Samples behind the bias and the row-effect standardisation; their noise moves the click rate
# by about 0.003.
_CALIBRATION_SAMPLES = 1 << 14


def table_sizes(scale: float = 1.0, *, max_rows: int | None = None) -> tuple[int, ...]:
    """Criteo Kaggle table sizes scaled by ``scale``: ``max(2, round(rows * scale))``.

    The floor of 2 keeps every table a real choice (a one-row table is always fully touched);
    ``max_rows`` then caps each table, to bound the largest ones without shrinking the rest.

    Args:
        scale: multiplier on every table size, > 0; 1.0 is the Kaggle set (33.76 M rows).
        max_rows: cap on any one table, >= 2, or None for no cap.

    Returns:
        26 table sizes, in column order C1..C26.

    Raises:
        ValueError: ``scale`` or ``max_rows`` is out of range.

    Example:
        >>> table_sizes(0.001)[:4]
        (2, 2, 10131, 2203)
        >>> max(table_sizes(max_rows=100_000))
        100000
    """
    require(is_real(scale) and scale > 0, "scale", scale, "a finite number > 0")
    require(
        max_rows is None or (is_int(max_rows) and max_rows >= 2),
        "max_rows", max_rows, "None or an integer >= 2",
    )  # fmt: skip
    sizes = (max(2, round(rows * scale)) for rows in CRITEO_KAGGLE_TABLE_SIZES)
    return tuple(sizes if max_rows is None else (min(rows, max_rows) for rows in sizes))


@dataclass(frozen=True)
class CriteoConfig:
    """What a :class:`CriteoStream` generates; every field is validated on construction.

    Raises:
        ValueError: a field is of the wrong type or out of range; the message names the field and
            the value.

    Example:
        >>> CriteoConfig(scale=0.01, batch_size=512).table_sizes[2]
        101312
    """

    scale: float = 1.0
    """Multiplier on the Kaggle table sizes (see :func:`table_sizes`); 1.0 is full size."""
    max_rows: int | None = None
    """Cap on rows per table after scaling, or None."""
    batch_size: int = 2048
    """Samples per batch. The reference DLRM's Kaggle script uses 128; 2048 is a GPU-sized batch."""
    zipf_exponent: float = 1.1
    """Power-law exponent of id popularity; 0 is uniform, larger is more skewed. 1.1 is the value
    NVIDIA HugeCTR's synthetic embedding benchmarks use."""
    click_rate: float = 0.25
    """Target mean label, in (0, 1). Criteo subsampled non-clicks, so the Kaggle set is far more
    balanced than live traffic; 0.25 is a round stand-in, not a fitted value."""
    seed: int = 0
    """Seeds everything: table permutations, feature distributions, the click model, batches."""

    def __post_init__(self) -> None:
        require(
            is_int(self.batch_size) and self.batch_size >= 1,
            "batch_size", self.batch_size, "an integer >= 1",
        )  # fmt: skip
        require(
            is_real(self.zipf_exponent) and self.zipf_exponent >= 0,
            "zipf_exponent", self.zipf_exponent, "a finite number >= 0",
        )  # fmt: skip
        require(
            is_real(self.click_rate) and 0 < self.click_rate < 1,
            "click_rate", self.click_rate, "a number in (0, 1)",
        )  # fmt: skip
        require(is_int(self.seed) and self.seed >= 0, "seed", self.seed, "an integer >= 0")
        # Checks scale and max_rows.
        table_sizes(self.scale, max_rows=self.max_rows)

    @property
    def table_sizes(self) -> tuple[int, ...]:
        """Rows of each of the 26 tables."""
        return table_sizes(self.scale, max_rows=self.max_rows)


@dataclass(frozen=True)
class CriteoBatch:
    """One batch of click-log samples, ready for a DLRM forward pass.

    ``indices[t]`` with ``offsets`` is the input of table ``t``'s ``nn.EmbeddingBag``: one id per
    sample per table, as in Criteo. ``indices.T`` is the ``[B, 26]`` form for ``nn.Embedding``.
    """

    step: int
    """Position of the batch in its stream."""
    dense: torch.Tensor
    """float32 ``[B, 13]``: ``log(count + 1)`` of each integer feature, 0 where missing."""
    indices: torch.Tensor
    """int64 ``[26, B]``: row ids, ``indices[t]`` in ``[0, table_sizes[t])``."""
    offsets: torch.Tensor
    """int64 ``[B]``: bag starts into each ``indices[t]``, i.e. ``arange(B)``."""
    labels: torch.Tensor
    """float32 ``[B]``: 1.0 for a click, else 0.0."""


class CriteoStream:
    """An endless, seeded stream of :class:`CriteoBatch`; batch k depends only on the seed and k.

    Labels come from a hidden logistic model over the features (a weight per dense feature, an
    effect per table row), so a DLRM can learn; the click model is fixed by the seed. Building a
    stream is cheap at any scale: nothing per row is stored.

    Args:
        config: what to generate.

    Example:
        >>> stream = CriteoStream(CriteoConfig(scale=0.001, batch_size=4))
        >>> batch = stream.batch(0)
        >>> batch.dense.shape, batch.indices.shape, batch.labels.dtype
        (torch.Size([4, 13]), torch.Size([26, 4]), torch.float32)
        >>> bool(torch.equal(next(iter(stream)).indices, batch.indices))
        True
    """

    def __init__(self, config: CriteoConfig) -> None:
        self.config = config
        self.table_sizes = config.table_sizes
        setup = np.random.default_rng([config.seed, 0])
        num_tables = len(self.table_sizes)
        self._rows = PowerLawRows(
            self.table_sizes,
            config.zipf_exponent,
            setup.integers(0, 2**64, num_tables, dtype=np.uint64),
        )
        # Integer features: heavy-tailed counts, log-normal with per-feature location and spread,
        # each missing at its own rate (the DLRM loader reads a missing count as 0).
        self._count_mu = setup.uniform(0.0, 3.0, NUM_DENSE)
        self._count_sigma = setup.uniform(0.5, 1.5, NUM_DENSE)
        self._missing = setup.uniform(0.0, 0.4, NUM_DENSE)
        # Click model: logit = bias + signal, half of the signal's variance from each side.
        self._dense_weight = _unit(setup.standard_normal(NUM_DENSE))
        self._table_weight = _unit(setup.standard_normal(num_tables))
        self._row_effect_keys = setup.integers(0, 2**64, (num_tables, 1), dtype=np.uint64)
        # Row effects are standardised per table under that table's own popularity, and the bias
        # solved on a calibration sample, so the signal strength and the click rate hold for
        # every seed; raw effects of the few hot rows would otherwise shift both at random.
        calibration = np.random.default_rng([config.seed, 2])
        effects = self._raw_row_effects(self._rows.sample(calibration, _CALIBRATION_SAMPLES))
        self._effect_mean = effects.mean(axis=1, keepdims=True)
        spread = effects.std(axis=1, keepdims=True)
        # A table that always shows one row carries no signal.
        self._effect_scale = np.where(spread > 1e-9, 1.0 / np.maximum(spread, 1e-9), 0.0)
        z = calibration.standard_normal((_CALIBRATION_SAMPLES, NUM_DENSE))
        self._bias = _solve_bias(self._signal(z, self._standardise(effects)), config.click_rate)
        self._offsets = torch.arange(config.batch_size, dtype=torch.int64)

    def batch(self, step: int) -> CriteoBatch:
        """Generate batch ``step`` (random access: resuming at a step needs no replay).

        Args:
            step: batch position, >= 0.

        Returns:
            The batch; equal for equal ``(config, step)``.

        Raises:
            ValueError: ``step`` is negative or not an integer.
        """
        require(is_int(step) and step >= 0, "step", step, "an integer >= 0")
        rng = np.random.default_rng([self.config.seed, 1, step])
        size = self.config.batch_size
        rows = self._rows.sample(rng, size)
        z = rng.standard_normal((size, NUM_DENSE))
        counts = np.floor(np.exp(self._count_mu + self._count_sigma * z))
        counts[rng.random((size, NUM_DENSE)) < self._missing] = 0.0
        dense = np.log1p(counts)
        logits = self._bias + self._signal(z, self._standardise(self._raw_row_effects(rows)))
        labels = rng.random(size) < _sigmoid(logits)
        return CriteoBatch(
            step=step,
            dense=torch.from_numpy(dense.astype(np.float32)),
            indices=torch.from_numpy(rows),
            offsets=self._offsets,
            labels=torch.from_numpy(labels.astype(np.float32)),
        )

    def __iter__(self) -> Iterator[CriteoBatch]:
        """Yield batches 0, 1, 2, ... without end; slice with ``itertools.islice``."""
        step = 0
        while True:
            yield self.batch(step)
            step += 1

    def _raw_row_effects(self, rows: np.ndarray) -> np.ndarray:
        # A fixed pseudo-random effect per (table, row), hashed rather than stored so that a
        # full-size stream holds nothing per row.
        bits = mix64(rows.astype(np.uint64) ^ self._row_effect_keys) >> np.uint64(11)
        return bits * _U53

    def _standardise(self, effects: np.ndarray) -> np.ndarray:
        return (effects - self._effect_mean) * self._effect_scale

    def _signal(self, z: np.ndarray, effects: np.ndarray) -> np.ndarray:
        # The dense side uses the latent normal, not the rounded count, so its variance is 1
        # whatever rounding and missing values do to the feature a model sees.
        signal = z @ self._dense_weight + effects.T @ self._table_weight
        return _SIGNAL_STD / math.sqrt(2.0) * signal


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # The logaddexp form cannot overflow for very negative logits (tiny click rates).
    return np.exp(-np.logaddexp(0.0, -x))


def _solve_bias(signal: np.ndarray, click_rate: float) -> float:
    """Newton's method for b with mean(sigmoid(b + signal)) = click_rate (monotone in b)."""
    # Start from the probit approximation of the root, close enough for Newton not to overshoot.
    bias = math.log(click_rate / (1.0 - click_rate)) * math.sqrt(1 + math.pi * signal.var() / 8)
    for _ in range(50):
        p = _sigmoid(bias + signal)
        step = (p.mean() - click_rate) / max(float((p * (1.0 - p)).mean()), 1e-12)
        bias -= step
        if abs(step) < 1e-10:
            break
    return float(bias)
