"""Request validation of the simulated engine: an OpenAI/vLLM request body to a :class:`Job`.

Pure code, no I/O. Errors are :class:`BadRequest` worded like vLLM 0.32's (fixtures
``tests/fixtures/vllm-0.32.0-cpu/08*``, ``09*``): the HTTP layer answers them as JSON
``{"error": {"message", "type", "param", "code"}}`` before any streaming starts.

Fields read (anything else is accepted and ignored, like vLLM's extra fields):

- completions: ``prompt`` (a string, a list of token ids, or a batch: a list of strings or of
  id lists), ``echo`` (ignored).
- chat: ``messages`` (``role`` + ``content`` string or list of ``{"type": "text", "text"}``),
  ``add_generation_prompt`` (default true), ``continue_final_message`` (default false; the last
  message must be the assistant's; vLLM and SGLang use this name).
- both: ``model``, ``max_tokens`` (chat also ``max_completion_tokens``), ``min_tokens``,
  ``stop`` (string or list), ``include_stop_str_in_output``, ``ignore_eos``, ``n``, ``stream``,
  ``stream_options.include_usage``, ``return_token_ids``, ``temperature`` (validated, ignored:
  decoding is greedy), ``cache_salt``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, overload

from node_probe.sim import model

__all__ = ["BadRequest", "Job", "parse_job"]


class BadRequest(Exception):
    """A request rejected before the engine sees it (answered as a vLLM-style JSON error)."""

    def __init__(self, message: str, param: str | None, *, type_: str = "BadRequestError",
                 status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.type = type_
        self.status = status


@dataclass
class Job:
    """A validated inference request.

    ``prompts`` holds ``(prompt ids, partial piece to heal)`` per prompt (one for chat);
    choices are ``n`` per prompt, indexed ``prompt_index * n + j`` like vLLM's.
    """

    chat: bool
    stream: bool
    max_tokens: int
    prompts: list[tuple[list[int], str]]
    include_usage: bool = False
    return_token_ids: bool = False
    n: int = 1
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens counted once per prompt (not per choice), as vLLM's usage does."""
        return sum(len(ids) for ids, _ in self.prompts)


def pydantic_style(kind: str, loc: str, msg: str, input_repr: str) -> BadRequest:
    """A 400 worded like vLLM's FastAPI/pydantic validation errors (fixtures 08a, 08b, 08e)."""
    text = (f"1 validation error:\n  {{'type': '{kind}', 'loc': '{loc}', 'msg': '{msg}', "
            f"'input': '{input_repr}'}}")
    return BadRequest(text, loc, type_="Bad Request")


def _param_error(name: str, msg: str, value: Any) -> BadRequest:
    return BadRequest(f"{msg} (parameter={name}, value={value})", name)


@overload
def _int_field(body: dict[str, Any], name: str, default: int) -> int: ...
@overload
def _int_field(body: dict[str, Any], name: str, default: None) -> int | None: ...
def _int_field(body: dict[str, Any], name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise pydantic_style("int_parsing", f"body.{name}", "Input should be a valid integer",
                             str(value))
    return value


def _bool_field(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise pydantic_style("bool_parsing", f"body.{name}", "Input should be a valid boolean",
                             str(value))
    return value


def _token_ids(ids: list[Any], param: str) -> list[int]:
    for tid in ids:
        if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < model.VOCAB_SIZE:
            raise BadRequest(f"Token id {tid} is out of vocabulary (parameter={param})", param)
    return list(ids)


def _completion_prompts(body: dict[str, Any]) -> list[tuple[list[int], str]]:
    prompt = body.get("prompt")
    empty = BadRequest("Either prompt or prompt_embeds must be provided and non-empty. "
                       "(parameter=prompt)", "prompt")
    if isinstance(prompt, str):
        prompt = [prompt]
    elif isinstance(prompt, list) and prompt and all(
            isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise empty
    out = []
    for p in prompt:
        if isinstance(p, str) and p:
            out.append((model.tokenize(p), ""))
        elif isinstance(p, list) and p:
            out.append((_token_ids(p, "prompt"), ""))
        else:
            raise empty
    return out


def _content_text(content: Any, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or not isinstance(part.get("text", ""), str):
                raise BadRequest(f"messages[{i}].content parts must be objects with a text "
                                 "string.", "messages")
            parts.append(part.get("text", ""))
        return "".join(parts)
    raise BadRequest(f"messages[{i}].content must be a string or a list of parts.", "messages")


def _chat_prompt(body: dict[str, Any]) -> tuple[list[int], str]:
    messages = body.get("messages")
    if messages is None:
        raise pydantic_style("missing", "body.messages", "Field required", "<body>")
    if not isinstance(messages, list) or not messages or \
            not all(isinstance(m, dict) and "role" in m for m in messages):
        raise BadRequest("messages must be a non-empty list of objects with a role.", "messages")
    add_gen = _bool_field(body, "add_generation_prompt", True)
    cont = _bool_field(body, "continue_final_message", False)
    if add_gen and cont:
        raise BadRequest("Cannot set both `continue_final_message` and "
                         "`add_generation_prompt` to True.", "continue_final_message")
    if cont and messages[-1].get("role") != "assistant":
        raise BadRequest("continue_final_message requires the last message to be the "
                         "assistant's.", "continue_final_message")
    pairs = [(str(m["role"]), _content_text(m.get("content"), i))
             for i, m in enumerate(messages)]
    try:
        return model.chat_prompt_ids(pairs, add_generation_prompt=add_gen,
                                     continue_final_message=cont)
    except ValueError as exc:
        raise BadRequest(f"{exc}.", "messages") from None


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop must be a non-empty string or a list of non-empty strings. "
                         "(parameter=stop)", "stop")
    return tuple(stop)


def parse_job(raw: bytes, chat: bool, *, served_model: str, default_max_tokens: int,
              max_model_len: int) -> Job:
    """Validate one request body.

    Raises:
        BadRequest: the first problem found, naming the field (``param``).
    """
    if not raw.strip():
        raise pydantic_style("missing", "body", "Field required", "None")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        pos = getattr(exc, "pos", 0)
        text = (f"1 validation error:\n  {{'type': 'json_invalid', 'loc': 'body.{pos}', "
                f"'msg': 'JSON decode error', 'input': '<dict of 0 items>', "
                f"'ctx': {{'error': '{getattr(exc, 'msg', 'invalid')}'}}}}")
        raise BadRequest(text, f"body.{pos}", type_="Bad Request") from None
    if not isinstance(body, dict):
        raise pydantic_style("model_attributes_type", "body",
                             "Input should be a valid dictionary or object", type(body).__name__)

    name = body.get("model")
    if name is not None and name != served_model:
        raise BadRequest(f"The model `{name}` does not exist.", "model",
                         type_="NotFoundError", status=404)
    prompts = [_chat_prompt(body)] if chat else _completion_prompts(body)

    max_tokens = _int_field(body, "max_tokens", None)
    if chat and max_tokens is None:
        max_tokens = _int_field(body, "max_completion_tokens", None)
    if max_tokens is None:
        max_tokens = default_max_tokens
    if max_tokens < 1:
        raise _param_error("max_tokens", f"max_tokens must be at least 1, got {max_tokens}.",
                           max_tokens)
    if max_tokens > max_model_len:
        raise _param_error("max_tokens", f"max_tokens={max_tokens} cannot be greater than "
                           f"max_model_len={max_model_len}. Please request fewer output tokens.",
                           max_tokens)
    longest = max(len(ids) for ids, _ in prompts)
    if longest >= max_model_len:
        raise _param_error("input_tokens", f"This model's maximum context length is "
                           f"{max_model_len} tokens. However, your prompt contains at least "
                           f"{longest} input tokens, which exceeds this limit even without any "
                           "output tokens. Please reduce the length of the input prompt.",
                           longest)
    min_tokens = _int_field(body, "min_tokens", 0)
    if min_tokens < 0 or min_tokens > max_tokens:
        raise _param_error("min_tokens", f"min_tokens must be in 0..max_tokens ({max_tokens}), "
                           f"got {min_tokens}.", min_tokens)
    n = _int_field(body, "n", 1)
    if n < 1:
        raise _param_error("n", f"n must be at least 1, got {n}.", n)

    temperature = body.get("temperature")
    if temperature is not None:
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
            raise pydantic_style("float_parsing", "body.temperature",
                                 "Input should be a valid number", str(temperature))
        if temperature < 0:
            raise _param_error("temperature", f"temperature must be non-negative, got "
                               f"{float(temperature)}.", float(temperature))
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise BadRequest("Parameter 'cache_salt' must be a non-empty string if provided. "
                         "(parameter=cache_salt)", "cache_salt")
    opts = body.get("stream_options")
    return Job(chat=chat, stream=_bool_field(body, "stream", False), max_tokens=max_tokens,
               prompts=prompts,
               include_usage=isinstance(opts, dict) and opts.get("include_usage") is True,
               return_token_ids=_bool_field(body, "return_token_ids", False), n=n,
               min_tokens=min_tokens, stop=_stop(body),
               ignore_eos=_bool_field(body, "ignore_eos", False),
               include_stop_str_in_output=_bool_field(body, "include_stop_str_in_output", False))
