"""Quality metrics: task scores against gold, and fidelity to full prefill (the primary measure on small models)."""

from __future__ import annotations

import re
import string
from collections import Counter
from functools import cache

import torch

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lower-case, drop punctuation and articles, collapse whitespace."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD token F1. Two empty texts agree fully; one empty text shares nothing with a non-empty one."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, answers: list[str]) -> float:
    return max(token_f1(prediction, answer) for answer in answers)


# Ideographs and kana, written without spaces between words: each is a token of its own (as characters are for
# LongBench's Chinese Rouge without a word segmenter).
_UNSPACED_SCRIPTS = re.compile(r"([\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff])")
_WORD = re.compile(r"[^\W_]+")


class UnicodeTokenizer:
    """rouge-score's tokenizer keeps [a-z0-9] only: a Cyrillic, Greek or Chinese summary scored 0 against itself,
    and "café" was "caf". Letters and digits of any script instead; on ASCII text the same tokens as its own."""

    def tokenize(self, text: str) -> list[str]:
        return _WORD.findall(_UNSPACED_SCRIPTS.sub(r" \1 ", text.lower()))


@cache
def _rouge_scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], tokenizer=UnicodeTokenizer())


def rouge_l(prediction: str, references: list[str]) -> float:
    """Rouge-L F-measure (longest common subsequence of tokens), max over references."""
    return max(_rouge_scorer().score(reference, prediction)["rougeL"].fmeasure for reference in references)


def task_score(task: str, prediction: str, answers: list[str]) -> float:
    return qa_f1(prediction, answers) if task == "qa" else rouge_l(prediction, answers)


def first_line(text: str) -> str:
    """What is scored of a short answer: its first non-empty line (LongBench's rule)."""
    return text.lstrip("\n").split("\n", 1)[0]


def agreement(reference_output: str, output: str) -> float:
    """How far a method's generation matches full prefill's: token F1 between the two texts."""
    return token_f1(output, reference_output)


def first_token_kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(full || method) of the first-token distributions, in nats, computed in float64 from logits. At least 0:
    logits equal but for rounding gave about -1e-15, which a fidelity table refuses."""
    log_p = torch.log_softmax(reference_logits.double().flatten(), dim=-1)
    log_q = torch.log_softmax(logits.double().flatten(), dim=-1)
    return max(0.0, float((log_p.exp() * (log_p - log_q)).sum()))


def mean_log_likelihood(token_logprobs: torch.Tensor) -> float:
    """Mean per-token log-probability of the gold answer (teacher-forced); higher is better."""
    if token_logprobs.numel() == 0:
        raise ValueError("the gold answer has no tokens")
    return float(token_logprobs.double().mean())
