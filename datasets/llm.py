"""Seeded LLM workloads: a Zipf token stream and an MoE expert-routing trace.

The token stream drives embedding and LM-head rows the way text does (a few tokens take most
positions). The routing trace says which experts each token reaches, so a benchmark can skip the
experts that no token reached since the last checkpoint: with an optimizer that skips parameters
without a gradient, their weights did not change.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from ._ids import PowerLawRows
from ._validate import is_int, is_real, require


@dataclass(frozen=True)
class TokenStreamConfig:
    """What a :class:`TokenStream` generates; every field is validated on construction.

    Raises:
        ValueError: a field is of the wrong type or out of range; the message names the field and
            the value.

    Example:
        >>> TokenStreamConfig(vocab_size=1000, seq_len=16).batch_size
        8
    """

    vocab_size: int = 32000
    """Token ids are in ``[0, vocab_size)``; 32000 is the Llama 2 tokenizer's vocabulary."""
    batch_size: int = 8
    """Sequences per batch."""
    seq_len: int = 1024
    """Tokens per sequence (GPT-2's context length)."""
    zipf_exponent: float = 1.0
    """Power-law exponent of token frequency: Zipf's law for words puts it near 1."""
    seed: int = 0
    """Seeds the token permutation and every batch."""

    def __post_init__(self) -> None:
        require(
            is_int(self.vocab_size) and self.vocab_size >= 2,
            "vocab_size", self.vocab_size, "an integer >= 2",
        )  # fmt: skip
        require(
            is_int(self.batch_size) and self.batch_size >= 1,
            "batch_size", self.batch_size, "an integer >= 1",
        )  # fmt: skip
        require(
            is_int(self.seq_len) and self.seq_len >= 1, "seq_len", self.seq_len, "an integer >= 1"
        )
        require(
            is_real(self.zipf_exponent) and self.zipf_exponent >= 0,
            "zipf_exponent", self.zipf_exponent, "a finite number >= 0",
        )  # fmt: skip
        require(is_int(self.seed) and self.seed >= 0, "seed", self.seed, "an integer >= 0")


@dataclass(frozen=True)
class TokenBatch:
    """One batch of sequences with next-token targets."""

    step: int
    """Position of the batch in its stream."""
    tokens: torch.Tensor
    """int64 ``[B, T]`` input ids."""
    targets: torch.Tensor
    """int64 ``[B, T]``: ``targets[:, i]`` is the token after ``tokens[:, i]``."""


class TokenStream:
    """An endless, seeded stream of :class:`TokenBatch`; batch ``k`` depends only on the seed and k.

    Tokens are drawn independently from a Zipf law over frequency ranks, and ranks are scattered
    over the id space by a keyed permutation (conservative for chunked deltas: real BPE ids
    correlate with frequency). A model can learn the unigram distribution, no more.

    Args:
        config: what to generate.

    Example:
        >>> stream = TokenStream(TokenStreamConfig(vocab_size=100, batch_size=2, seq_len=5))
        >>> batch = stream.batch(0)
        >>> batch.tokens.shape, batch.tokens.dtype
        (torch.Size([2, 5]), torch.int64)
        >>> bool(torch.equal(batch.tokens[:, 1:], batch.targets[:, :-1]))
        True
    """

    def __init__(self, config: TokenStreamConfig) -> None:
        self.config = config
        setup = np.random.default_rng([config.seed, 0])
        self._rows = PowerLawRows(
            [config.vocab_size], config.zipf_exponent, setup.integers(0, 2**64, 1, dtype=np.uint64)
        )

    def batch(self, step: int) -> TokenBatch:
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
        b, t = self.config.batch_size, self.config.seq_len
        sequence = torch.from_numpy(self._rows.sample(rng, b * (t + 1)).reshape(b, t + 1))
        return TokenBatch(step=step, tokens=sequence[:, :-1], targets=sequence[:, 1:])

    def __iter__(self) -> Iterator[TokenBatch]:
        """Yield batches 0, 1, 2, ... without end; slice with ``itertools.islice``."""
        step = 0
        while True:
            yield self.batch(step)
            step += 1


@dataclass(frozen=True)
class MoERoutingConfig:
    """What a :class:`MoERoutingTrace` generates; every field is validated on construction.

    Raises:
        ValueError: a field is of the wrong type or out of range, or ``top_k`` exceeds the experts
            left routable beside the cold ones; the message names the field and the value.

    Example:
        >>> MoERoutingConfig(num_experts=8, top_k=2, cold_fraction=0.25).cold_experts
        2
    """

    num_experts: int = 64
    """Experts per MoE layer (OLMoE-1B-7B: 64)."""
    top_k: int = 8
    """Experts each token is routed to (OLMoE-1B-7B: 8)."""
    num_layers: int = 4
    """MoE layers traced."""
    tokens_per_batch: int = 4096
    """Tokens routed per batch in each layer."""
    popularity_exponent: float = 1.0
    """Skew of expert popularity: the expert of popularity rank r has weight (r + 1)**-exponent.
    Load-balancing losses flatten real routers; lower this to model a stronger one."""
    drift: float = 0.05
    """Standard deviation of each expert's per-batch log-popularity step (a mean-reverting walk)."""
    drift_halflife: int = 500
    """Batches for a log-popularity deviation to halve; the walk settles at a spread of
    ``drift / sqrt(1 - 0.25 ** (1 / drift_halflife))``, about 0.95 by default."""
    cold_fraction: float = 0.125
    """Share of each layer's experts that get no token for a whole cold interval:
    ``floor(cold_fraction * num_experts)`` of them, the least popular at the interval's start, as
    a router starves them. 0 leaves routing to chance alone."""
    cold_interval: int = 50
    """Batches per cold interval."""
    seed: int = 0
    """Seeds the base popularity, the drift and every routing choice."""

    def __post_init__(self) -> None:
        positive = (
            "num_experts", "top_k", "num_layers", "tokens_per_batch", "drift_halflife",
            "cold_interval",
        )  # fmt: skip
        for name in positive:
            value = getattr(self, name)
            require(is_int(value) and value >= 1, name, value, "an integer >= 1")
        for name in ("popularity_exponent", "drift"):
            value = getattr(self, name)
            require(is_real(value) and value >= 0, name, value, "a finite number >= 0")
        require(
            is_real(self.cold_fraction) and 0 <= self.cold_fraction < 1,
            "cold_fraction", self.cold_fraction, "a number in [0, 1)",
        )  # fmt: skip
        require(
            self.top_k <= self.num_experts - self.cold_experts,
            "top_k", self.top_k,
            f"at most the {self.num_experts - self.cold_experts} experts left beside the cold ones",
        )  # fmt: skip
        require(is_int(self.seed) and self.seed >= 0, "seed", self.seed, "an integer >= 0")

    @property
    def cold_experts(self) -> int:
        """Experts per layer left unrouted in each cold interval."""
        # The epsilon keeps 0.29 * 100 at 29, not 28.999999999999996 floored.
        return math.floor(self.cold_fraction * self.num_experts + 1e-9)


@dataclass(frozen=True)
class RoutingBatch:
    """Expert choices of one batch of tokens, in every traced layer."""

    step: int
    """Position of the batch in its trace."""
    experts: torch.Tensor
    """int64 ``[num_layers, tokens_per_batch, top_k]``: distinct experts per token, best first."""
    tokens_per_expert: torch.Tensor
    """int64 ``[num_layers, num_experts]``: tokens routed to each expert; 0 means unrouted."""


class MoERoutingTrace:
    """A seeded, endless MoE routing trace; each iteration restarts it from batch 0.

    Each layer's experts get a Zipf-ranked base popularity in a random order. Log-popularity then
    drifts by a mean-reverting random walk, so the favourites change slowly. Each token picks
    ``top_k`` distinct experts with probability proportional to popularity, as noisy top-k gating
    does (an exponential race: Efraimidis and Spirakis, IPL 2006). Cold experts get no token.

    Args:
        config: what to generate.

    Example:
        >>> config = MoERoutingConfig(num_experts=8, top_k=2, num_layers=1, tokens_per_batch=16)
        >>> batch = next(iter(MoERoutingTrace(config)))
        >>> batch.experts.shape, int(batch.tokens_per_expert.sum())
        (torch.Size([1, 16, 2]), 32)
    """

    def __init__(self, config: MoERoutingConfig) -> None:
        self.config = config

    def __iter__(self) -> Iterator[RoutingBatch]:
        """Yield routing batches 0, 1, 2, ... without end; equal for equal configs."""
        c = self.config
        setup = np.random.default_rng([c.seed, 0])
        rng = np.random.default_rng([c.seed, 1])
        ranks = setup.permuted(np.tile(np.arange(c.num_experts), (c.num_layers, 1)), axis=1)
        base = -c.popularity_exponent * np.log1p(ranks)
        deviation = np.zeros_like(base)
        keep = 0.5 ** (1.0 / c.drift_halflife)
        layer = np.arange(c.num_layers)[:, None]
        step = 0
        while True:
            log_popularity = base + deviation
            if step % c.cold_interval == 0:
                cold = np.zeros(base.shape, dtype=bool)
                coldest = np.argsort(log_popularity, axis=1, kind="stable")[:, : c.cold_experts]
                cold[layer, coldest] = True
            relative = log_popularity - log_popularity.max(axis=1, keepdims=True)
            weight = np.where(cold, 0.0, np.exp(relative))
            yield self._route(rng, weight, step)
            deviation = keep * deviation + c.drift * rng.standard_normal(base.shape)
            step += 1

    def _route(self, rng: np.random.Generator, weight: np.ndarray, step: int) -> RoutingBatch:
        c = self.config
        shape = (c.num_layers, c.tokens_per_batch, c.num_experts)
        with np.errstate(divide="ignore"):
            # Arrival times Exp(1) / weight: the first k arrivals are a weighted draw without
            # replacement, and a cold expert (weight 0) never arrives.
            arrival = rng.standard_exponential(shape) / weight[:, None, :]
        first = np.argpartition(arrival, c.top_k - 1, axis=-1)[..., : c.top_k]
        order = np.argsort(np.take_along_axis(arrival, first, axis=-1), axis=-1)
        experts = np.take_along_axis(first, order, axis=-1)
        flat = experts.reshape(c.num_layers, -1) + c.num_experts * np.arange(c.num_layers)[:, None]
        counts = np.bincount(flat.ravel(), minlength=c.num_layers * c.num_experts)
        return RoutingBatch(
            step=step,
            experts=torch.from_numpy(experts),
            tokens_per_expert=torch.from_numpy(counts.reshape(c.num_layers, c.num_experts)),
        )


def routed_fraction(
    config: MoERoutingConfig, interval: int, *, num_intervals: int = 1
) -> tuple[float, ...]:
    """Fraction of experts (over all layers) that at least one token reached, per interval.

    Experts outside it kept their weights through the interval when the optimizer skips
    parameters without a gradient, so a delta checkpoint may skip them.

    Args:
        config: the trace to measure.
        interval: batches per interval, >= 1.
        num_intervals: consecutive intervals measured from batch 0, >= 1.

    Returns:
        One fraction per interval.

    Raises:
        ValueError: an argument is out of range.

    Example:
        >>> config = MoERoutingConfig(num_experts=8, top_k=2, num_layers=1, tokens_per_batch=64,
        ...                           cold_fraction=0.25, cold_interval=10)
        >>> routed_fraction(config, 10, num_intervals=2)
        (0.75, 0.75)
    """
    require(is_int(interval) and interval >= 1, "interval", interval, "an integer >= 1")
    require(
        is_int(num_intervals) and num_intervals >= 1,
        "num_intervals", num_intervals, "an integer >= 1",
    )  # fmt: skip
    fractions = []
    trace = iter(MoERoutingTrace(config))
    for _ in range(num_intervals):
        routed = np.zeros((config.num_layers, config.num_experts), dtype=bool)
        for _ in range(interval):
            routed |= next(trace).tokens_per_expert.numpy() > 0
        fractions.append(float(routed.mean()))
    return tuple(fractions)
