"""EleutherAI's lm-evaluation-harness scores a multiple-choice task through pagellm (issue 32): its
`local-completions` model against a live `pagellm serve` (the remote tokenizer it finds through /tokenizer_info and
/tokenize, loglikelihood requests with echo, logprobs=1 and max_tokens=1) picks the same answer for every item, with
the same loglikelihoods, as its own `hf` model on the same float32 weights, and generates the same greedy answers.
The tasks and their data are local files written here; nothing is downloaded."""
from __future__ import annotations

import json
import random

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the test extra: pip install -e '.[test]'")

TASK = "pagellm_tiny_choice"
GENERATION_TASK = "pagellm_tiny_generation"
NUM_ITEMS = 10
TOLERANCE = 1e-3  # a sum of up to a few tokens' logprobs, each within 1e-4 of transformers'
WORDS = ["red", "green", "blue", "cat", "dog", "house", "river", "seven", "paper", "music", "stone", "winter"]


def write_task(directory) -> None:
    """A task YAML and a jsonl of NUM_ITEMS four-way questions (random words: the tiny model's answers are arbitrary,
    but both backends must give the same ones)."""
    rng = random.Random(0)
    data = directory / "items.jsonl"
    with open(data, "w") as f:
        for _ in range(NUM_ITEMS):
            words = rng.sample(WORDS, 6)
            question = f"Which word comes after {words[0]} and {words[1]}?"
            f.write(json.dumps({"question": question, "choices": words[2:], "answer": rng.randrange(4)}) + "\n")
    (directory / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: answer\n"
        "target_delimiter: \" \"\n"
        "metric_list:\n  - metric: acc\n")
    # The same questions answered by greedy generation (what lm-eval's generate_until tasks ask of the server).
    (directory / f"{GENERATION_TASK}.yaml").write_text(
        f"task: {GENERATION_TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: generate_until\n"
        "doc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_target: \"{{choices[answer]}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 8\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")


@pytest.fixture(scope="module")
def lm_eval_server(model_dir, start_server):
    """No API key (lm-eval's remote tokenizer sends none by default); small steps, so prompts are chunked."""
    yield from start_server(model_dir, "--max-num-batched-tokens", "16")


def evaluate(model: str, model_args: dict, task_dir) -> tuple[float, list[tuple[list[float], int]], list[str]]:
    """lm-eval's accuracy and, per item (by doc id), the choices' loglikelihoods and the item's acc, and the
    generated answers."""
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK, GENERATION_TASK],
                                      log_samples=True, batch_size=1,
                                      task_manager=TaskManager(include_path=str(task_dir), include_defaults=False))
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    per_item = [([resp[0] for resp in sample["filtered_resps"]], sample["acc"]) for sample in samples]
    generated = [sample["resps"][0][0] for sample in sorted(results["samples"][GENERATION_TASK],
                                                            key=lambda s: s["doc_id"])]
    return results["results"][TASK]["acc,none"], per_item, generated


def test_local_completions_scores_as_hf(lm_eval_server, model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    write_task(tmp_path)
    hf_acc, hf_items, hf_generated = evaluate(
        "hf", {"pretrained": str(model_dir), "dtype": "float32", "device": "cpu"}, tmp_path)
    served_acc, served_items, served_generated = evaluate(
        "local-completions", {"model": lm_eval_server.model_name, "base_url": f"{lm_eval_server.url}/v1/completions",
                              "num_concurrent": 1, "max_retries": 1}, tmp_path)
    print(f"acc: local-completions {served_acc}, hf {hf_acc}")
    for doc_id, ((served, served_hit), (hf, _)) in enumerate(zip(served_items, hf_items)):
        print(f"item {doc_id}: acc {served_hit}, loglikelihoods served {[round(x, 4) for x in served]}, "
              f"hf {[round(x, 4) for x in hf]}")
    assert len(served_items) == len(hf_items) == NUM_ITEMS
    for (served, served_hit), (hf, hf_hit) in zip(served_items, hf_items):
        assert served == pytest.approx(hf, abs=TOLERANCE)
        assert max(range(4), key=served.__getitem__) == max(range(4), key=hf.__getitem__)
        assert served_hit == hf_hit
    assert served_acc == hf_acc
    print(f"generated: served {served_generated}, hf {hf_generated}")
    assert served_generated == hf_generated and len(served_generated) == NUM_ITEMS


def generate_chat(model: str, model_args: dict, task_dir) -> list[str]:
    """lm-eval's greedy answers to the generation task with the questions sent as chat messages."""
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[GENERATION_TASK], log_samples=True,
                                      batch_size=1, apply_chat_template=True,
                                      task_manager=TaskManager(include_path=str(task_dir), include_defaults=False))
    return [sample["resps"][0][0] for sample in sorted(results["samples"][GENERATION_TASK], key=lambda s: s["doc_id"])]


def test_local_chat_completions_generates_as_hf(lm_eval_server, model_dir, tmp_path, monkeypatch):
    """lm-eval's `local-chat-completions` (the chat template applied by the server) answers every question as its
    `hf` model does with the same template applied by lm-eval."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    write_task(tmp_path)
    hf = generate_chat("hf", {"pretrained": str(model_dir), "dtype": "float32", "device": "cpu"}, tmp_path)
    served = generate_chat("local-chat-completions", {
        "model": lm_eval_server.model_name, "base_url": f"{lm_eval_server.url}/v1/chat/completions",
        "num_concurrent": 1, "max_retries": 1}, tmp_path)
    print(f"generated: served {served}, hf {hf}")
    assert served == hf and len(served) == NUM_ITEMS
