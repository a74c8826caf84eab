"""The OpenAI API's request bodies (pydantic models, checked field by field) and what the server
makes of them: sampling parameters for the engine, response bodies, stream chunks and error
objects, in the shapes the official ``openai`` client parses."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from graphpar.errors import GenerationError
from graphpar.serving.outputs import CompletionOutput, RequestOutput
from graphpar.serving.sampling import MAX_TOP_LOGPROBS, SamplingParams

__all__ = ["ApiError", "ChatCompletionRequest", "CompletionRequest", "error_body"]


class ApiError(Exception):
    """An answer that is not a 200: its HTTP status and OpenAI's error object fields."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type, self.code, self.headers = type, code, headers


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """The fields completions and chat share: OpenAI's, then vLLM's extras."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras
    repetition_penalty: float | None = None
    top_k: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False

    def check_supported(self) -> None:
        """A 400 for an OpenAI option the engine does not implement (rather than ignore it)."""
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true",
                           "stream_options")

    def top_logprobs_asked(self) -> int:
        """How many most likely tokens to return at each position (the endpoint's field)."""
        return 0

    def prompt_logprobs_asked(self) -> int | None:
        """The prompt tokens' log-probabilities: None, or how many most likely at each."""
        return None

    def logit_bias_ids(self) -> dict[int, float]:
        """``logit_bias`` with its keys (token ids written as strings) as ints."""
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise ApiError(400, f"logit_bias keys are token ids (integers written as "
                                    f"strings), got {key!r}", "logit_bias") from None
        return bias

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(s == "" for s in stop):
            raise ApiError(400, "stop strings must not be empty", "stop")
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None or self.top_k == -1 else self.top_k,
            n=self.n, stop=tuple(stop), stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos, seed=self.seed, min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None
            else self.repetition_penalty,
            logit_bias=self.logit_bias_ids(), top_logprobs=self.top_logprobs_asked(),
            prompt_logprobs=self.prompt_logprobs_asked())
        try:
            params.validate()
        except GenerationError as exc:  # "top_p must be in (0, 1], got 2.0": name the field
            field = str(exc).split(" ", 1)[0]
            raise ApiError(400, str(exc), field if field in type(self).model_fields else None
                           ) from None
        return params

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: a prompt as text, texts, token ids or lists of token ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise ApiError(400, "suffix is not supported by this server", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise ApiError(400, "best_of is not supported by this server: leave it out (or "
                                "equal to n)", "best_of")
        if self.logprobs is not None and self.logprobs > MAX_TOP_LOGPROBS:
            raise ApiError(400, f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got "
                                f"{self.logprobs}", "logprobs")

    def top_logprobs_asked(self) -> int:
        return self.logprobs or 0

    def prompt_logprobs_asked(self) -> int | None:
        return self.logprobs if self.echo else None  # echo + logprobs: the prompt's too

    def prompt_texts(self, decode) -> list[str]:
        """Every prompt as text (what echo prepends): the text given, or its ids decoded."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, int) for p in prompt):
            return [decode(list(prompt))]
        return [decode(list(p)) for p in prompt]

    def prompts(self, encode) -> list[list[int]]:
        """Every prompt as token ids (one engine request each)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            prompts = [encode(prompt)]
        elif prompt and all(isinstance(p, str) for p in prompt):
            prompts = [encode(p) for p in prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [list(prompt)]
        else:
            prompts = [list(p) for p in prompt]
        if not prompts or any(not p for p in prompts):
            raise ApiError(400, "the prompt is empty: give at least one token", "prompt")
        return prompts


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``: messages, through the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if self.top_logprobs is not None and self.top_logprobs > MAX_TOP_LOGPROBS:
            raise ApiError(400, f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got "
                                f"{self.top_logprobs}", "top_logprobs")

    def top_logprobs_asked(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


# --- responses ------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(outputs: list[RequestOutput]) -> dict[str, Any]:
    """Token counts of a response: each prompt once, every completion's tokens."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens
                                                           for o in outputs)}}


Tops = list[list[tuple[int, float]]] | None  # per token, the most likely (id, logprob)


def completion_logprobs(token_ids: list[int], logprobs: list[float], decode,
                        text_offset: int = 0, tops: Tops = None) -> dict[str, Any]:
    """The completions API's logprobs object for these tokens: each token's own logprob and,
    per position, a dict of the most likely tokens (``tops``) and the chosen one, as OpenAI
    (up to logprobs + 1 entries)."""
    tokens = [decode([t]) for t in token_ids]
    offsets, at = [], text_offset
    for token in tokens:
        offsets.append(at)
        at += len(token)
    top_dicts: list[dict[str, float] | None] = []
    for i, (token, logprob) in enumerate(zip(tokens, logprobs)):
        if logprob is None:  # an echoed prompt's first token: nothing comes before it
            top_dicts.append(None)
            continue
        best = {decode([t]): lp for t, lp in tops[i]} if tops else {}
        best.setdefault(token, logprob)
        top_dicts.append(best)
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": top_dicts,
            "text_offset": offsets}


def echo_logprobs(out: RequestOutput, c: CompletionOutput, decode, new_from: int = 0
                  ) -> dict[str, Any]:
    """The completions logprobs object of an echoed choice: the prompt's tokens (the first
    without a logprob, as OpenAI), then the generated ones from ``new_from`` on."""
    prompt = out.prompt_token_ids
    scored = out.prompt_logprobs or [None] * len(prompt)
    tokens = c.token_ids[new_from:]
    tops = [[] for _ in tokens] if c.top_logprobs is None else c.top_logprobs[new_from:]
    return completion_logprobs(
        prompt + tokens, [None if e is None else e[0] for e in scored] + c.logprobs[new_from:],
        decode, 0, [[] if e is None else e[1] for e in scored] + tops)


def _chat_token(token_id: int, logprob: float, decode) -> dict[str, Any]:
    token = decode([token_id])
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(token_ids: list[int], logprobs: list[float], decode, tops: Tops = None
                  ) -> dict[str, Any]:
    """The chat API's logprobs object: each token, its logprob and its ``top_logprobs``."""
    content = []
    for i, (token_id, logprob) in enumerate(zip(token_ids, logprobs)):
        entry = _chat_token(token_id, logprob, decode)
        entry["top_logprobs"] = [_chat_token(t, lp, decode) for t, lp in tops[i]] \
            if tops else []
        content.append(entry)
    return {"content": content}


def completion_body(request_id: str, model: str, outputs: list[RequestOutput], n: int,
                    want_logprobs: bool, decode, echo: list[str] | None = None
                    ) -> dict[str, Any]:
    """``echo``: each prompt's text, put before its completions' text."""
    choices = []
    for i, out in enumerate(outputs):
        for c in out.outputs:
            choices.append({
                "index": i * n + c.index, "text": (echo[i] if echo else "") + (c.text or ""),
                "logprobs": None if not want_logprobs
                else echo_logprobs(out, c, decode) if echo
                else completion_logprobs(c.token_ids, c.logprobs, decode, tops=c.top_logprobs),
                "finish_reason": c.finish_reason})
    return {"id": request_id, "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": usage(outputs)}


def chat_body(request_id: str, model: str, out: RequestOutput, want_logprobs: bool,
              decode) -> dict[str, Any]:
    choices = [{"index": c.index,
                "message": {"role": "assistant", "content": c.text or ""},
                "logprobs": chat_logprobs(c.token_ids, c.logprobs, decode, c.top_logprobs)
                if want_logprobs else None,
                "finish_reason": c.finish_reason} for c in out.outputs]
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": usage([out])}
