"""The documents of two tiny lm-evaluation-harness tasks, made here so that
they need no download: ``pagedkv_choice`` (multiple choice, scored by
loglikelihood) and ``pagedkv_generate`` (greedy generation until a newline).

Their YAML files beside this one name these functions (``custom_dataset``);
``lm_eval --include_path tests/lm_eval_tasks`` finds them from any folder.
The offline models have random weights, so the scores mean nothing: the tasks
exist to drive the server the way a real evaluation does (`make test-eval`).
"""

from __future__ import annotations

CHOICE_DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "Rome", "Oslo"], "answer": 0},
    {"question": "Water freezes at", "choices": ["zero degrees", "ninety degrees"], "answer": 0},
    {"question": "Two plus two makes", "choices": ["five", "four", "three"], "answer": 1},
    {"question": "The opposite of hot is", "choices": ["warm", "loud", "cold"], "answer": 2},
    {"question": "A week has", "choices": ["seven days", "ten days"], "answer": 0},
    {"question": "Bees make", "choices": ["milk", "honey", "silk", "wool"], "answer": 1},
]  # fmt: skip

GENERATE_DOCS = [
    {"prompt": "Q: What is 2 + 2?\nA:", "answer": " 4"},
    {"prompt": "Q: Name a colour.\nA:", "answer": " Red"},
    {"prompt": "Q: Spell cat backwards.\nA:", "answer": " tac"},
]


def _dataset(docs: list[dict]):
    from datasets import Dataset, DatasetDict

    return DatasetDict({"test": Dataset.from_list(docs)})


def choice_docs(**kwargs):
    """``pagedkv_choice``'s documents, as a dataset with a ``test`` split."""
    return _dataset(CHOICE_DOCS)


def generate_docs(**kwargs):
    """``pagedkv_generate``'s documents, as a dataset with a ``test`` split."""
    return _dataset(GENERATE_DOCS)
