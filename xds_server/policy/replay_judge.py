"""The switch-back verdict: is a candidate's replay within the noise between two healthy peers?

Pure (the roles of Diffy's candidate / primary / secondary). Each prompt was answered greedily by
the candidate and by peers A and B at the same moment. Per answer pair two measures, each a
ratio 0..1 where 1 is "the same":

- *agreement*: the index of the first token where the two differ, over ``max_tokens`` (the token
  ids when both answers carry them, else the whitespace-split words of the text); two answers
  equal to the end agree 1.0;
- *similarity*: ``difflib.SequenceMatcher`` ratio of the texts;
- optionally *cosine* of the texts' embeddings (given by the caller, seed 002: > 0.85).

A prompt is *within* when for both peers P: agreement(C, P) >= agreement(A, B) - token_margin
and similarity(C, P) >= similarity(A, B) - similarity_margin (and, where cosines are given and
the peers themselves reach ``cosine_min``, cosine(C, P) >= cosine_min). A prompt where a peer
failed to answer has no noise floor and is skipped; one the candidate failed is not within. The
candidate passes when at least ``min_prompt_ratio`` of the judged prompts are within; with fewer
than half of the prompts judged the result is INCONCLUSIVE (the caller asks again later).

Shape::

    j = judge([PromptAnswers(c, a, b), ...], max_tokens=32, token_margin=0.25,
              similarity_margin=0.2, min_prompt_ratio=0.75)
    j.verdict            # "passed" | "failed" | "inconclusive"
    j.detail             # "switch-back: diverges from peers at token 0 of 32 on 8 of 8 prompts; ..."
    j.noise, j.candidate # medians: {"agreement_tokens": .., "similarity": .., "cosine": ..}
"""
from __future__ import annotations

import difflib
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Answer", "Judgement", "PromptAnswers", "agreement_tokens", "judge", "similarity"]


@dataclass(frozen=True, slots=True)
class Answer:
    """One agent's answer to one prompt: ``token_ids`` (None: the engine gave none), ``text``;
    ``ok`` False when the prompt failed on that agent."""

    text: str = ""
    token_ids: tuple[int, ...] | None = None
    ok: bool = True


@dataclass(frozen=True, slots=True)
class PromptAnswers:
    """The candidate's and the two peers' answers to the same prompt; ``cosines``, when
    embeddings are on: (cos(C, A), cos(C, B), cos(A, B))."""

    candidate: Answer
    peer_a: Answer
    peer_b: Answer
    cosines: tuple[float, float, float] | None = None


@dataclass(frozen=True, slots=True)
class Judgement:
    """``verdict`` ("passed", "failed", "inconclusive"), the evidence as one sentence, counts,
    and the medians over judged prompts (``noise``: peer A vs B; ``candidate``: the worse of C vs
    A and C vs B): ``agreement_tokens`` (tokens), ``similarity`` (0..1), ``cosine`` (or None)."""

    verdict: str
    detail: str
    prompts: int
    judged: int
    within: int
    noise: dict[str, float | None]
    candidate: dict[str, float | None]


def _units(a: Answer, b: Answer) -> tuple[Sequence[object], Sequence[object]]:
    if a.token_ids is not None and b.token_ids is not None:
        return a.token_ids, b.token_ids
    return a.text.split(), b.text.split()


def agreement_tokens(a: Answer, b: Answer) -> int:
    """Index of the first differing token (ids when both have them, else words); equal to the
    end: the shorter length (a strict prefix differs where it ends unless both stopped)."""
    x, y = _units(a, b)
    n = min(len(x), len(y))
    for i in range(n):
        if x[i] != y[i]:
            return i
    return n


def similarity(a: Answer, b: Answer) -> float:
    """difflib ratio of the two texts (1.0 for two empty texts), 0..1. Symmetric: difflib's
    ratio depends on the argument order (its longest-match search is greedy from the first), so
    the texts go in a fixed order; swapping two peers never changes a verdict."""
    if not a.text and not b.text:
        return 1.0
    x, y = sorted((a.text, b.text))
    return difflib.SequenceMatcher(None, x, y, autojunk=False).ratio()


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def judge(answers: Sequence[PromptAnswers], *, max_tokens: int, token_margin: float, similarity_margin: float,
          min_prompt_ratio: float, cosine_min: float = 0.85) -> Judgement:
    """The verdict for one validation (see the module docstring). ``max_tokens`` >= 1 (what was
    asked per prompt); margins and ratios 0..1. Never raises for any answers."""
    max_tokens = max(1, max_tokens)
    judged = within = 0
    n_agree: list[float] = []
    n_sim: list[float] = []
    n_cos: list[float] = []
    c_agree: list[float] = []
    c_sim: list[float] = []
    c_cos: list[float] = []
    failing_at: list[float] = []
    for pa in answers:
        c, a, b = pa.candidate, pa.peer_a, pa.peer_b
        if not (a.ok and b.ok):
            continue
        judged += 1
        noise_agree = min(agreement_tokens(a, b), max_tokens)
        noise_sim = similarity(a, b)
        n_agree.append(noise_agree)
        n_sim.append(noise_sim)
        if pa.cosines is not None:
            n_cos.append(pa.cosines[2])
        if not c.ok:
            c_agree.append(0)
            c_sim.append(0.0)
            failing_at.append(0)
            continue
        agree = min(min(agreement_tokens(c, a), agreement_tokens(c, b)), max_tokens)
        sim = min(similarity(c, a), similarity(c, b))
        c_agree.append(agree)
        c_sim.append(sim)
        ok = (agree / max_tokens >= noise_agree / max_tokens - token_margin
              and sim >= noise_sim - similarity_margin)
        if pa.cosines is not None:
            cos = min(pa.cosines[0], pa.cosines[1])
            c_cos.append(cos)
            if pa.cosines[2] > cosine_min and cos <= cosine_min:
                ok = False
        if ok:
            within += 1
        else:
            failing_at.append(agree)
    noise = {"agreement_tokens": _median(n_agree), "similarity": _median(n_sim), "cosine": _median(n_cos)}
    cand = {"agreement_tokens": _median(c_agree), "similarity": _median(c_sim), "cosine": _median(c_cos)}
    total = len(answers)
    peers = (f"peers agree to token {noise['agreement_tokens']:.0f} of {max_tokens}, similarity "
             f"{noise['similarity']:.2f}" if judged else "no prompt answered by both peers")
    if judged == 0 or judged * 2 < total:
        return Judgement("inconclusive", f"switch-back: only {judged} of {total} prompts answered by both peers",
                         total, judged, within, noise, cand)
    if within >= min_prompt_ratio * judged:
        return Judgement("passed", f"answers like its peers on {within} of {judged} prompts (first divergence at "
                         f"token {cand['agreement_tokens']:.0f} of {max_tokens}, similarity "
                         f"{cand['similarity']:.2f}; {peers})", total, judged, within, noise, cand)
    at = _median(failing_at) or 0.0
    return Judgement("failed", f"switch-back: diverges from peers at token {at:.0f} of {max_tokens} on "
                     f"{judged - within} of {judged} prompts (similarity {cand['similarity']:.2f}); {peers}",
                     total, judged, within, noise, cand)
