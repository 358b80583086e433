"""OpenAI request and response shapes (pydantic). Requests are strict: a wrong type is an error, not a coercion.

Extra per-request fields beyond OpenAI's: `top_k`, `gamma` (drafted tokens per round, capped at the server's --gamma),
`ignore_eos`.
"""
from __future__ import annotations

import math
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from selfspec.speculative.sampling import MIN_TEMPERATURE, MIN_TOP_P, SEED_RANGE, SamplingParams

# OpenAI parameters selfspec does not implement, accepted only at their no-op values (clients often send
# them explicitly); anything else unknown is refused by name, as OpenAI itself does.
NO_OP_PARAMS: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0,), "presence_penalty": (0,), "logprobs": (None, False, 0), "top_logprobs": (None, 0),
    "echo": (None, False), "best_of": (None, 1), "logit_bias": (None, {}), "suffix": (None, ""),
    "tools": (None, []), "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}),
    "parallel_tool_calls": (None, False, True), "store": (None, False),
}
FREE_PARAMS = {"user"}  # accepted with any value: it only labels the request


def lone_surrogate_path(data: Any) -> str | None:
    """Where in parsed JSON a string (value or key) holds a lone UTF-16 surrogate (JSON allows `"\\ud800"`,
    UTF-8 and the tokenizer do not), as a dotted path; None if nowhere. Iterative: nesting depth is the client's."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str) and not is_utf8(value):
            return path or "<body>"
        if isinstance(value, dict):
            for key, item in value.items():
                if not is_utf8(key):
                    return f"{path or '<body>'} (a key)"
                stack.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):  # only what can hold text: a prompt of token ids is a long list of ints
            stack.extend((f"{path}.{i}" if path else str(i), item) for i, item in enumerate(value)
                         if isinstance(item, (str, list, dict)))
    return None


def is_utf8(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class StrictRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    @model_validator(mode="before")
    @classmethod
    def refuse_lone_surrogates(cls, data: Any) -> Any:
        path = lone_surrogate_path(data)
        if path is not None:
            raise ValueError(f"{path}: the text holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                             "escape), which is not valid Unicode; send well-formed text")
        return data

    @model_validator(mode="after")
    def refuse_unsupported(self) -> StrictRequest:
        for name, value in (self.model_extra or {}).items():
            if name in FREE_PARAMS:
                continue
            if name not in NO_OP_PARAMS:
                raise ValueError(f"unrecognized request argument supplied: {name}")
            if value not in NO_OP_PARAMS[name]:
                raise ValueError(f"'{name}' is not supported by selfspec (only {NO_OP_PARAMS[name]} is accepted)")
        return self


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False


class SamplingFields(StrictRequest):
    """Fields shared by completions and chat completions."""
    model: str
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    gamma: int | None = None
    ignore_eos: bool = False

    @field_validator("n")
    @classmethod
    def one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"n={n} is refused: selfspec returns exactly one choice per request (n=1); "
                             "send n separate requests (with different seeds) instead")
        return n

    @field_validator("temperature")
    @classmethod
    def usable_temperature(cls, temperature: float) -> float:
        if not math.isfinite(temperature) or 0 < temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}, got "
                             f"{temperature!r}")
        return temperature

    @field_validator("top_p")
    @classmethod
    def usable_top_p(cls, top_p: float) -> float:
        if not MIN_TOP_P <= top_p <= 1:  # also refuses NaN
            raise ValueError(f"top_p must be between {MIN_TOP_P:g} and 1, got {top_p!r}")
        return top_p

    @field_validator("seed")
    @classmethod
    def int64_seed(cls, seed: int | None) -> int | None:
        if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must be a signed 64-bit integer ({SEED_RANGE[0]}..{SEED_RANGE[1]}), got {seed}")
        return seed

    @field_validator("stop")
    @classmethod
    def non_empty_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stop

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """Raises SelfspecError for out-of-range values (negative temperature, top_p outside (0, 1], ...)."""
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed,
                              max_new_tokens=max_tokens, stop=self.stop_list(), ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: str | list[int]
    max_tokens: int | None = 16  # OpenAI's default for completions; None: the server's default (also 16)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @field_validator("prompt", mode="before")
    @classmethod
    def single_prompt(cls, prompt: Any) -> Any:
        # OpenAI also takes a batch (a list of prompts); accept a batch of one, refuse more.
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            if len(prompt) != 1:
                raise ValueError(f"a batch of {len(prompt)} prompts was sent; send one prompt per request")
            return prompt[0]
        return prompt

    @field_validator("prompt")
    @classmethod
    def non_empty_prompt(cls, prompt: str | list[int]) -> str | list[int]:
        if not (prompt.strip() if isinstance(prompt, str) else prompt):
            raise ValueError("the prompt is empty")
        return prompt


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def for_template(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: the server's default (up to 1024 tokens, within the context)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class Usage(BaseModel):
    """OpenAI's token counts plus this request's speculative decoding stats."""
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    draft_tokens: int  # tokens drafted (proposed) for this request
    accepted_tokens: int  # drafted tokens the verifier accepted
    mean_acceptance_length: float  # tokens committed per verify pass (1 + accepted / rounds)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer
    def set_fields_only(self) -> dict[str, str]:
        # OpenAI's last chunk carries an empty delta `{}`, not nulls
        return {k: v for k, v in (("role", self.role), ("content", self.content)) if v is not None}


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "selfspec"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
