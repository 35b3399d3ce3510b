"""The vocabulary split across the tensor-parallel ranks: token embeddings (`VocabParallelEmbedding`) and the LM
head (`ParallelLMHead`, or the embedding itself when the checkpoint ties them; both share one float or packed
matrix, see `linear.Linear`).

Rank r holds vocabulary rows [r * ceil(V / tp), ...), the last rank possibly fewer. A lookup zeroes the rows of
ids another rank holds and sums over the ranks; the head's partial logits are gathered into the full vocabulary.
"""
from __future__ import annotations

import torch
from torch import nn

from pagellm.distributed.parallel_state import GroupCoordinator, get_tp_group
from pagellm.model_executor.layers.linear import Linear
from pagellm.model_executor.layers.sharding import Weight, check_shape, narrow_rows


class VocabParallelEmbedding(Linear):
    """Token embeddings [vocab, hidden], this rank's vocabulary rows; `compute_logits` is the tied LM head."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        self.tp: GroupCoordinator = get_tp_group()
        self.num_embeddings = num_embeddings
        self.rows_per_rank = -(-num_embeddings // self.tp.world_size)
        self.vocab_start = self.tp.rank * self.rows_per_rank
        vocab_end = min(num_embeddings, self.vocab_start + self.rows_per_rank)
        if vocab_end <= self.vocab_start:
            raise ValueError(f"A vocabulary of {num_embeddings} tokens is too small to split over "
                             f"{self.tp.world_size} tensor-parallel ranks.")
        super().__init__(embedding_dim, vocab_end - self.vocab_start)

    def load_weight(self, loaded: Weight, quantization: str) -> None:
        check_shape(loaded, (self.num_embeddings, self.input_size))
        self._store(narrow_rows(loaded, self.vocab_start, self.output_size), quantization)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self._lookup(token_ids)
        local_ids = token_ids - self.vocab_start
        elsewhere = (local_ids < 0) | (local_ids >= self.output_size)
        embeddings = self._lookup(local_ids.masked_fill(elsewhere, 0))
        embeddings.masked_fill_(elsewhere.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(embeddings)

    def _lookup(self, local_ids: torch.Tensor) -> torch.Tensor:
        if self.packed_types:
            return self.kernel.dequantize_rows(local_ids)
        return nn.functional.embedding(local_ids, self.weight)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden W^T over the whole vocabulary, on every rank."""
        logits = self.matmul(hidden)
        if self.tp.world_size == 1:
            return logits
        # The gather needs equal parts: the last rank's may be short when tp does not divide the vocabulary.
        if self.output_size < self.rows_per_rank:
            logits = nn.functional.pad(logits, (0, self.rows_per_rank - self.output_size))
        return self.tp.all_gather(logits, dim=-1)[..., :self.num_embeddings]


class ParallelLMHead(VocabParallelEmbedding):
    """An untied LM head: hidden states in, logits over the whole vocabulary out."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden)
