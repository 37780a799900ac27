"""Tests for deltackpt.datasets: determinism, shapes, id ranges, skew, touched rows, routing."""

from __future__ import annotations

import importlib.util
import itertools
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deltackpt.datasets import (
    CRITEO_KAGGLE_TABLE_SIZES,
    NUM_DENSE,
    CriteoConfig,
    CriteoStream,
    MoERoutingConfig,
    MoERoutingTrace,
    TokenStream,
    TokenStreamConfig,
    expected_touched_fraction,
    routed_fraction,
    table_sizes,
    touched_fraction,
)
from deltackpt.datasets._ids import PowerLawRows, zipf_pmf

SMALL = CriteoConfig(scale=0.001, batch_size=256)


def _top_share(ids: np.ndarray, num_rows: int, top: float) -> float:
    """Share of lookups taken by the most looked-up ``top`` fraction of a table's rows."""
    counts = np.sort(np.bincount(ids, minlength=num_rows))[::-1]
    return counts[: max(1, int(num_rows * top))].sum() / counts.sum()


def test_install_does_not_claim_top_level_datasets(monkeypatch: pytest.MonkeyPatch) -> None:
    # The Hugging Face name must stay free. `python -m pytest` run from the repository root puts
    # the root on sys.path, where the folder itself shadows it; the install must not add to that.
    root = Path(__file__).resolve().parents[2]
    kept = [p for p in sys.path if p not in ("", ".") and Path(p).resolve() != root]
    monkeypatch.setattr(sys, "path", kept)
    # Doctest collection of the folder imports it as top-level `datasets`; look past that too.
    monkeypatch.delitem(sys.modules, "datasets", raising=False)
    importlib.invalidate_caches()
    spec = importlib.util.find_spec("datasets")
    assert spec is None or Path(spec.origin or "").resolve().parent != root / "datasets"
    ours = importlib.util.find_spec("deltackpt.datasets")
    assert ours is not None and ours.origin == str(root / "datasets" / "__init__.py")


# --- table sizes and config validation ---------------------------------------------------------


def test_table_sizes_follow_the_documented_rule() -> None:
    assert table_sizes() == CRITEO_KAGGLE_TABLE_SIZES
    assert sum(CRITEO_KAGGLE_TABLE_SIZES) == 33_762_577
    small = table_sizes(0.001)
    assert small == tuple(max(2, round(n * 0.001)) for n in CRITEO_KAGGLE_TABLE_SIZES)
    assert min(small) == 2
    capped = table_sizes(max_rows=1000)
    assert max(capped) == 1000 and capped[0] == 1000 and capped[8] == 3


@pytest.mark.parametrize(
    ("kwargs", "field", "shown"),
    [
        ({"scale": 0}, "scale", "0"),
        ({"scale": float("nan")}, "scale", "nan"),
        ({"max_rows": 1}, "max_rows", "1"),
        ({"batch_size": 0}, "batch_size", "0"),
        ({"batch_size": True}, "batch_size", "True"),
        ({"batch_size": 2.5}, "batch_size", "2.5"),
        ({"zipf_exponent": -0.5}, "zipf_exponent", "-0.5"),
        ({"click_rate": 1.0}, "click_rate", "1.0"),
        ({"seed": -3}, "seed", "-3"),
        ({"seed": "7"}, "seed", "'7'"),
    ],
)
def test_criteo_config_errors_name_the_bad_value(kwargs: dict, field: str, shown: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field} must be .*, got {shown}$"):
        CriteoConfig(**kwargs)


@pytest.mark.parametrize(
    ("make", "field", "shown"),
    [
        (lambda: TokenStreamConfig(vocab_size=1), "vocab_size", "1"),
        (lambda: TokenStreamConfig(seq_len=0), "seq_len", "0"),
        (lambda: TokenStreamConfig(zipf_exponent=float("inf")), "zipf_exponent", "inf"),
        (lambda: MoERoutingConfig(num_experts=0), "num_experts", "0"),
        (lambda: MoERoutingConfig(drift=-1.0), "drift", "-1.0"),
        (lambda: MoERoutingConfig(cold_fraction=1.0), "cold_fraction", "1.0"),
        (lambda: MoERoutingConfig(num_experts=8, top_k=7, cold_fraction=0.25), "top_k", "7"),
        (lambda: CriteoStream(SMALL).batch(-1), "step", "-1"),
        (lambda: touched_fraction(SMALL, 0), "interval", "0"),
        (lambda: routed_fraction(MoERoutingConfig(), 1, num_intervals=0), "num_intervals", "0"),
    ],
)
def test_other_errors_name_the_bad_value(make, field: str, shown: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field} must be .*, got {shown}$"):
        make()


# --- Criteo stream --------------------------------------------------------------------------------


def test_criteo_batch_shapes_and_dtypes() -> None:
    batch = CriteoStream(SMALL).batch(3)
    size = SMALL.batch_size
    assert batch.step == 3
    assert batch.dense.shape == (size, NUM_DENSE) and batch.dense.dtype == torch.float32
    assert batch.indices.shape == (26, size) and batch.indices.dtype == torch.int64
    assert torch.equal(batch.offsets, torch.arange(size))
    assert batch.labels.shape == (size,) and batch.labels.dtype == torch.float32
    assert torch.isfinite(batch.dense).all() and (batch.dense >= 0).all()
    assert set(batch.labels.unique().tolist()) <= {0.0, 1.0}
    # One id per sample per table: the batch feeds nn.EmbeddingBag as it is.
    bag = torch.nn.EmbeddingBag(SMALL.table_sizes[2], 4, mode="sum")
    assert bag(batch.indices[2], batch.offsets).shape == (size, 4)


def test_criteo_is_deterministic_per_seed_and_random_access() -> None:
    a, b = CriteoStream(SMALL), CriteoStream(SMALL)
    for first, second in zip(itertools.islice(a, 3), (b.batch(k) for k in range(3)), strict=True):
        for name in ("dense", "indices", "offsets", "labels"):
            assert torch.equal(getattr(first, name), getattr(second, name))
    other = CriteoStream(CriteoConfig(scale=0.001, batch_size=256, seed=1)).batch(0)
    assert not torch.equal(other.indices, a.batch(0).indices)
    assert not torch.equal(a.batch(0).indices, a.batch(1).indices)


@pytest.mark.parametrize(
    "config",
    [
        CriteoConfig(batch_size=512),
        CriteoConfig(scale=0.0001, batch_size=512, zipf_exponent=0.0),
        CriteoConfig(scale=0.01, max_rows=5000, batch_size=512, zipf_exponent=3.0, seed=9),
    ],
)
def test_criteo_ids_stay_in_range_per_table(config: CriteoConfig) -> None:
    stream = CriteoStream(config)
    sizes = torch.tensor(config.table_sizes)[:, None]
    for step in range(4):
        indices = stream.batch(step).indices
        assert (indices >= 0).all() and (indices < sizes).all()


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 1 << 40), min_size=1, max_size=4),
    exponent=st.floats(0.0, 4.0),
    seed=st.integers(0, 2**32),
)
def test_sampled_rows_always_in_range(sizes: list[int], exponent: float, seed: int) -> None:
    keys = np.random.default_rng(seed).integers(0, 2**64, len(sizes), dtype=np.uint64)
    rows = PowerLawRows(sizes, exponent, keys).sample(np.random.default_rng(seed), 300)
    assert rows.shape == (len(sizes), 300)
    assert (rows >= 0).all() and (rows < np.array(sizes)[:, None]).all()


@pytest.mark.parametrize("num_rows", [1, 2, 3, 255, 4096, 4097, 70_001])
def test_row_permutation_is_a_bijection(num_rows: int) -> None:
    rows = PowerLawRows([num_rows], 1.0, np.array([42], dtype=np.uint64))
    # Both the cached head and the Feistel tail must give every row exactly once.
    ranks = np.arange(num_rows)
    permuted = rows._permute(ranks, np.zeros(num_rows, dtype=np.int64))
    assert np.array_equal(np.sort(permuted), ranks)
    assert np.array_equal(rows._head_rows, permuted[:4096])


@pytest.mark.parametrize("exponent", [0.0, 1.1, 2.5])
def test_rank_frequencies_match_the_zipf_law(exponent: float) -> None:
    num_rows, draws = 12, 120_000
    sampler = PowerLawRows([num_rows], exponent, np.array([7], dtype=np.uint64))
    ranks = sampler._ranks(np.random.default_rng(0), draws)[0]
    observed = np.bincount(ranks, minlength=num_rows)
    expected = zipf_pmf(num_rows, exponent) * draws
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 40.0  # 11 degrees of freedom: p < 1e-4 of a false alarm


def test_power_law_skew_and_scattered_hot_ids() -> None:
    def lookups(exponent: float) -> np.ndarray:
        stream = CriteoStream(CriteoConfig(scale=0.01, zipf_exponent=exponent))
        return torch.cat([b.indices for b in itertools.islice(stream, 10)], dim=1).numpy()

    sizes = CriteoConfig(scale=0.01).table_sizes
    skewed, uniform = lookups(1.1), lookups(0.0)
    # C3 (101,312 rows) and C10 (931 rows): the top 1 % of rows take most lookups under the
    # power law, about 1 % when uniform (20,480 draws make the uniform counts reliable on C10).
    assert _top_share(skewed[2], sizes[2], 0.01) > 0.6
    assert _top_share(skewed[9], sizes[9], 0.01) > 0.35
    assert _top_share(uniform[9], sizes[9], 0.01) < 0.03
    # The hottest rows are spread over the table, not stacked at its start.
    hottest = np.argsort(np.bincount(skewed[2], minlength=sizes[2]))[::-1][:20]
    assert hottest.max() - hottest.min() > sizes[2] // 2
    assert (hottest >= 100).sum() >= 19


@pytest.mark.parametrize("click_rate", [0.25, 0.03])
def test_click_rate_holds_and_labels_are_learnable(click_rate: float) -> None:
    stream = CriteoStream(CriteoConfig(scale=0.001, batch_size=4096, click_rate=click_rate, seed=5))
    batches = [stream.batch(k) for k in range(4)]
    dense = torch.cat([b.dense for b in batches])
    labels = torch.cat([b.labels for b in batches])
    assert abs(labels.mean().item() - click_rate) < 0.015
    # Logistic regression on the dense features alone must beat the constant predictor. Newton's
    # method in numpy: a torch optimizer's first construction alone costs seconds.
    x = dense.double().numpy()
    x = np.hstack([(x - x.mean(0)) / np.maximum(x.std(0), 1e-6), np.ones((len(x), 1))])
    y = labels.double().numpy()
    w = np.zeros(x.shape[1])
    for _ in range(10):
        p = 1.0 / (1.0 + np.exp(-x @ w))
        w += np.linalg.solve((x * (p * (1 - p))[:, None]).T @ x, x.T @ (y - p))
    p = np.clip(1.0 / (1.0 + np.exp(-x @ w)), 1e-12, 1 - 1e-12)
    fitted = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
    rate = y.mean()
    constant = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
    assert fitted < 0.985 * constant


# --- touched fractions ---------------------------------------------------------------------------


def test_touched_fraction_grows_with_interval() -> None:
    reports = [touched_fraction(SMALL, interval, num_intervals=2) for interval in (1, 4, 16)]
    overall = [r.overall for r in reports]
    assert 0 < overall[0] < overall[1] < overall[2] < 1
    for short, long in itertools.pairwise(reports):
        assert all(s <= l + 1e-12 for s, l in zip(short.per_table, long.per_table, strict=True))


def test_touched_fraction_shrinks_with_exponent() -> None:
    overall = [
        touched_fraction(CriteoConfig(scale=0.001, batch_size=256, zipf_exponent=s), 4).overall
        for s in (0.0, 0.8, 1.1, 1.5)
    ]
    assert overall == sorted(overall, reverse=True)
    assert overall[0] > 2 * overall[-1]


@pytest.mark.parametrize("interval", [1, 8])
def test_measured_touched_fraction_matches_closed_form(interval: int) -> None:
    config = CriteoConfig(scale=0.002, batch_size=512, seed=3)
    measured = touched_fraction(config, interval, num_intervals=2)
    expected = expected_touched_fraction(config, interval)
    assert measured.interval == expected.interval == interval
    assert measured.overall == pytest.approx(expected.overall, abs=0.005)
    assert np.allclose(measured.per_table, expected.per_table, atol=0.03)


# --- LLM tokens ----------------------------------------------------------------------------------


def test_token_stream_shapes_targets_range_and_determinism() -> None:
    config = TokenStreamConfig(vocab_size=5000, batch_size=4, seq_len=256, seed=2)
    batch = TokenStream(config).batch(1)
    assert batch.tokens.shape == batch.targets.shape == (4, 256)
    assert batch.tokens.dtype == batch.targets.dtype == torch.int64
    assert torch.equal(batch.tokens[:, 1:], batch.targets[:, :-1])
    assert (batch.tokens >= 0).all() and (batch.targets < 5000).all()
    again = next(itertools.islice(TokenStream(config), 1, None))
    assert torch.equal(again.tokens, batch.tokens) and torch.equal(again.targets, batch.targets)
    other = TokenStream(TokenStreamConfig(vocab_size=5000, batch_size=4, seq_len=256, seed=3))
    assert not torch.equal(other.batch(1).tokens, batch.tokens)


def test_token_frequencies_are_skewed() -> None:
    stream = TokenStream(TokenStreamConfig(vocab_size=10_000, batch_size=8, seq_len=1024))
    tokens = torch.cat([stream.batch(k).tokens.flatten() for k in range(3)]).numpy()
    assert _top_share(tokens, 10_000, 0.01) > 0.4


# --- MoE routing ---------------------------------------------------------------------------------

MOE = MoERoutingConfig(num_experts=16, top_k=2, num_layers=2, tokens_per_batch=512)


def test_routing_batch_shapes_distinct_experts_and_counts() -> None:
    batch = next(iter(MoERoutingTrace(MOE)))
    assert batch.step == 0
    assert batch.experts.shape == (2, 512, 2) and batch.experts.dtype == torch.int64
    assert (batch.experts[..., 0] != batch.experts[..., 1]).all()
    assert batch.tokens_per_expert.shape == (2, 16)
    assert batch.tokens_per_expert.sum(dim=1).tolist() == [512 * 2] * 2
    per_layer = [torch.bincount(batch.experts[l].flatten(), minlength=16) for l in range(2)]
    assert torch.equal(torch.stack(per_layer), batch.tokens_per_expert)


def test_routing_is_deterministic_per_seed() -> None:
    first = list(itertools.islice(MoERoutingTrace(MOE), 3))
    second = list(itertools.islice(MoERoutingTrace(MOE), 3))
    assert all(torch.equal(a.experts, b.experts) for a, b in zip(first, second, strict=True))
    other = next(iter(MoERoutingTrace(MoERoutingConfig(**{**MOE.__dict__, "seed": 1}))))
    assert not torch.equal(other.experts, first[0].experts)


def test_cold_experts_stay_unrouted_for_whole_intervals() -> None:
    config = MoERoutingConfig(
        num_experts=16, top_k=2, num_layers=2, tokens_per_batch=512, cold_fraction=0.25,
        cold_interval=10, drift=0.0,
    )  # fmt: skip
    # 4 of 16 experts per layer get nothing, interval after interval; the rest all get tokens.
    assert routed_fraction(config, 10, num_intervals=3) == (0.75, 0.75, 0.75)
    # Without drift popularity never moves, so the same experts stay cold.
    assert routed_fraction(config, 30) == (0.75,)
    hot = MoERoutingConfig(num_experts=16, top_k=2, num_layers=2, tokens_per_batch=512,
                           cold_fraction=0.0)  # fmt: skip
    assert routed_fraction(hot, 1, num_intervals=2) == (1.0, 1.0)


def test_drift_moves_popularity_and_the_cold_set() -> None:
    config = MoERoutingConfig(
        num_experts=16, top_k=2, num_layers=2, tokens_per_batch=256, cold_fraction=0.25,
        cold_interval=5, drift=1.0, drift_halflife=5,
    )  # fmt: skip
    # A fast walk reorders popularity between cold intervals, so over 40 batches more experts than
    # the 12 routable at any one time get tokens.
    assert routed_fraction(config, 40)[0] > 0.75
