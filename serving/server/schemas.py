"""The HTTP API's request and response bodies (pydantic), as documented at /docs.

Owns the shape and the static bounds of every field (a value out of bounds is a 422 naming the field and
the bound). Limits that come from the server's config (max_tokens, number of texts, ...) are checked in
serving/server/api.py, which also turns these into `TextRequest`s. OpenAI-compatible shapes follow the
`/v1/completions` API closely enough for the official `openai` client.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator


def _valid_unicode(value: str) -> str:
    """JSON may carry lone surrogates ("\\ud800"), which are not text: the tokenizer cannot encode them."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"contains a lone surrogate {value[e.start]!r} at character {e.start}, which is not "
                         f"valid Unicode text; send UTF-8 text") from None
    return value


Text = Annotated[str, AfterValidator(_valid_unicode)]
MAX_STOP_TOKEN_IDS = 16
# A token id is >= 0 here; the engine checks it against the model's vocabulary (a 422 naming stop_token_ids).
StopTokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)]
STOP_TOKEN_IDS_DOC = (f"Token ids that end the text (at most {MAX_STOP_TOKEN_IDS}, each in [0, vocabulary size)); "
                      "the stop token is not part of the text, and finish_reason is 'stop'.")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt field is an error, not silently ignored


class TranslateRequest(_Body):
    text: Text | list[Text] = Field(..., description="One source text or a list of them.")
    model: str | None = Field(None, description=(
        "Model name, or `name@version` to pin a version (GET /v1/models); default: the one translation model."))
    beam_size: int = Field(1, ge=1, le=8, description="Beam width; 1 = greedy.")
    max_tokens: int | None = Field(None, ge=1, description="Most tokens per translation.")
    n_best: int | None = Field(None, ge=1, le=8, description="Hypotheses returned per text (<= beam_size).")
    length_penalty: float = Field(1.0, ge=0.0, le=2.0, description=(
        "Beam search ranks hypotheses by log-probability / length ** length_penalty (length in tokens, the "
        "end token included): 0 = the plain sum, which favours short translations; 1 = per token; "
        "2 favours long ones. Only with beam_size > 1."))

    @model_validator(mode="after")
    def _n_best_within_beam(self) -> "TranslateRequest":
        if self.n_best is not None and self.n_best > self.beam_size:
            raise ValueError(f"n_best={self.n_best} exceeds beam_size={self.beam_size}; "
                             "ask for n_best <= beam_size")
        if isinstance(self.text, list) and not self.text:
            raise ValueError("text is an empty list; send at least one text")
        return self


class GenerateRequest(_Body):
    prompt: Text = Field(..., description="Text to continue.")
    model: str | None = Field(None, description=(
        "Model name, or `name@version` to pin a version (GET /v1/models); default: the one generation model."))
    max_tokens: int | None = Field(None, ge=1, description="Most tokens to generate.")
    temperature: float = Field(0.0, ge=0.0, le=5.0, description="0 = greedy.")
    top_k: int = Field(0, ge=0, le=100_000, description="Sample from the k most likely tokens; 0 = off.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass; 1 = off.")
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, description="> 1 discourages repeats; 1 = off.")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="Same seed, same text.")
    stop: Text | list[Text] | None = Field(None, description="Stop strings; the text ends before the first one.")
    stop_token_ids: StopTokenIds | None = Field(None, description=STOP_TOKEN_IDS_DOC)
    stream: bool = Field(False, description="Answer as Server-Sent Events, one per token.")
    ignore_eos: bool = Field(False, description="Benchmarks and tests: end-of-sequence does not end the text, "
                                                "which runs to max_tokens (as vLLM's ignore_eos).")


class CompletionRequest(_Body):
    """OpenAI /v1/completions. Unsupported OpenAI options are accepted only at their neutral value."""
    model: str
    prompt: Text | list[Text]
    max_tokens: int | None = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=1, description="Only 1 completion per prompt.")
    stream: bool = False
    stream_options: dict | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: StopTokenIds | None = Field(None, description=STOP_TOKEN_IDS_DOC + " As vLLM's.")
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    echo: Literal[False] = False
    logprobs: None = None
    best_of: int | None = Field(None, ge=1, le=1)
    suffix: None = None
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0)
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _check(self) -> "CompletionRequest":
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt is an empty list; send at least one prompt")
        if isinstance(self.prompt, list) and len(self.prompt) > 1 and self.stream:
            raise ValueError("stream=true takes a single prompt, got a list of several")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        return self


# -- responses ---------------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Timings(BaseModel):
    queue_s: float | None = Field(None, description="Waiting for a KV slot (engine).")
    ttft_s: float | None = Field(None, description="Until the first token (engine).")
    total_s: float = Field(..., description="Whole request, as seen by the server.")


class Hypothesis(BaseModel):
    text: str
    score: float


class Translation(BaseModel):
    text: str
    n_best: list[Hypothesis] | None = None
    finish_reason: str


class TranslateResponse(BaseModel):
    model: str
    translations: list[Translation]
    usage: Usage
    timings: Timings


class GenerateResponse(BaseModel):
    model: str
    text: str
    finish_reason: str
    usage: Usage
    timings: Timings


class ErrorDetail(BaseModel):
    type: str
    message: str
    field: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
