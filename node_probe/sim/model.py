"""The simulated engine's language model: a tokenizer, a chat template and a greedy decoder.

Pure code, no I/O. The model is deterministic: the next token is a function of the whole
context (prompt ids + generated ids), computed with a rolling hash, so a generation cut after
any k tokens and continued from ``prompt ids + first k ids`` yields exactly the rest of the
uninterrupted generation, ids and text. Sampling parameters (temperature, top_p, seed) are
accepted by the HTTP layer and ignored: decoding is always greedy.

Tokenizer: text splits into pieces with :data:`PIECE_RE` (a word with its leading spaces, one
punctuation mark with its leading spaces, or trailing spaces). A piece that is a vocabulary word
gets that word's id; any other piece gets a stable hashed id in ``[FIRST_HASHED_ID,
FIRST_BYTE_ID)``. Generated tokens are vocabulary words, EOS, and (with ``byte_rate`` > 0) lone
bytes: ids ``FIRST_BYTE_ID + b`` for the bytes of :data:`BYTE_TOKENS`, as a byte-level BPE has.

Like a byte-level BPE, the tokenizer disagrees with itself, so text is not a faithful way to
continue a generation (exactly what a real tokenizer does; the relay continues from ids):

- text is decoded incrementally from the tokens' bytes (:func:`detokenize`): while the bytes
  since the last release decode to text ending in U+FFFD they are held back (the token's text
  is ``""``); once a token makes them end otherwise they are released, each byte that is not
  UTF-8 as U+FFFD, and U+FFFD re-tokenizes to a hashed id, not to the byte;
- a piece cut inside a word (`` T`` of `` The``: text held back for a stop string) re-tokenizes
  to a hashed id, not to a prefix of the word: nothing is "healed".

Chat template (token ids): ``BOS``, then per message ``<role> content-pieces END``; with
``add_generation_prompt`` an ``ASSISTANT`` header follows. With ``continue_final_message`` the
final (assistant) message is left open: no ``END``, so the model continues its content.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "BOS_ID",
    "BYTE_TOKENS",
    "END_ID",
    "EOS_ID",
    "FIRST_BYTE_ID",
    "FIRST_HASHED_ID",
    "FIRST_WORD_ID",
    "ROLE_IDS",
    "VOCAB_SIZE",
    "WORDS",
    "Decoder",
    "StepOut",
    "advance",
    "chat_prompt_ids",
    "context_state",
    "detokenize",
    "next_token",
    "token_bytes",
    "token_text",
    "tokenize",
    "use_model_seed",
]

#: Special tokens (ids 0..7); their text is empty in generated output (skip_special_tokens).
SPECIALS = ("<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>",
            "<|end|>")
BOS_ID = 1
EOS_ID = 2
END_ID = 7
#: Chat roles and their header token ids (``developer`` is rendered like ``system``).
ROLE_IDS = {"system": 3, "developer": 3, "user": 4, "assistant": 5, "tool": 6}

#: The words the model generates. Each is exactly one tokenizer piece (see :data:`PIECE_RE`);
#: a few are non-ASCII so clients see multi-byte UTF-8 in deltas.
WORDS = (
    " The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", ".",
    " Tokens", " flow", " like", " water", " through", " a", " healthy", " engine", ",",
    " steady", " and", " on", " time", " naïve", " café", " 東京", " stream", " node", " of",
    " light", " every", " day", " we", " run", " far", "!", " it", " is", " not", " yet",
)
FIRST_WORD_ID = len(SPECIALS)
FIRST_HASHED_ID = FIRST_WORD_ID + len(WORDS)
#: Byte tokens: ``FIRST_BYTE_ID + b`` is the single byte ``b`` (0..255).
FIRST_BYTE_ID = 32000
#: The bytes the model generates as lone tokens (with ``byte_rate`` > 0): the UTF-8 of "é"
#: (C3 A9) and "—" (E2 80 94). In order they make the character; most draws do not (a lead
#: byte held back, then U+FFFD; a lone continuation byte at once U+FFFD).
BYTE_TOKENS = (0xC3, 0xA9, 0xE2, 0x80, 0x94)
#: Token ids are in ``[0, VOCAB_SIZE)``; a prompt id outside is an error (like vLLM's).
VOCAB_SIZE = FIRST_BYTE_ID + 256

#: Tokenizer pieces: a word with leading spaces, one other mark with leading spaces, or spaces.
PIECE_RE = re.compile(r"\s*\w+|\s*[^\s\w]|\s+")

_WORD_IDS = {w: FIRST_WORD_ID + i for i, w in enumerate(WORDS)}
_MASK = (1 << 64) - 1
_BASE_SEED = 0x5EED_CAFE_F00D_D00D
_SEED = _BASE_SEED  # the model this process serves (:func:`use_model_seed`)
_MUL = 0x100000001B3  # FNV-1a 64-bit prime, used as the rolling-hash multiplier


def tokenize(text: str) -> list[int]:
    """Token ids of ``text`` (empty text: no ids)."""
    out = []
    for piece in PIECE_RE.findall(text):
        tid = _WORD_IDS.get(piece)
        if tid is None:
            tid = FIRST_HASHED_ID + zlib.crc32(piece.encode()) % (FIRST_BYTE_ID - FIRST_HASHED_ID)
        out.append(tid)
    return out


def token_text(tid: int) -> str:
    """Text of one generated token on its own: a word's text, ``""`` for special tokens, U+FFFD
    for a lone byte (in a sequence, bytes decode together: :func:`detokenize`).

    Raises:
        ValueError: ``tid`` is a hashed (prompt-only) id, which has no single text.
    """
    if FIRST_WORD_ID <= tid < FIRST_HASHED_ID:
        return WORDS[tid - FIRST_WORD_ID]
    if 0 <= tid < FIRST_WORD_ID:
        return ""
    if FIRST_BYTE_ID <= tid < VOCAB_SIZE:
        return "\ufffd"
    raise ValueError(f"token id {tid} is not a generated token")


def token_bytes(tid: int) -> bytes:
    """UTF-8 bytes of one generated token (a byte token: its one byte; specials: none).

    Raises:
        ValueError: ``tid`` is a hashed (prompt-only) id.
    """
    if FIRST_BYTE_ID <= tid < VOCAB_SIZE:
        return bytes((tid - FIRST_BYTE_ID,))
    if FIRST_WORD_ID <= tid < FIRST_HASHED_ID:
        return WORDS[tid - FIRST_WORD_ID].encode()
    if 0 <= tid < FIRST_WORD_ID:
        return b""
    raise ValueError(f"token id {tid} is not a generated token")


class _Detok:
    """The streaming detokenizer, as vLLM's (``tokenizers.DecodeStream``): the bytes since the
    last text released are decoded with U+FFFD for what is not UTF-8; while that ends in U+FFFD
    (a sequence that may still complete a character) nothing is released. What is pending at
    the end is never released."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> str:
        self._pending += data
        text = self._pending.decode("utf-8", errors="replace")
        if text.endswith("\ufffd"):
            return ""
        self._pending = b""
        return text


def detokenize(ids: Sequence[int]) -> str:
    """Text of a generated sequence, as streamed (special tokens skipped)."""
    dec = _Detok()
    return "".join(dec.feed(token_bytes(t)) for t in ids)


def _mix(x: int) -> int:
    # splitmix64 finaliser: spreads the rolling hash over all 64 bits.
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
    return x ^ (x >> 31)


def use_model_seed(seed: int) -> None:
    """Serve another model in this process: every context hashes from a state derived from
    ``seed`` (0, the default: the built-in model), so greedy answers differ from token 0 on.
    What ``sim-engine --model-seed`` sets (an engine restarted with wrong weights).
    Raises ValueError for a negative seed."""
    global _SEED
    if seed < 0:
        raise ValueError(f"model seed must be >= 0, got {seed}")
    _SEED = _BASE_SEED if seed == 0 else _mix(_BASE_SEED ^ (seed * _MUL & _MASK)) | 1


def advance(state: int, tid: int) -> int:
    """Rolling-hash state after appending token ``tid`` to the context."""
    return ((state ^ (tid + 1)) * _MUL) & _MASK


def context_state(ids: Sequence[int]) -> int:
    """Rolling-hash state of a whole context (O(len))."""
    state = _SEED
    for tid in ids:
        state = advance(state, tid)
    return state


def next_token(state: int, *, eos_rate: float, allow_eos: bool, byte_rate: float = 0.0) -> int:
    """The greedy next token for a context state.

    Args:
        state: :func:`context_state` of prompt + generated ids.
        eos_rate: chance (ratio 0..1, over contexts) that the model's top token is EOS.
        allow_eos: False while ``min_tokens`` is not reached or with ``ignore_eos``: the best
            non-EOS token is chosen instead (what masking EOS's logit does).
        byte_rate: chance (ratio 0..1, over contexts) that the top token is a lone byte of
            :data:`BYTE_TOKENS` (0: words only, the generations of earlier versions).
    """
    h = _mix(state)
    if allow_eos and eos_rate > 0 and (h >> 40) < eos_rate * (1 << 24):
        return EOS_ID
    if byte_rate > 0 and ((h >> 24) & 0xFFFF) < byte_rate * (1 << 16):
        return FIRST_BYTE_ID + BYTE_TOKENS[(h >> 8) % len(BYTE_TOKENS)]
    return FIRST_WORD_ID + (h & 0xFFFFFF) % len(WORDS)


def chat_prompt_ids(messages: Sequence[tuple[str, str]], *, add_generation_prompt: bool,
                    continue_final_message: bool) -> tuple[list[int], str]:
    """Prompt ids of a chat, and ``""`` (the piece to heal: never one, a real tokenizer heals
    nothing; the pair is kept for the callers).

    Args:
        messages: ``(role, content text)`` pairs, roles from :data:`ROLE_IDS`.
        add_generation_prompt: append the assistant header (a new assistant turn).
        continue_final_message: leave the final message open (no END) so it is continued.

    Raises:
        ValueError: a role outside :data:`ROLE_IDS`.
    """
    ids = [BOS_ID]
    last = len(messages) - 1
    for i, (role, content) in enumerate(messages):
        if role not in ROLE_IDS:
            raise ValueError(f"messages[{i}].role: unknown role {role!r}")
        ids.append(ROLE_IDS[role])
        ids.extend(tokenize(content))
        if not (i == last and continue_final_message):
            ids.append(END_ID)
    if add_generation_prompt:
        ids.append(ROLE_IDS["assistant"])
    return ids, ""


@dataclass
class StepOut:
    """One decoding step: the token, the text released by it, and the finish if it ended."""

    token_id: int
    text: str
    finish_reason: str | None = None  # "stop" (EOS or a stop string) or "length"
    stop_reason: str | int | None = None  # the matched stop string; None for EOS or length


@dataclass
class Decoder:
    """Greedy decoding of one sequence with vLLM's stopping and streaming-text rules.

    - ``min_tokens``: EOS is masked and stop strings are not checked until more than
      ``min_tokens`` tokens were generated.
    - ``stop``: the output text is cut before the first stop string found in the new text
      (kept with ``include_stop_str_in_output``); ``finish_reason`` "stop", ``stop_reason`` the
      string. While not finished, the last ``max(len(stop)) - 1`` characters are held back
      (vLLM's stop buffer), so token ids run ahead of the text.
    - ``max_tokens``: finish "length" after that many tokens. EOS: finish "stop", its text "".
    - text is decoded incrementally from the tokens' bytes (:func:`detokenize`): a token that
      leaves a character incomplete adds no text yet (its id runs ahead too).
    - ``byte_rate``: see :func:`next_token`. ``heal``: ignored (kept for the callers).
    """

    prompt_ids: list[int]
    max_tokens: int
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    eos_rate: float = 0.0
    heal: str = ""
    byte_rate: float = 0.0
    ids: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of ``text`` already released
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def __post_init__(self) -> None:
        self._state = context_state(self.prompt_ids)
        self._utf8 = _Detok()
        self._holdback = (max((len(s) for s in self.stop), default=1) - 1
                          if self.stop and not self.include_stop_str_in_output else 0)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def step(self) -> StepOut:
        """Generate one token. Raises RuntimeError when already finished."""
        if self.finished:
            raise RuntimeError("decoder already finished")
        allow_eos = not self.ignore_eos and len(self.ids) >= self.min_tokens
        tid = next_token(self._state, eos_rate=self.eos_rate, allow_eos=allow_eos,
                         byte_rate=self.byte_rate)
        self._state = advance(self._state, tid)
        self.ids.append(tid)
        piece = self._utf8.feed(token_bytes(tid))
        old_len = len(self.text)
        self.text += piece
        if tid == EOS_ID and allow_eos:
            self.finish_reason = "stop"
        elif self.stop and len(self.ids) > self.min_tokens:
            for s in self.stop:
                idx = self.text.find(s, max(0, old_len - len(s) + 1))
                if idx >= 0:
                    self.text = self.text[:idx + (len(s) if self.include_stop_str_in_output else 0)]
                    self.finish_reason, self.stop_reason = "stop", s
                    break
        if not self.finished and len(self.ids) >= self.max_tokens:
            self.finish_reason = "length"
        limit = len(self.text) if self.finished else len(self.text) - self._holdback
        out = self.text[self.sent:limit] if limit > self.sent else ""
        self.sent = max(self.sent, limit)
        return StepOut(tid, out, self.finish_reason, self.stop_reason)
