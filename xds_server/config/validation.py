"""``health.validation:`` section: switch-back validation by replay against two peers."""
from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import Field, field_validator, model_validator

from xds_server.config.base import _Model
from xds_server.config.duration import Duration, PositiveDuration, at_most
from xds_server.config.renames import Moves, _Renaming

__all__ = ["DEFAULT_PROMPTS", "LivePromptsConfig", "ValidationConfig"]


DEFAULT_PROMPTS: tuple[str, ...] = (
    "The three primary colours of light are",
    "Write the numbers from one to ten in words:",
    "A short definition of a load balancer:",
    "Translate 'good morning' into French, German and Spanish:",
    "def fibonacci(n):",
    "The capital of Japan is",
    "List four planets of the solar system:",
    "Water boils at sea level at a temperature of",
)
"""Built-in prompts (ours): short, factual or formulaic, so that a healthy model's greedy answer
is stable across replicas; code, arithmetic, translation and lists touch different weights."""


class LivePromptsConfig(_Model):
    """``health.validation.live_prompts``: prompts a relay sampled from live traffic
    (``sentinel-relay --sample-prompts``, sent with ``RoutingFeed/SubmitPrompts``) join the
    replays. Kept in memory only (a bounded ring per cluster, one shared ring for prompts of no
    known cluster): never logged, never written to the state file, never shown (counts only)."""

    enabled: bool = Field(False, description="off by default (seed 002: live sampling is opt-in): every "
                          "submitted prompt is refused and counted; needs health.validation.enabled")
    max_prompts: int = Field(64, ge=1, le=10_000, description="prompts kept per cluster (and in the shared "
                             "pool), the oldest replaced first (ours: 64 = 8 validations' worth of sample 8, "
                             "at most ~128 KB per cluster at max_chars)")
    max_chars: int = Field(2000, ge=1, le=4000, description="longest prompt accepted, in characters (ours: "
                           "2,000, the relay's default; at most 4,000, the agent's replay max_prompt_chars)")
    share: float = Field(0.5, ge=0, le=1, description="ratio of a validation's prompts drawn from the live pool "
                         "(round(share x sample), taken only when the pool holds that many; the rest from "
                         "prompts_file or the built-in set; ours: 0.5 keeps the fixed prompts' known-stable "
                         "half)")


class ValidationConfig(_Renaming):
    """Before a node's first request in half-open PROBATION (it waits unrouted), its agent and two
    HEALTHY peers' agents (same cluster) run the same prompts greedily at the same moment; the
    node passes, and starts its ramp, when its
    disagreement with each peer is within the peers' disagreement with each other plus a margin
    (Diffy's primary/secondary noise floor). Off by default."""

    WHERE: ClassVar[str] = "health.validation"
    MOVED: ClassVar[Moves] = {
        "timeout_s": ("timeout", "s"),
        "check_interval_s": ("check_interval", "s"),
        "retry_s": ("retry", "s"),
        "give_up_s": ("give_up", "s"),
    }

    enabled: bool = Field(False, description="off by default: PROBATION ramps from its first step on probes alone; on: "
                          "unrouted until its replay verdict (docs/switchback.md)")
    prompts_file: str | None = Field(
        None, description="JSONL, one object per line with a 'prompt' string; None: the built-in set "
        "(DEFAULT_PROMPTS, 8 prompts). Read when the control plane starts and at each reload")
    sample: int = Field(8, ge=1, le=64, description="prompts per validation (ours: 8 give a verdict per prompt "
                        "and still finish in well under a second on a simulator, a few seconds on a GPU)")
    max_tokens: int = Field(32, ge=1, le=256, description="tokens per prompt (a few dozen: "
                            "a different model diverges within them, the replay stays short)")
    timeout: Annotated[PositiveDuration, at_most("5m")] = Field(
        Duration.parse("20s"), description="the whole replay on all three agents (ours)")
    token_margin: float = Field(
        0.25, ge=0, le=1,
        description="allowed extra disagreement in the first diverging token, as a ratio of max_tokens "
        "(ours: greedy decoding across batch sizes drifts late in a generation, vllm-project/vllm#48271; a "
        "different model or broken kernel diverges at once)")
    similarity_margin: float = Field(
        0.2, ge=0, le=1, description="allowed extra text dissimilarity (1 - difflib ratio, 0..1; ours)")
    min_prompt_ratio: float = Field(
        0.75, gt=0, le=1,
        description="ratio of prompts on which the candidate must be within the noise (ours: one odd "
        "prompt does not fail a node, Flagger's single-bad-sample complaint)")
    embeddings_url: str | None = Field(
        None, description="optional OpenAI-compatible /v1/embeddings URL the operator names; None: off. "
        "With it, each answer pair is also compared by embedding cosine")
    embeddings_model: str = Field("", description="model field sent to embeddings_url ('' : none sent)")
    cosine_min: float = Field(0.85, ge=-1, le=1, description="seed 002: embedding cosine > 0.85 with a known-good "
                              "answer; applied to the candidate only when peers themselves reach it")
    check_interval: Annotated[PositiveDuration, at_most("1m")] = Field(
        Duration.parse("500ms"), description="how often the control plane looks for "
                                    "nodes waiting for validation (ours; the gate holds them meanwhile)")
    retry: PositiveDuration = Field(
        Duration.parse("5s"), description="a validation that could not run (an agent refused: busy, "
                           "timeout) is tried again after this (ours)")
    give_up: PositiveDuration = Field(
        Duration.parse("2m"),
        description="a validation that could not run for this long (agents busy or unreachable) is decided by "
        "probes alone, said in the reason and event (ours: holding a recovered node out of traffic for "
        "ever is worse than the probe verdict it had before validation existed)")

    live_prompts: LivePromptsConfig = Field(
        default_factory=LivePromptsConfig,
        description="prompts sampled live by relays (ours; seed 002's option; off by default)")

    @model_validator(mode="after")
    def _v_live(self) -> ValidationConfig:
        if self.live_prompts.enabled and not self.enabled:
            raise ValueError("live_prompts.enabled needs health.validation.enabled")
        return self

    @field_validator("embeddings_url")
    @classmethod
    def _v_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return v
