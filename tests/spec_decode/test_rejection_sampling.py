"""Verification at temperature > 0 is vLLM's rejection sampling: the worker's sampler draws each verified position
from the request's processed distribution and the scheduler keeps drafts while they equal the draws
(spec_decode/verify.py). Checked statistically with fixed target distributions p (built independently with
transformers' logits warpers) and a deterministic draft (q one-hot): the emitted tokens follow p at every position
(chi-square, and Kolmogorov-Smirnov on the token frequencies), a draft token is kept with probability
min(1, p/q) = p(draft), and a rejected position emits normalize(max(0, p - q))."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pagellm import SamplingParams
from pagellm.model_executor.layers.sampler import Sampler
from pagellm.spec_decode.verify import num_accepted
from pagellm.worker.input_batch import BatchedRequest
from pagellm.worker.isolated_outputs import BatchSampler

V, K, N = 8, 2, 30000  # vocabulary, draft length, verify steps


def chi_square_critical(df: int, z: float = 3.719) -> float:
    """Upper critical value at alpha = 1e-4 (Wilson-Hilferty; checked against tables in test_sampler.py)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(tokens: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    counts = np.bincount(tokens, minlength=len(probs))
    assert counts[probs == 0].sum() == 0, "a token outside the target's support was emitted"
    expected = probs * len(tokens)
    cells = expected > 0
    return float(((counts[cells] - expected[cells]) ** 2 / expected[cells]).sum()), int(cells.sum()) - 1


def assert_follows(tokens: np.ndarray, probs: np.ndarray) -> None:
    assert len(tokens) > 500, "too few samples for the test to mean anything"
    stat, df = chi_square(tokens, probs)
    assert stat < chi_square_critical(df), (stat, df)
    # Kolmogorov-Smirnov over the token ids' frequencies: the empirical CDF within c(1e-4) / sqrt(n) of the
    # target's (conservative for a discrete law, so still a valid bound).
    empirical = np.cumsum(np.bincount(tokens, minlength=len(probs))) / len(tokens)
    assert np.abs(empirical - np.cumsum(probs)).max() < math.sqrt(-math.log(1e-4 / 2) / 2) / math.sqrt(len(tokens))


@pytest.fixture(scope="module")
def targets():
    """Three positions' raw logits and their target distributions at temperature 0.8 with top-k 6."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper

    logits = torch.randn(K + 1, V, generator=torch.Generator().manual_seed(3)) * 1.5
    warped = TopKLogitsWarper(6)(None, TemperatureLogitsWarper(0.8)(None, logits.clone()))
    return logits, warped.softmax(-1).double().numpy()


def verify(logits: torch.Tensor, draft: list[int], params: SamplingParams | list[SamplingParams], trials: int = N,
           seed: int = 0) -> list[list[int]]:
    """`trials` verify steps of one draft (with `params`, or params[i] for step i), each sampled as the model
    runner samples a request's 1 + k rows; returns each step's emitted tokens."""
    each = params if isinstance(params, list) else [params] * trials
    requests = [BatchedRequest(f"r{i}", [0] * (1 + len(draft)), 0, [0], each[i], True, [], [1], frozenset(),
                               num_spec_tokens=len(draft))
                for i in range(trials) for _ in range(1 + len(draft))]
    torch.manual_seed(seed)
    tensors = BatchSampler(V, torch.device("cpu")).sampling_tensors(requests)
    sampled = Sampler()(logits.repeat(trials, 1), tensors).sampled
    steps = sampled.view(trials, 1 + len(draft)).tolist()
    return [row[:num_accepted(draft, row) + 1] for row in steps]


def test_emitted_tokens_follow_the_target_at_every_position(targets):
    logits, p = targets
    # Drafts of middling probability: both acceptance and rejection happen often.
    draft = [int(np.argsort(-p[0])[1]), int(np.argsort(-p[1])[0])]
    emitted = verify(logits, draft, SamplingParams(temperature=0.8, top_k=6))
    first = np.array([e[0] for e in emitted])
    assert_follows(first, p[0])
    # A draft token is kept with probability min(1, p/q) = p(draft) (q one-hot): within 4 standard errors.
    kept = np.mean([len(e) > 1 for e in emitted])
    assert abs(kept - p[0][draft[0]]) < 4 * math.sqrt(p[0][draft[0]] * (1 - p[0][draft[0]]) / N)
    # Rejected at position 0: the emitted token follows normalize(max(0, p - q)).
    residual = np.maximum(p[0] - np.eye(V)[draft[0]], 0)
    assert_follows(np.array([e[0] for e in emitted if len(e) == 1]), residual / residual.sum())
    # Given the first draft token kept, position 1 follows p[1]; given both, the bonus token follows p[2].
    assert_follows(np.array([e[1] for e in emitted if len(e) > 1]), p[1])
    assert_follows(np.array([e[2] for e in emitted if len(e) > 2]), p[2])


def test_a_draft_outside_top_k_is_never_kept(targets):
    logits, p = targets
    outside = int(np.flatnonzero(p[0] == 0)[0])
    emitted = verify(logits, [outside, 0], SamplingParams(temperature=0.8, top_k=6), trials=2000)
    assert all(len(e) == 1 for e in emitted)
    assert_follows(np.array([e[0] for e in emitted]), p[0])


def test_seeded_verification_is_reproducible(targets):
    logits, p = targets
    draft = [int(np.argsort(-p[0])[1]), int(np.argsort(-p[1])[0])]
    params = [SamplingParams(temperature=0.8, top_k=6, seed=100 + i) for i in range(200)]
    first = verify(logits, draft, params, trials=200, seed=1)
    again = verify(logits, draft, params, trials=200, seed=2)  # the global RNG differs: the seeds decide
    assert first == again
    assert len({tuple(e) for e in first}) > 1
