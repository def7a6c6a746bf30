"""OpenAI request bodies as pydantic models: every field typed, nothing ignored.

Types and names are this layer's; the ranges of the sampling fields (temperature, top_p, n,
max_tokens, logprobs, stop, ...) and their messages are :class:`SamplingParams`' — a request maps
onto it (``_sampling_params``) and its refusal comes back as a 400 under the request's own name for
the field (chat's ``top_logprobs`` for ``SamplingParams.logprobs``).

A field the server does not know is a 400 naming it, as OpenAI answers ("Unrecognized request
argument supplied", ``code: unknown_parameter``); so is a known one it cannot honour (``audio``,
``suffix``, ...). Fields that change nothing here (``user``, ``prompt_cache_key``,
``service_tier``, ...), no-op values clients send by default, and explicit ``null`` for any
optional field are accepted. Every refusal is an :class:`APIError` whose ``param`` is the field's
path (``messages[2].content``) taken from where the check failed — never parsed out of a message.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from slipstream.server import chat_template
from slipstream.server.api.errors import APIError, bad_request, refusal
from slipstream.server.api.tools import check_tools
from slipstream.server.engine.errors import InvalidRequest
from slipstream.server.engine.sampling_params import SamplingParams, StructuredOutputsParams

_TOKEN_ID = re.compile(r"-?[0-9]{1,10}")  # ASCII digits: str.isdigit() also takes "²" and "٣"


class _Strict(BaseModel):
    """JSON as sent: no coercion ("2" is not 2, true is not 1), no NaN, no unknown keys."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool | None = None  # a last, usage-only chunk
    continuous_usage_stats: bool | None = None  # usage so far on every chunk with choices (vLLM)


class JsonSchemaFormat(_Strict):
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs`` (exactly one constraint)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ToolCallFunction(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it back


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None  # a string or an array of text parts; checked with its index in the request
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    reasoning_content: str | None = None  # sent back by clients of reasoning models; not templated


class _GenerationRequest(_Strict):
    """The fields both generation endpoints share; :attr:`params` holds them as SamplingParams."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int | None = None
    best_of: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    # Fast tokenizers (all this server loads) always join special tokens without spaces; vLLM's
    # knob changes only slow ones, so it is accepted and has nothing to change here.
    spaces_between_special_tokens: bool | None = None
    prompt_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's older names for structured_outputs
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's: the order within a tenant under --scheduling-policy fair or priority (lower sooner).
    priority: int = 0
    # Accepted, type-checked, and otherwise ignored: they do not change the output here.
    user: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None

    _params: SamplingParams = PrivateAttr()
    _constraint_param: str | None = PrivateAttr(None)

    @property
    def params(self) -> SamplingParams:
        return self._params

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def _check_common(self) -> None:
        if self.stream_options is not None and not self.stream:  # as OpenAI and vLLM
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        n = self.n or 1
        if self.best_of is not None and self.best_of != n:
            raise bad_request(f"best_of ({self.best_of}) different from n ({n}) is not supported; omit best_of",
                              "best_of")

    def _sampling_params(self, *, max_tokens: int | None, logprobs: int | None,
                         structured: StructuredOutputsParams | None,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        try:
            return SamplingParams(
                n=1 if self.n is None else self.n, temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
                min_p=self.min_p or 0.0, seed=self.seed, presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                max_tokens=max_tokens, min_tokens=0 if self.min_tokens is None else self.min_tokens,
                stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
                stop_token_ids=list(self.stop_token_ids or []), ignore_eos=bool(self.ignore_eos),
                logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens is not False,
                include_stop_str_in_output=bool(self.include_stop_str_in_output),
                logit_bias=_logit_bias(self.logit_bias), structured_outputs=structured)
        except InvalidRequest as exc:  # SamplingParams' checks name their field; reported under ours
            raise refusal(exc, self.request_param(exc.param)) from None

    def request_param(self, param: str | None) -> str | None:
        """The request field a :class:`SamplingParams` field came from (the same name unless an
        endpoint renames it)."""
        return param

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one output constraint asked for, from whichever field carries it (400 for two)."""
        given: list[tuple[str, StructuredOutputsParams]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            given.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise bad_request("response_format of type json_schema needs a json_schema object",
                                  "response_format.json_schema")
            schema = rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {}
            given.append(("response_format", StructuredOutputsParams(json=schema)))
        if self.structured_outputs is not None:
            so = self.structured_outputs
            try:
                given.append(("structured_outputs", StructuredOutputsParams(
                    json=so.json_, json_object=bool(so.json_object), regex=so.regex, choice=so.choice,
                    grammar=so.grammar)))
            except InvalidRequest as exc:
                raise bad_request(str(exc), exc.param, exc.code) from None
        for name, kwargs in (("guided_json", {"json": self.guided_json}), ("guided_regex", {"regex": self.guided_regex}),
                             ("guided_choice", {"choice": self.guided_choice}),
                             ("guided_grammar", {"grammar": self.guided_grammar})):
            if next(iter(kwargs.values())) is not None:
                try:
                    given.append((name, StructuredOutputsParams(**kwargs)))
                except InvalidRequest as exc:
                    raise bad_request(str(exc).replace("structured_outputs", name), name, exc.code) from None
        if len(given) > 1:
            raise bad_request(f"{given[0][0]} and {given[1][0]} both constrain the output; send one",
                              given[1][0])
        self._constraint_param = given[0][0] if given else None
        return given[0][1] if given else None

    def engine_param(self, param: str | None) -> str | None:
        """The request field behind an engine refusal's ``param``: a constraint the grammar library
        refused is reported under the field that carried it (``response_format``, ``guided_regex``)."""
        if param and param.startswith("structured_outputs") and self._constraint_param:
            return self._constraint_param
        return self.request_param(param)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``{"<token id>": bias}`` as ``{token_id: bias}``; the values' range is SamplingParams'
    and the ids are checked against the vocabulary by the engine."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        if not _TOKEN_ID.fullmatch(key):
            raise bad_request(f"logit_bias keys must be token ids, got {key!r:.40}", "logit_bias")
        out[int(key)] = float(value)
    return out


# Known to OpenAI, refused here unless absent or a no-op value.
_UNSUPPORTED = ("audio", "prediction", "reasoning_effort", "web_search_options")


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``. ``max_tokens`` defaults to the rest of the context."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "function": {"name"}}
    parallel_tool_calls: bool | None = None
    functions: Any = None  # deprecated by OpenAI in favour of tools
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the chat template (vLLM)
    add_generation_prompt: bool | None = None  # default true: open the assistant's turn
    continue_final_message: bool | None = None  # continue the last (assistant) message instead

    def model_post_init(self, _context: Any) -> None:
        self._check_common()
        if not self.messages:
            raise bad_request("messages must be a non-empty array of {role, content}", "messages")
        for i, message in enumerate(self.messages):
            _check_message(message, f"messages[{i}]")
        for name in _UNSUPPORTED:
            if getattr(self, name) not in (None, ""):
                raise bad_request(f"{name} is not supported by this server; omit it", name)
        if self.modalities is not None and self.modalities != ["text"]:
            raise bad_request("modalities other than [\"text\"] are not supported", "modalities")
        for name in ("functions", "function_call"):
            if getattr(self, name) not in (None, [], "none", "auto"):
                raise bad_request(f"{name} is deprecated by OpenAI and not supported; use tools and tool_choice",
                                  name)
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                              "continue_final_message")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise bad_request("continue_final_message needs the last message to be the assistant's",
                              "continue_final_message")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
        if self.prompt_logprobs is not None:
            raise bad_request("prompt_logprobs is served by /v1/completions; send the rendered prompt there",
                              "prompt_logprobs")
        given = {k: v for k, v in (("max_completion_tokens", self.max_completion_tokens),
                                   ("max_tokens", self.max_tokens)) if v is not None}
        if len(set(given.values())) > 1:
            raise bad_request(f"max_completion_tokens and max_tokens disagree ({', '.join(map(str, given.values()))}); "
                              "send one", "max_completion_tokens")
        self._check_tools()
        max_tokens = next(iter(given.values()), None)
        self._params = self._sampling_params(max_tokens=max_tokens, logprobs=self.logprob_width,
                                             structured=self.structured_outputs_params())

    def _check_tools(self) -> None:
        choice = self.tool_choice
        shaped = choice in (None, "none", "auto", "required") or (
            isinstance(choice, dict) and set(choice) == {"type", "function"} and choice["type"] == "function"
            and isinstance(choice["function"], dict) and set(choice["function"]) == {"name"}
            and isinstance(choice["function"]["name"], str))
        if not shaped:
            raise bad_request('tool_choice must be "none", "auto", "required" or '
                              '{"type": "function", "function": {"name": ...}}', "tool_choice")
        error = check_tools(self.tool_dicts(), choice)
        if error is not None:
            raise bad_request(str(error), error.param, error.code)

    def tool_dicts(self) -> list[dict] | None:
        return tool_dicts(self.tools)

    @property
    def forced_tool(self) -> str | None | bool:
        """What ``tool_choice`` forces: a function's name, True for ``required``, None when the model chooses."""
        choice = self.tool_choice
        if choice == "required":
            return True
        if isinstance(choice, dict):
            return choice["function"]["name"]
        return None

    def request_param(self, param: str | None) -> str | None:
        """Chat's names: ``top_logprobs`` is the width of ``logprobs``; ``max_tokens`` is whichever
        of ``max_completion_tokens`` and ``max_tokens`` was sent."""
        if param == "logprobs":
            return "top_logprobs"
        if param == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return param

    @property
    def logprob_width(self) -> int | None:
        """Top-N per generated token, or None without ``logprobs``."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def tool_choice_value(self) -> str | dict:
        """``tool_choice`` with OpenAI's default: ``auto`` when tools are given, else ``none``."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def template_messages(self) -> list[dict[str, Any]]:
        return template_messages(self.messages)


def tool_dicts(tools: list[Tool] | None) -> list[dict] | None:
    """``tools`` as OpenAI sends them (plain dicts), or None."""
    return [t.model_dump(by_alias=True, exclude_none=True) for t in tools] if tools else None


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The conversation as plain dicts for a chat template, by the one function the gateway renders
    with too (:func:`chat_template.template_messages`): ``developer`` read as ``system``, text parts
    joined as one string, tool calls and tool results kept as OpenAI sends them."""
    return chat_template.template_messages([m.model_dump(exclude_none=True) for m in messages])


def _check_message(message: ChatMessage, where: str) -> None:
    content = message.content
    if content is None and not (message.role == "assistant"):
        raise bad_request(f"{where}.content is required", f"{where}.content")
    if content is not None and not isinstance(content, (str, list)):
        raise bad_request(f"{where}.content must be a string or an array of text parts", f"{where}.content")
    for j, part in enumerate(content if isinstance(content, list) else []):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"{where}.content[{j}] of type {kind!r:.40} is not supported; only text parts are",
                              f"{where}.content[{j}].type")
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.content[{j}].text must be a string", f"{where}.content[{j}].text")
    if message.role == "tool" and message.tool_call_id is None:
        raise bad_request(f"{where}.tool_call_id is required for a tool message", f"{where}.tool_call_id")
    if message.tool_calls and message.role != "assistant":
        raise bad_request(f"{where}.tool_calls is only allowed on assistant messages", f"{where}.tool_calls")


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions`` (OpenAI's legacy API). ``max_tokens`` defaults to 16, as OpenAI's."""

    prompt: Any = None  # a string, strings, token ids or arrays of token ids; see :attr:`prompts`
    logprobs: int | None = None
    echo: bool | None = None  # the prompt's text (and its logprobs) before the completion
    suffix: str | None = None

    _prompts: list[str | list[int]] = PrivateAttr()
    _prompt_only: bool = PrivateAttr(False)

    def model_post_init(self, _context: Any) -> None:
        self._check_common()
        if self.suffix:
            raise bad_request("suffix (insertion) is not supported by this server; omit it", "suffix")
        self._prompts = _prompts(self.prompt)
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:  # echo's prompt entries need the prompt's logprobs
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs)
        max_tokens = 16 if self.max_tokens is None else self.max_tokens
        # echo with max_tokens 0 scores the prompt (lm-eval's loglikelihood, as vLLM serves it): the
        # engine runs one step, whose token is left out of the answer and the usage
        self._prompt_only = bool(self.echo) and max_tokens == 0
        if self._prompt_only and self.min_tokens:
            raise bad_request(f"min_tokens ({self.min_tokens}) must not exceed max_tokens (0)", "min_tokens")
        self._params = self._sampling_params(
            max_tokens=1 if self._prompt_only else max_tokens, logprobs=self.logprobs,
            structured=self.structured_outputs_params(), prompt_logprobs=prompt_logprobs)

    @property
    def prompt_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: the answer is the prompt (and its logprobs) alone."""
        return self._prompt_only

    @property
    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        return self._prompts


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompts(prompt: Any) -> list[str | list[int]]:
    if prompt is None:
        raise bad_request("prompt is required: a string, an array of strings, or token ids", "prompt")
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif _is_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(_is_ids(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise bad_request("prompt must be a non-empty string, array of strings, array of token ids, "
                          "or array of arrays of token ids", "prompt")
    if any(p == "" for p in prompts):
        raise bad_request("prompt must not be empty", "prompt")
    return prompts


class TokenizeRequest(_Strict):
    """``POST /tokenize`` (vLLM): a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # prompt: default true; messages: the template decides
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool | None = None

    def model_post_init(self, _context: Any) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("send exactly one of prompt and messages", "prompt")
        for i, message in enumerate(self.messages or []):
            _check_message(message, f"messages[{i}]")

    def template_messages(self) -> list[dict[str, Any]]:
        return template_messages(self.messages or [])

    def tool_dicts(self) -> list[dict] | None:
        return tool_dicts(self.tools)


class DetokenizeRequest(_Strict):
    """``POST /detokenize`` (vLLM)."""

    model: str | None = None
    tokens: list[int]


Request = TypeVar("Request", bound=BaseModel)


def validate(model: type[Request], body: Any) -> Request:
    """``body`` (parsed JSON) as a ``model``. Raises :class:`APIError` 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _from_validation_error(exc.errors()[0]) from None


_SCALAR_TYPES = {"int_type", "string_type", "float_type", "bool_type", "finite_number"}


def _param(loc: tuple, error_type: str) -> str:
    """pydantic's error location as the request path OpenAI names (``messages[0].content``); a bad
    element of a list of scalars names the list."""
    loc = tuple(part for part in loc if not _is_union_tag(part))
    if loc and isinstance(loc[-1], int) and error_type in _SCALAR_TYPES:
        loc = loc[:-1]
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def _is_union_tag(part: Any) -> bool:
    """pydantic names the member of a union it tried (``str``, ``list[int]``, ``dict[str,any]``)."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


def _from_validation_error(error: dict) -> APIError:
    param = _param(tuple(error["loc"]), error["type"])
    if error["type"] == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param, "unknown_parameter")
    got = error.get("input")
    shown = f", got {got!r:.60}" if not isinstance(got, (dict, list)) or len(repr(got)) < 60 else ""
    if error["type"] == "missing":
        return bad_request(f"{param} is required", param, "missing_required_parameter")
    msg = error["msg"][:1].lower() + error["msg"][1:]
    if not param:  # a check of the whole request, not of one field
        return bad_request(f"Invalid request: {msg}")
    return bad_request(f"Invalid value for {param}: {msg}{shown}", param)


def parse_chat_request(body: Any) -> ChatCompletionRequest:
    """Validate a ``POST /v1/chat/completions`` body. Raises :class:`APIError` (400) naming the field."""
    return validate(ChatCompletionRequest, body)


def parse_completion_request(body: Any) -> CompletionRequest:
    """Validate a ``POST /v1/completions`` body. Raises :class:`APIError` (400) naming the field.
    Token ids are checked against the vocabulary by the engine (``LLMEngine.check_token_ids``)."""
    return validate(CompletionRequest, body)


def check_model(requested: str | None, served: Sequence[str]) -> None:
    """404 ``model_not_found`` unless ``requested`` is absent or one of the ``served`` names."""
    if requested is not None and requested not in served:
        names = ", ".join(f"`{name}`" for name in served)
        raise APIError(404, f"The model `{requested}` does not exist. This server serves {names} "
                       "(see GET /v1/models).", param="model", code="model_not_found")
