"""The batched sampler against independent references: straightforward per-row NumPy code and Hugging Face
transformers' logits processors, plus a chi-square test of the sampled frequencies.

SamplingTensors are built by the model runner's real BatchSampler.sampling_tensors from BatchedRequests, so the
tensor-building path is covered as well.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pagellm import SamplingParams
from pagellm.model_executor.layers.logits_processors import apply_penalties, bad_words_bans, pad_token_lists
from pagellm.model_executor.layers.sampler import Sampler, apply_min_p, apply_top_k_top_p, gather_logprobs
from pagellm.worker.input_batch import BatchedRequest
from pagellm.worker.isolated_outputs import BatchSampler

V = 64


def batch_sampler(vocab: int = V) -> BatchSampler:
    return BatchSampler(vocab, torch.device("cpu"))


def req(params: SamplingParams, request_id: str = "r", prompt=(), output=(), eos=frozenset()) -> BatchedRequest:
    return BatchedRequest(request_id, [0], 0, [0], params, True, list(prompt), list(output), frozenset(eos))


def random_logits(batch: int, vocab: int = V, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def kept(t: torch.Tensor) -> np.ndarray:
    return torch.isfinite(t).numpy()


# ---- masks: NumPy per-row reference and transformers --------------------------------------------------------
def np_top_k(row: np.ndarray, k: int) -> np.ndarray:
    return row >= np.sort(row)[::-1][k - 1]


def np_top_p(row: np.ndarray, p: float) -> np.ndarray:
    order = np.argsort(-row)
    probs = np.exp(row - row.max())
    probs /= probs.sum()
    mask = np.zeros(len(row), bool)
    mass = 0.0
    for i in order:  # keep tokens in descending order until the mass before them reaches p
        if mass >= p and mask.any():
            break
        mask[i] = True
        mass += probs[i]
    return mask


def np_min_p(row: np.ndarray, min_p: float) -> np.ndarray:
    probs = np.exp(row - row.max())
    probs /= probs.sum()
    return probs >= min_p * probs.max()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_top_k_top_p_min_p_masks(seed):
    from transformers import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = random_logits(6, seed=seed)
    ks = torch.tensor([1, 2, 5, 17, 40, V])
    ps = torch.tensor([0.05, 0.3, 0.5, 0.8, 0.95, 1.0])
    min_ps = torch.tensor([0.0, 0.01, 0.05, 0.2, 0.5, 1.0])
    top_k = kept(apply_top_k_top_p(logits, ks, None))
    top_p = kept(apply_top_k_top_p(logits, None, ps))
    min_p = kept(apply_min_p(logits, min_ps))
    for row in range(6):
        x = logits[row].numpy().astype(np.float64)
        assert (top_k[row] == np_top_k(x, int(ks[row]))).all()
        assert (top_p[row] == np_top_p(x, float(ps[row]))).all()
        assert (min_p[row] == np_min_p(x, float(min_ps[row]))).all()
        one = logits[row:row + 1]
        assert (top_k[row] == kept(TopKLogitsWarper(int(ks[row]))(None, one.clone()))[0]).all()
        if ps[row] < 1.0:
            assert (top_p[row] == kept(TopPLogitsWarper(float(ps[row]))(None, one.clone()))[0]).all()
        if min_ps[row] > 0:
            assert (min_p[row] == kept(MinPLogitsWarper(float(min_ps[row]))(None, one.clone()))[0]).all()
    # Combined top-k + top-p in one pass: top-p over the top-k renormalised distribution (as HF chained).
    both = kept(apply_top_k_top_p(logits, ks, ps))
    for row in range(6):
        ref = TopKLogitsWarper(int(ks[row]))(None, logits[row:row + 1].clone())
        if ps[row] < 1.0:
            ref = TopPLogitsWarper(float(ps[row]))(None, ref)
        assert (both[row] == kept(ref)[0]).all()


# ---- penalties --------------------------------------------------------------------------------------------------
def np_penalties(row, prompt, output, rep, freq, pres):
    row = row.astype(np.float64).copy()
    for t in set(prompt) | set(output):
        row[t] = row[t] / rep if row[t] > 0 else row[t] * rep
    for t in set(output):
        row[t] -= freq * output.count(t) + pres
    return row


def test_penalties_against_numpy_and_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    rng = np.random.default_rng(0)
    logits = random_logits(5, seed=9)
    prompts = [list(rng.integers(0, V, n)) for n in (0, 3, 10, 1, 20)]
    outputs = [list(rng.integers(0, V, n)) for n in (4, 0, 12, 1, 30)]
    rep = [1.0, 1.3, 0.7, 2.0, 1.1]
    freq = [0.5, 0.0, -0.4, 1.0, 2.0]
    pres = [-1.0, 0.3, 0.0, 0.5, -2.0]
    out = apply_penalties(logits, pad_token_lists(prompts, V, "cpu"), pad_token_lists(outputs, V, "cpu"),
                          torch.tensor(rep), torch.tensor(freq), torch.tensor(pres))
    for row in range(5):
        ref = np_penalties(logits[row].numpy(), prompts[row], outputs[row], rep[row], freq[row], pres[row])
        np.testing.assert_allclose(out[row].numpy(), ref, rtol=1e-5, atol=1e-5)
    # transformers' repetition penalty over the whole sequence = vLLM's over prompt + output.
    rep_only = apply_penalties(logits, pad_token_lists(prompts, V, "cpu"), pad_token_lists(outputs, V, "cpu"),
                               torch.tensor(rep), torch.zeros(5), torch.zeros(5))
    for row in range(5):
        ids = prompts[row] + outputs[row]
        if not ids:
            continue
        ref = RepetitionPenaltyLogitsProcessor(rep[row])(torch.tensor([ids]), logits[row:row + 1].clone())
        torch.testing.assert_close(rep_only[row], ref[0])


def test_sampler_applies_penalties_bias_bans_for_greedy_rows():
    """Greedy rows take the argmax after penalties, bias, bad words and min_tokens (built by the runner)."""
    logits = random_logits(5, seed=4)
    top = logits.argmax(dim=-1).tolist()
    requests = [
        req(SamplingParams(temperature=0, repetition_penalty=1e6), "a", prompt=[top[0]]),
        req(SamplingParams(temperature=0, frequency_penalty=2.0), "b", output=[top[1]] * 10),
        req(SamplingParams(temperature=0, logit_bias={7: 100}), "c"),
        req(SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[top[3]]), "d", output=[1]),
        req(SamplingParams(temperature=0), "e"),
    ]
    requests[4].bad_words_token_ids = [[top[4]]]
    tokens = Sampler()(logits, batch_sampler().sampling_tensors(requests)).sampled.tolist()
    assert tokens[0] != top[0] and tokens[1] != top[1] and tokens[2] == 7
    assert tokens[3] != top[3] and tokens[4] != top[4]
    # min_tokens reached: the stop token is allowed again.
    requests[3] = req(SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[top[3]]), "d", output=[1] * 3)
    assert Sampler()(logits, batch_sampler().sampling_tensors(requests)).sampled[3] == top[3]
    # min_tokens masks EOS unless ignore_eos.
    for ignore_eos, expected in ((False, False), (True, True)):
        r = req(SamplingParams(temperature=0, min_tokens=2, ignore_eos=ignore_eos), eos={top[0]})
        assert (Sampler()(logits[:1], batch_sampler().sampling_tensors([r])).sampled[0] == top[0]) == expected


def test_bad_words_bans():
    words = [[5], [1, 2, 3], [9, 4]]
    assert bad_words_bans(words, []) == [5]
    assert bad_words_bans(words, [7, 1, 2]) == [5, 3]
    assert bad_words_bans(words, [1, 2, 9]) == [5, 4]
    assert bad_words_bans(words, [2, 1]) == [5]


def test_gather_logprobs_ranks():
    lp = random_logits(4, seed=3).log_softmax(-1)
    tokens = torch.tensor([0, 5, 17, int(lp[3].argmax())])
    result = gather_logprobs(lp, tokens, [2, None, 0, 4])
    assert result[1] is None
    for row in (0, 2, 3):
        ids, values, ranks = result[row]
        x = lp[row].numpy()
        t = int(tokens[row])
        assert ids[0] == t and values[0] == pytest.approx(x[t]) and ranks[0] == int((x > x[t]).sum()) + 1
        k = len(ids) - 1
        assert ids[1:] == list(np.argsort(-x)[:k]) and ranks[1:] == list(range(1, k + 1))


# ---- sampling -----------------------------------------------------------------------------------------------
def chi_square_critical(df: int, z: float = 3.719) -> float:
    """Upper critical value of the chi-square distribution by the Wilson-Hilferty approximation,
    df * (1 - 2/(9 df) + z sqrt(2/(9 df)))^3, with z the standard normal quantile (3.719: alpha = 1e-4)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_chi_square_critical_value():
    # Known table values at alpha = 1e-4: df=10 -> 35.56, df=30 -> 66.62.
    assert chi_square_critical(10) == pytest.approx(35.56, rel=0.02)
    assert chi_square_critical(30) == pytest.approx(66.62, rel=0.02)


@pytest.mark.parametrize("params", [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=8),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=0.9, min_p=0.1),
    dict(temperature=1.0, top_k=12, top_p=0.9, min_p=0.02),
])
def test_sampled_frequencies_match_distribution(params):
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    vocab, n = 16, 40000
    row = random_logits(1, vocab, seed=21)
    # Target distribution, built with transformers' warpers in vLLM's order (temperature, min_p, top_k, top_p).
    target = TemperatureLogitsWarper(params["temperature"])(None, row.clone())
    if "min_p" in params:
        target = MinPLogitsWarper(params["min_p"])(None, target)
    if "top_k" in params:
        target = TopKLogitsWarper(params["top_k"])(None, target)
    if "top_p" in params:
        target = TopPLogitsWarper(params["top_p"])(None, target)
    probs = target.softmax(-1)[0].double().numpy()
    sp = SamplingParams(**params)
    tensors = batch_sampler(vocab).sampling_tensors([req(sp, f"r{i}") for i in range(n)])
    torch.manual_seed(1234)
    tokens = Sampler()(row.expand(n, vocab).contiguous(), tensors).sampled.numpy()
    counts = np.bincount(tokens, minlength=vocab)
    assert counts[probs == 0].sum() == 0  # masked tokens never drawn
    expected = probs * n
    cells = expected >= 5
    rest = ~cells & (probs > 0)
    observed = list(counts[cells]) + ([counts[rest].sum()] if rest.any() else [])
    expect = list(expected[cells]) + ([expected[rest].sum()] if rest.any() else [])
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expect))
    df = len(observed) - 1
    if df == 0:
        return
    assert stat < chi_square_critical(df), (stat, df)


def test_greedy_rows_exact_next_to_sampled_rows():
    logits = random_logits(8, seed=5)
    params = [SamplingParams(temperature=0 if i % 2 else 1.5, top_k=3 if i % 4 == 0 else -1, min_p=0.3 * (i % 3 == 0))
              for i in range(8)]
    torch.manual_seed(0)
    tokens = Sampler()(logits, batch_sampler().sampling_tensors([req(p, str(i)) for i, p in enumerate(params)])).sampled
    for i in range(1, 8, 2):
        assert tokens[i] == logits[i].argmax()


def test_seeded_rows_independent_of_batch():
    logits = random_logits(6, seed=6)
    seeded = SamplingParams(temperature=1.0, seed=42, top_p=0.9)

    def draws(batch_params, row, steps=20):
        r = batch_sampler()
        requests = [req(p, str(i)) for i, p in enumerate(batch_params)]
        out = []
        for step in range(steps):
            torch.manual_seed(step * 7 + len(batch_params))  # the unseeded rows' global RNG differs per batch
            tokens = Sampler()(logits[:len(requests)], r.sampling_tensors(requests)).sampled.tolist()
            for request, token in zip(requests, tokens):
                request.output_token_ids.append(token)  # the next step samples the next output position
            out.append(tokens[row])
        return out

    alone = draws([seeded], 0)
    logits[3] = logits[0]  # the seeded request sees the same logits at row 3 of the bigger batch
    mixed = draws([SamplingParams(temperature=2.0), SamplingParams(temperature=0), SamplingParams(temperature=0.5),
                   seeded], 3)
    assert alone == mixed
    assert len(set(alone)) > 1
    # A seeded row's draw depends on its output position alone: the same position in a new batch sampler draws the same.
    again = batch_sampler().sampling_tensors([req(seeded, "other", output=[0] * 5)])
    first = batch_sampler().sampling_tensors([req(seeded, "x", output=[9] * 5)])
    assert torch.equal(Sampler()(logits[:1], again).sampled, Sampler()(logits[:1], first).sampled)
