"""Power-law row sampling shared by the generators, in O(1) memory per table.

A stream over the full-size Criteo tables (33.76 M rows) must not cost a CDF or a permutation
array per table, so ranks come from rejection-inversion and rows from a keyed Feistel bijection.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_U64 = np.uint64
# splitmix64 finaliser constants (Steele, Lea and Flood, OOPSLA 2014).
_MIX_1 = _U64(0xBF58476D1CE4E5B9)
_MIX_2 = _U64(0x94D049BB133111EB)
_FEISTEL_ROUNDS = 4
# Rows of the most popular ranks are computed once per table: they take most lookups, so the
# Feistel network only runs on the tail (about a quarter of draws at exponent 1.1).
_HEAD_RANKS = 1 << 12


def mix64(x: np.ndarray) -> np.ndarray:
    """Hash uint64 values to well-spread uint64 values (the splitmix64 finaliser).

    Args:
        x: uint64 array.

    Returns:
        A uint64 array of the same shape; equal inputs give equal outputs.
    """
    x = x ^ (x >> _U64(30))
    x = x * _MIX_1
    x = x ^ (x >> _U64(27))
    x = x * _MIX_2
    return x ^ (x >> _U64(31))


def zipf_pmf(num_rows: int, exponent: float) -> np.ndarray:
    """Probability of each rank of a Zipf law truncated at ``num_rows``.

    Args:
        num_rows: number of ranks, >= 1.
        exponent: Zipf exponent, >= 0.

    Returns:
        float64 array of ``num_rows`` probabilities, most popular first, summing to 1.
    """
    weights = np.arange(1, num_rows + 1, dtype=np.float64) ** -float(exponent)
    return weights / weights.sum()


class PowerLawRows:
    """Draws rows of several tables: Zipf-ranked popularity, ranks scattered over each table.

    Ranks follow P(k) ∝ (k + 1)**-exponent on ``[0, rows)``, sampled exactly by
    rejection-inversion (Hörmann and Derflinger, ACM TOMACS 1996; the form of Apache Commons RNG's
    ``RejectionInversionZipfSampler``), which accepts over 98 % of first draws. Each table maps
    ranks to rows through its own keyed bijection, so hot rows sit scattered like hashed Criteo ids
    instead of bunching at row 0, where a chunked delta would look unrealistically small.

    Args:
        table_sizes: rows per table, each >= 1.
        exponent: Zipf exponent, >= 0; 0 is uniform.
        keys: one uint64 key per table; equal keys give equal permutations.
    """

    def __init__(self, table_sizes: Sequence[int], exponent: float, keys: np.ndarray) -> None:
        self.table_sizes = tuple(int(n) for n in table_sizes)
        self.exponent = float(exponent)
        sizes = np.asarray(self.table_sizes, dtype=np.int64)
        self._n = sizes.astype(np.float64)[:, None]
        self._h_n = self._h_integral(self._n + 0.5)
        self._h_x1 = self._h_integral(np.array(1.5)) - 1.0
        # A draw within s_gap below its rounded rank is accepted without the exact test.
        self._s_gap = 2.0 - self._h_integral_inverse(
            self._h_integral(np.array(2.5)) - self._h(np.array(2.0))
        )
        bits = np.ceil(np.log2(np.maximum(sizes, 2))).astype(np.uint64)
        self._left_bits = bits // _U64(2)
        self._right_bits = bits - self._left_bits
        self._round_keys = np.stack([mix64(keys ^ _U64(r)) for r in range(_FEISTEL_ROUNDS)])
        self._head_len = np.minimum(sizes, _HEAD_RANKS)[:, None]
        self._head_start = (np.cumsum(self._head_len) - self._head_len[:, 0])[:, None]
        tables = np.repeat(np.arange(len(sizes)), self._head_len[:, 0])
        head_ranks = np.arange(tables.size) - self._head_start[tables, 0]
        self._head_rows = self._permute(head_ranks, tables)

    def sample(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """Draw ``count`` rows from every table.

        Args:
            rng: source of randomness; consumed deterministically.
            count: rows per table.

        Returns:
            int64 array ``[num_tables, count]``; entry ``[t, i]`` is in ``[0, table_sizes[t])``.
        """
        ranks = self._ranks(rng, count)
        head = ranks < self._head_len
        rows = self._head_rows[np.where(head, self._head_start + ranks, 0)]
        tables, cols = np.nonzero(~head)
        rows[tables, cols] = self._permute(ranks[tables, cols], tables)
        return rows

    def _ranks(self, rng: np.random.Generator, count: int) -> np.ndarray:
        n = np.broadcast_to(self._n, (self._n.shape[0], count))
        h_n = np.broadcast_to(self._h_n, n.shape)
        u = h_n + rng.random(n.shape) * (self._h_x1 - h_n)
        x = self._h_integral_inverse(u)
        k = np.clip(np.floor(x + 0.5), 1.0, n)
        todo = np.flatnonzero(k - x > self._s_gap)
        while todo.size:
            k_t, x_t, u_t = k.flat[todo], x.flat[todo], u.flat[todo]
            rejected = u_t < self._h_integral(k_t + 0.5) - self._h(k_t)
            todo = todo[rejected]
            if todo.size:
                h_t = h_n.flat[todo]
                u_t = h_t + rng.random(todo.size) * (self._h_x1 - h_t)
                x_t = self._h_integral_inverse(u_t)
                k.flat[todo] = np.clip(np.floor(x_t + 0.5), 1.0, n.flat[todo])
                x.flat[todo], u.flat[todo] = x_t, u_t
                todo = todo[k.flat[todo] - x_t > self._s_gap]
        return k.astype(np.int64) - 1

    def _h(self, x: np.ndarray) -> np.ndarray:
        return np.exp(-self.exponent * np.log(x))

    def _h_integral(self, x: np.ndarray) -> np.ndarray:
        log_x = np.log(x)
        return _expm1_over_x((1.0 - self.exponent) * log_x) * log_x

    def _h_integral_inverse(self, x: np.ndarray) -> np.ndarray:
        # The clip keeps log1p finite where rounding pushes t just below -1.
        t = np.maximum(x * (1.0 - self.exponent), -1.0)
        return np.exp(_log1p_over_x(t) * x)

    def _permute(self, ranks: np.ndarray, tables: np.ndarray) -> np.ndarray:
        # Unbalanced Feistel over the smallest power of two covering the table, cycle-walking
        # back into range: a bijection of [0, rows) that needs fewer than two passes on average.
        bound = np.asarray(self.table_sizes, dtype=np.uint64)[tables]
        x = ranks.astype(np.uint64)
        todo = np.arange(x.size)
        while todo.size:
            t = tables[todo]
            x[todo] = self._feistel(x[todo], t)
            todo = todo[x[todo] >= bound[todo]]
        return x.astype(np.int64)

    def _feistel(self, x: np.ndarray, tables: np.ndarray) -> np.ndarray:
        left_bits, right_bits = self._left_bits[tables], self._right_bits[tables]
        left, right = x >> right_bits, x & ((_U64(1) << right_bits) - _U64(1))
        for r in range(_FEISTEL_ROUNDS):
            f = mix64(right ^ self._round_keys[r, tables]) & ((_U64(1) << left_bits) - _U64(1))
            left, right = right, left ^ f
            left_bits, right_bits = right_bits, left_bits
        return (left << right_bits) | right


def _expm1_over_x(x: np.ndarray) -> np.ndarray:
    # expm1(x)/x through its Taylor series near 0, where the quotient loses all precision.
    small = np.abs(x) < 1e-8
    safe = np.where(small, 1.0, x)
    return np.where(small, 1.0 + x / 2.0, np.expm1(safe) / safe)


def _log1p_over_x(x: np.ndarray) -> np.ndarray:
    small = np.abs(x) < 1e-8
    safe = np.where(small, 1.0, x)
    with np.errstate(divide="ignore"):
        # At x = -1 the quotient is +inf: the draw sits at the far end of the table and the
        # caller's clip puts it on the last rank, as the sequential algorithm does.
        return np.where(small, 1.0 - x / 2.0, np.log1p(safe) / safe)
