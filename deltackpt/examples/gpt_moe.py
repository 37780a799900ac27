"""A small GPT-style language model with a mixture-of-experts feed-forward in every block.

Three kinds of change show up between two checkpoints, one per delta mechanism:

* token embedding rows change only where a batch used the token (``sparse=True`` gradients and
  SparseAdam): row deltas;
* an expert that no token was routed to is never called, so its gradient stays None and Adam
  skips it (``zero_grad(set_to_none=True)``): its weights stay bit-identical, and the chunks
  holding them are not rewritten;
* in fine-tuning mode (:meth:`GPTMoE.freeze`) the frozen layers get no gradient at all: the
  chunks and rows holding them are never rewritten.

An expert called with zero tokens would get a zero gradient, and Adam would still move it through
its momentum; so the MoE layer calls only experts that received tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..datasets import TokenBatch
from ..errors import SettingError


@dataclass(frozen=True)
class GPTMoEConfig:
    """Shapes of a :class:`GPTMoE`; every field is validated on construction.

    Raises:
        SettingError: a field is out of range; the message names the field and the value.

    Example:
        >>> GPTMoEConfig(num_experts=4, top_k=1).top_k
        1
    """

    vocab_size: int = 512
    """Token ids are in ``[0, vocab_size)``."""
    seq_len: int = 32
    """Longest sequence (rows of the learned position table)."""
    dim: int = 16
    """Model width."""
    num_heads: int = 2
    """Attention heads; must divide ``dim``."""
    num_layers: int = 2
    """Transformer blocks, each with an MoE feed-forward."""
    num_experts: int = 8
    """Experts per MoE layer."""
    top_k: int = 2
    """Experts each token is routed to."""
    expert_hidden: int = 32
    """Hidden width of each expert's MLP."""
    dropout: float = 0.1
    """Dropout on attention weights and block outputs; it draws from the torch RNG, which a
    resumed run must restore to reproduce the uninterrupted one."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "dim", "num_heads", "num_layers", "num_experts",
                     "top_k", "expert_hidden"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise SettingError(f"{name} must be a positive int, got {value!r}")
        if self.dim % self.num_heads:
            raise SettingError(f"num_heads ({self.num_heads}) must divide dim, got dim={self.dim}")
        if self.top_k > self.num_experts:
            raise SettingError(
                f"top_k must be at most num_experts ({self.num_experts}), got {self.top_k}"
            )
        if not 0 <= self.dropout < 1:
            raise SettingError(f"dropout must be in [0, 1), got {self.dropout!r}")


class Expert(nn.Module):
    """One feed-forward expert: Linear, GELU, Linear."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class MoE(nn.Module):
    """Top-k routed experts: a linear gate scores the experts, each token goes to its ``top_k``
    best, and their outputs are mixed by a softmax over the chosen scores.

    Attributes:
        tokens_per_expert: int64 ``[num_experts]``, tokens routed to each expert by the last
            forward pass; an expert at 0 was not called and gets no gradient.
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim, hidden) for _ in range(num_experts))
        self.tokens_per_expert = torch.zeros(num_experts, dtype=torch.int64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        scores, chosen = self.gate(flat).topk(self.top_k, dim=-1)
        weights = scores.softmax(dim=-1)
        self.tokens_per_expert = torch.bincount(chosen.flatten(), minlength=len(self.experts))
        out = torch.zeros_like(flat)
        for e in self.tokens_per_expert.nonzero().flatten().tolist():
            token, slot = (chosen == e).nonzero(as_tuple=True)
            y = self.experts[e](flat[token]) * weights[token, slot].unsqueeze(1)
            out = out.index_add(0, token, y)
        return out.reshape(x.shape)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then the MoE feed-forward."""

    def __init__(self, config: GPTMoEConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.dropout = config.dropout
        self.ln1 = nn.LayerNorm(config.dim)
        self.qkv = nn.Linear(config.dim, 3 * config.dim)
        self.proj = nn.Linear(config.dim, config.dim)
        self.ln2 = nn.LayerNorm(config.dim)
        self.moe = MoE(config.dim, config.expert_hidden, config.num_experts, config.top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.num_heads, d // self.num_heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (d // self.num_heads) ** -0.5
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = F.dropout(att.masked_fill(causal, float("-inf")).softmax(-1), self.dropout,
                        self.training)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + F.dropout(self.proj(y), self.dropout, self.training)
        return x + F.dropout(self.moe(self.ln2(x)), self.dropout, self.training)


class GPTMoE(nn.Module):
    """Token and position embeddings, MoE transformer blocks, a final norm and an LM head.

    The token embedding takes sparse gradients (train it with SparseAdam, see
    :func:`gpt_optimizers`), so only the rows of tokens in a batch change.

    Args:
        config: the shapes.

    Example:
        >>> model = GPTMoE(GPTMoEConfig(vocab_size=50, seq_len=8, num_experts=4))
        >>> model(torch.zeros(2, 8, dtype=torch.int64)).shape
        torch.Size([2, 8, 50])
    """

    def __init__(self, config: GPTMoEConfig):
        super().__init__()
        self.config = config
        self.tok = nn.Embedding(config.vocab_size, config.dim, sparse=True)
        self.pos = nn.Parameter(torch.randn(config.seq_len, config.dim) * 0.02)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[B, T, vocab_size]`` for int64 ``tokens`` ``[B, T]``."""
        t = tokens.shape[1]
        if t > self.config.seq_len:
            raise ValueError(f"sequence length must be at most {self.config.seq_len}, got {t}")
        x = self.tok(tokens) + self.pos[:t]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def freeze(self, trainable_blocks: int = 1) -> None:
        """Fine-tuning mode: only the top ``trainable_blocks`` blocks and the final norm keep
        training, as when adapting the top layers of a pretrained model; the embeddings, the
        other blocks and the LM head get ``requires_grad=False`` and never change.

        Args:
            trainable_blocks: blocks, counted from the top, that keep training.

        Raises:
            SettingError: ``trainable_blocks`` is negative or more than the model has.
        """
        n = len(self.blocks)
        if not isinstance(trainable_blocks, int) or not 0 <= trainable_blocks <= n:
            raise SettingError(
                f"trainable_blocks must be an int in [0, {n}], got {trainable_blocks!r}"
            )
        self.requires_grad_(False)
        for module in (*self.blocks[n - trainable_blocks:], self.ln_f):
            module.requires_grad_(True)


def gpt_loss(model: GPTMoE, batch: TokenBatch) -> torch.Tensor:
    """Mean next-token cross-entropy of ``model`` on ``batch``."""
    logits = model(batch.tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.targets.reshape(-1))


def gpt_optimizers(model: GPTMoE, *, lr: float = 1e-3) -> dict[str, torch.optim.Optimizer]:
    """SparseAdam (``"sparse"``) for the token embedding and Adam (``"dense"``) for the rest,
    over trainable parameters only; an optimizer left without parameters (everything it would
    hold is frozen) is omitted.

    Example:
        >>> model = GPTMoE(GPTMoEConfig(vocab_size=50, seq_len=8))
        >>> sorted(gpt_optimizers(model))
        ['dense', 'sparse']
        >>> model.freeze(1)
        >>> sorted(gpt_optimizers(model))
        ['dense']
    """
    sparse = [p for p in model.tok.parameters() if p.requires_grad]
    tok = {id(p) for p in model.tok.parameters()}
    dense = [p for p in model.parameters() if p.requires_grad and id(p) not in tok]
    optimizers: dict[str, torch.optim.Optimizer] = {}
    if sparse:
        optimizers["sparse"] = torch.optim.SparseAdam(sparse, lr=lr)
    if dense:
        optimizers["dense"] = torch.optim.Adam(dense, lr=lr)
    return optimizers
