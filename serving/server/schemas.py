"""The HTTP API's request and response bodies (pydantic), as documented at /docs.

Owns the shape and the static bounds of every field (a value out of bounds is a 422 naming the field and
the bound). Limits that come from the server's config (max_tokens, number of texts, ...) are checked in
serving/server/api.py, which also turns these into `TextRequest`s. OpenAI-compatible shapes follow the
`/v1/completions` API closely enough for the official `openai` client.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator


def _valid_unicode(value: str) -> str:
    """JSON may carry lone surrogates ("\\ud800"), which are not text: the tokenizer cannot encode them."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"contains a lone surrogate {value[e.start]!r} at character {e.start}, which is not "
            f"valid Unicode text; send UTF-8 text"
        ) from None
    return value


Text = Annotated[str, AfterValidator(_valid_unicode)]
MAX_STOP_TOKEN_IDS = 16
MAX_SEQUENCES = 16  # n and best_of per prompt (the server's max_texts bounds their product with the prompts)
MAX_LOGPROBS = 5  # OpenAI's bound on the completions API's logprobs
# A token id is >= 0 here; the engine checks it against the model's vocabulary (a 422 naming stop_token_ids).
StopTokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)]
STOP_TOKEN_IDS_DOC = (
    f"Token ids that end the text (at most {MAX_STOP_TOKEN_IDS}, each in [0, vocabulary size)); "
    "the stop token is not part of the text, and finish_reason is 'stop'."
)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt field is an error, not silently ignored


PRIORITY_DOC = (
    "Lower is served first (vLLM's convention): waiting requests are admitted by priority, then arrival; "
    "above 0 (bulk work) a request may take only half of the waiting queue, so under overload its 429 "
    "comes first."
)


class TranslateRequest(_Body):
    text: Text | list[Text] = Field(..., description="One source text or a list of them.")
    priority: int = Field(0, ge=-1000, le=1000, description=PRIORITY_DOC)
    model: str | None = Field(
        None,
        description=(
            "Model name, or `name@version` to pin a version (GET /v1/models); default: the one translation model."
        ),
    )
    beam_size: int = Field(1, ge=1, le=8, description="Beam width; 1 = greedy.")
    max_tokens: int | None = Field(None, ge=1, description="Most tokens per translation.")
    n_best: int | None = Field(None, ge=1, le=8, description="Hypotheses returned per text (<= beam_size).")
    length_penalty: float = Field(
        1.0,
        ge=0.0,
        le=2.0,
        description=(
            "Beam search ranks hypotheses by log-probability / length ** length_penalty (length in tokens, the "
            "end token included): 0 = the plain sum, which favours short translations; 1 = per token; "
            "2 favours long ones. Only with beam_size > 1."
        ),
    )
    target_prefix: Text | list[Text] | None = Field(
        None,
        description=(
            "A start each translation must continue (one per text), kept verbatim: the model translates the rest."
        ),
    )
    return_scores: bool = Field(
        False,
        description=(
            "Each translation's log-probability (`score`, its end token included) and each token's (`token_scores`), "
            "as CTranslate2's return_scores. Greedy decoding (beam_size 1)."
        ),
    )
    min_tokens: int = Field(0, ge=0, description="The end token is held back until this many tokens.")
    no_repeat_ngram_size: int = Field(0, ge=0, le=16, description="No n-gram of this size occurs twice; 0 = off.")
    split_sentences: bool = Field(
        False,
        description=(
            "Split each text into sentences, translate them in one batch and join them in order (`sentences` lists "
            "each one's translation); each counts as a text against the server's limit."
        ),
    )

    @model_validator(mode="after")
    def _n_best_within_beam(self) -> TranslateRequest:
        if self.n_best is not None and self.n_best > self.beam_size:
            raise ValueError(f"n_best={self.n_best} exceeds beam_size={self.beam_size}; ask for n_best <= beam_size")
        if isinstance(self.text, list) and not self.text:
            raise ValueError("text is an empty list; send at least one text")
        prefix = self.target_prefix
        if prefix is not None and (
            isinstance(prefix, str) != isinstance(self.text, str)
            or (isinstance(prefix, list) and len(prefix) != len(self.text))
        ):
            raise ValueError("target_prefix must match text: a string for a string, a list of the same length")
        if prefix is not None and self.split_sentences:
            raise ValueError("target_prefix and split_sentences do not go together: a prefix starts one translation")
        return self


class GenerateRequest(_Body):
    prompt: Text = Field(..., description="Text to continue.")
    priority: int = Field(0, ge=-1000, le=1000, description=PRIORITY_DOC)
    model: str | None = Field(
        None,
        description=(
            "Model name, or `name@version` to pin a version (GET /v1/models); default: the one generation model."
        ),
    )
    max_tokens: int | None = Field(None, ge=1, description="Most tokens to generate.")
    temperature: float = Field(0.0, ge=0.0, le=5.0, description="0 = greedy.")
    top_k: int = Field(0, ge=0, le=100_000, description="Sample from the k most likely tokens; 0 = off.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass; 1 = off.")
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, description="> 1 discourages repeats; 1 = off.")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="Same seed, same text.")
    stop: Text | list[Text] | None = Field(None, description="Stop strings; the text ends before the first one.")
    stop_token_ids: StopTokenIds | None = Field(None, description=STOP_TOKEN_IDS_DOC)
    stream: bool = Field(False, description="Answer as Server-Sent Events, one per token.")
    ignore_eos: bool = Field(
        False,
        description="Benchmarks and tests: end-of-sequence does not end the text, "
        "which runs to max_tokens (as vLLM's ignore_eos).",
    )


class CompletionRequest(_Body):
    """OpenAI /v1/completions. Unsupported OpenAI options are accepted only at their neutral value."""

    model: str
    prompt: Text | list[Text]
    priority: int = Field(0, ge=-1000, le=1000, description=PRIORITY_DOC)
    max_tokens: int | None = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_SEQUENCES, description="Completions returned per prompt.")
    best_of: int | None = Field(
        None,
        ge=1,
        le=MAX_SEQUENCES,
        description=(
            "Sequences generated per prompt (>= n); the n with the highest log-probability per token are returned."
        ),
    )
    stream: bool = False
    stream_options: dict | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: StopTokenIds | None = Field(None, description=STOP_TOKEN_IDS_DOC + " As vLLM's.")
    seed: int | None = Field(
        None, ge=0, le=2**63 - 1, description=("Same seed, same text; with n > 1 the i-th sequence uses seed + i.")
    )
    echo: bool = Field(False, description="The text starts with the prompt (with logprobs: its tokens scored).")
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description=(
            "Each token's log-probability and the k most likely tokens' (OpenAI's legacy shape), of the model's "
            "distribution before temperature, penalties and biases."
        ),
    )
    suffix: None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, max_length=300, description=("Token id (as a string) -> bias in [-100, 100] added to its logit.")
    )
    user: str | None = Field(None, max_length=256, description="The end user, for the operator's logs.")
    ignore_eos: bool = Field(False, description="vLLM's extension: end-of-sequence does not end the text.")
    min_tokens: int = Field(0, ge=0, description="vLLM's extension: eos and stop ids are held back until then.")

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt is an empty list; send at least one prompt")
        if isinstance(self.prompt, list) and len(self.prompt) > 1 and self.stream:
            raise ValueError("stream=true takes a single prompt, got a list of several")
        bad = [k for k in self.logit_bias or {} if not k.isdigit()]
        if bad:
            raise ValueError(f"logit_bias keys are token ids (decimal strings); got {bad[:3]}")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of={self.best_of} must be >= n={self.n}")
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise ValueError("best_of > n cannot stream: the best sequences are known only at the end")
        return self


# -- responses ---------------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Timings(BaseModel):
    queue_s: float | None = Field(None, description="Waiting for a KV slot (engine).")
    ttft_s: float | None = Field(None, description="Until the first token (engine).")
    server_ttft_s: float | None = Field(
        None,
        description=(
            "From the server's arrival of the request to the first token: the hop to the model and every queue."
        ),
    )
    total_s: float = Field(..., description="Whole request, as seen by the server.")


class Hypothesis(BaseModel):
    text: str
    score: float


class TokenScore(BaseModel):
    token: str
    logprob: float


class Translation(BaseModel):
    text: str
    n_best: list[Hypothesis] | None = None
    finish_reason: str
    score: float | None = None
    token_scores: list[TokenScore] | None = None
    sentences: list[str] | None = None


class ScoreRequest(_Body):
    """Scores given translations (CTranslate2's score_batch): each target's log-probability given its text."""

    text: Text | list[Text] = Field(..., description="Source text(s).")
    target: Text | list[Text] = Field(..., description="The translation(s) to score, one per text.")
    model: str | None = Field(None, description="Model name (or name@version); default: the translation model.")
    priority: int = Field(0, ge=-1000, le=1000, description=PRIORITY_DOC)

    @model_validator(mode="after")
    def _pairs(self) -> ScoreRequest:
        if isinstance(self.text, str) != isinstance(self.target, str) or (
            isinstance(self.text, list) and len(self.text) != len(self.target)
        ):
            raise ValueError("target must match text: a string for a string, a list of the same length for a list")
        if isinstance(self.text, list) and not self.text:
            raise ValueError("text is an empty list; send at least one text")
        return self


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


class TokenizeRequest(_Body):
    """vLLM's POST /tokenize: a text's token ids as the model reads it."""

    model: str
    prompt: Text
    add_special_tokens: bool = Field(
        True,
        description="Add the tokens the model adds itself (a language model's "
        "beginning-of-sequence token; a translator adds none).",
    )


class DetokenizeRequest(_Body):
    """vLLM's POST /detokenize: the text of token ids."""

    model: str
    tokens: list[int] = Field(..., max_length=4096, description="Token ids, each within the model's vocabulary.")


class ErrorDetail(BaseModel):
    type: str
    message: str
    field: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
