"""Bootstrap: the frontend assets of a verified core.

Owns loading the only runtime frontend assets a core carries — tokenizer data
and the chat template — plus the typed frontend settings and sampling
defaults from the contract. The chat template runs in Jinja2's immutable
sandbox with the conventions chat templates are written for (``trim_blocks``,
``lstrip_blocks``, ``tojson``, ``raise_exception``). Helios reads no
checkpoint config files or model cards: everything here comes from the core.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jinja2 import Template, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from helios_core.container.reader import CoreFile
from helios_core.contract import PreparedContract
from helios_core.errors import ContractError, HeliosError
from helios_core.runtime.messages import SamplingParams
from helios_core.wire import container_pb2 as cb
from helios_core.wire import contract_pb2 as ct


class PromptError(HeliosError):
    """A conversation the chat template cannot render (an invalid request)."""


_NEUTRAL_SAMPLING = SamplingParams()


def _check_sampling(params: SamplingParams) -> SamplingParams:
    """Raise PromptError naming the first out-of-range setting; return ``params`` unchanged."""
    if params.temperature < 0:
        raise PromptError(f"temperature must be >= 0, not {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise PromptError(f"top_p must lie in (0, 1], not {params.top_p}")
    if params.top_k < 0:
        raise PromptError(f"top_k must be >= 0, not {params.top_k}")
    if not 0 <= params.min_p <= 1:
        raise PromptError(f"min_p must lie in [0, 1], not {params.min_p}")
    if params.repetition_penalty <= 0:
        raise PromptError(f"repetition_penalty must be > 0, not {params.repetition_penalty}")
    if not -2 <= params.frequency_penalty <= 2 or not -2 <= params.presence_penalty <= 2:
        raise PromptError("frequency_penalty and presence_penalty must lie in [-2, 2]")
    if not 0 <= params.seed < 2**64:
        raise PromptError("seed must lie in [0, 2**64)")
    return params


def resolve_sampling(defaults: ct.SamplingDefaults, request: Mapping[str, Any], seed: int) -> SamplingParams:
    """Complete sampling settings: request values over the core defaults over neutral values."""
    values: dict[str, Any] = {}
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "frequency_penalty",
        "presence_penalty",
    ):
        explicit = request.get(name)
        if explicit is not None:
            values[name] = explicit
        elif defaults.HasField(name):
            values[name] = getattr(defaults, name)
        else:
            values[name] = getattr(_NEUTRAL_SAMPLING, name)
    return _check_sampling(SamplingParams(seed=seed, **values))


@dataclass(frozen=True)
class Bootstrap:
    """Tokenizer, chat template and typed frontend settings of one core."""

    tokenizer: Tokenizer
    chat_template: str
    frontend: ct.FrontendContract
    eos_token_ids: tuple[int, ...]
    sampling_defaults: ct.SamplingDefaults
    max_output_tokens: int
    input_vocabulary: int
    template_variables: Mapping[str, Any]
    template: Template

    @classmethod
    def load(cls, core: CoreFile, contract: PreparedContract) -> Bootstrap:
        """Read the tokenizer and chat template resources and the contract's frontend settings."""
        tokenizer_ids = [r.id for r in core.resources.values() if r.kind == cb.RESOURCE_KIND_TOKENIZER]
        template_ids = [r.id for r in core.resources.values() if r.kind == cb.RESOURCE_KIND_CHAT_TEMPLATE]
        if len(tokenizer_ids) != 1 or len(template_ids) != 1:
            raise ContractError(
                f"a core carries exactly one tokenizer and one chat template; this one has {len(tokenizer_ids)} "
                f"and {len(template_ids)}"
            )
        tokenizer_json = bytes(core.read_resource(tokenizer_ids[0], cb.RESOURCE_KIND_TOKENIZER)).decode("utf-8")
        template = bytes(core.read_resource(template_ids[0], cb.RESOURCE_KIND_CHAT_TEMPLATE)).decode("utf-8")
        try:
            tokenizer = Tokenizer.from_str(tokenizer_json)
        except Exception as exc:  # the tokenizers library raises plain Exceptions
            raise ContractError(f"the core's tokenizer does not load: {exc}") from exc
        variables = {v.name: json.loads(v.json_value) for v in contract.model.frontend.template_variables}
        defaults = contract.serving.defaults
        return cls(
            tokenizer=tokenizer,
            chat_template=template,
            frontend=contract.model.frontend,
            eos_token_ids=contract.eos_token_ids,
            sampling_defaults=defaults.sampling,
            max_output_tokens=defaults.max_output_tokens if defaults.HasField("max_output_tokens") else 512,
            input_vocabulary=contract.model.input_vocabulary.size,
            template_variables=variables,
            template=compile_chat_template(template),
        )

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Any] | None = None) -> str:
        """Render a conversation with the generation prompt appended."""
        special = self.frontend.template_tokens
        try:
            return self.template.render(
                messages=list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=True,
                bos_token=special.bos,
                eos_token="",
                **self.template_variables,
            )
        except TemplateError as exc:
            raise PromptError(f"the chat template cannot render this conversation: {exc}") from exc

    def encode_prompt(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Any] | None = None) -> list[int]:
        """Rendered and tokenized prompt ids (special tokens in the rendering encode as themselves)."""
        text = self.render(messages, tools=tools)
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False).ids
        bad = [i for i in ids if i >= self.input_vocabulary]
        if bad:
            raise PromptError(
                f"prompt token ids {bad[:5]} lie outside the input vocabulary [0, {self.input_vocabulary})"
            )
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` with special tokens skipped."""
        text: str = self.tokenizer.decode(list(ids), skip_special_tokens=True)
        return text


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def compile_chat_template(source: str) -> Template:
    """Compile a chat template in the immutable sandbox chat templates are written for."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise ContractError(f"the core's chat template does not compile: {exc}") from exc
