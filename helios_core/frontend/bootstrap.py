"""Bootstrap: the frontend assets of a verified core.

Owns loading the only runtime frontend assets a core carries — tokenizer data
and the chat template — plus the typed frontend settings and sampling
defaults from the contract. The chat template runs in a bounded Jinja2
immutable sandbox (:mod:`helios_core.frontend.template_sandbox`: time, output,
value size and call depth limits, every failure a ``PromptError``), and
prompts are encoded so client text never becomes control tokens
(:mod:`helios_core.frontend.prompt_encoding`). Helios reads no checkpoint
config files or model cards: everything here comes from the core.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jinja2 import Template
from tokenizers import Tokenizer

from helios_core.container.reader import CoreFile
from helios_core.contract import PreparedContract
from helios_core.errors import ContractError
from helios_core.errors import PromptError as PromptError  # re-exported: callers catch it from here
from helios_core.frontend.prompt_encoding import ClientTextShield, PromptEncoder
from helios_core.frontend.template_sandbox import (
    RenderLimits,
    TemplateCompileError,
    TemplateRenderError,
    compile_template,
)
from helios_core.frontend.template_sandbox import render as render_template
from helios_core.sampling import (
    SAMPLING_PARAMETERS,
    SamplingLimits,
    SamplingParameter,
    SamplingParams,
    format_bound,
    fresh_seed,
)
from helios_core.wire import container_pb2 as cb
from helios_core.wire import contract_pb2 as ct


class SamplingError(PromptError):
    """A sampling setting outside the values it may take; ``field`` names it (an invalid request)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


_NEUTRAL_SAMPLING = SamplingParams()

_INF = float("inf")


def sampling_ranges(
    parameters: Iterable[SamplingParameter] = SAMPLING_PARAMETERS,
) -> dict[str, tuple[float, float, bool]]:
    """Each declared parameter's meaningful values, by name, in declaration order."""
    return {parameter.name: parameter.meaningful for parameter in parameters}


def resolved_settings(parameters: Iterable[SamplingParameter] = SAMPLING_PARAMETERS) -> tuple[str, ...]:
    """The settings :func:`resolve_sampling` takes from the request, else the core's defaults, else the
    neutral value: every declared parameter but the seed (which has no core default)."""
    return tuple(parameter.name for parameter in parameters if parameter.kind != "seed")


SAMPLING_RANGES: Mapping[str, tuple[float, float, bool]] = sampling_ranges()
"""Each sampling setting's meaningful values: (least, greatest, whether the least is excluded). A core
narrows them to what its sampling inputs hold (:class:`~helios_core.sampling.SamplingLimits`). Declared
on :class:`~helios_core.sampling.SamplingParams`."""

_RESOLVED_SETTINGS = resolved_settings()


def sampling_range(name: str, limits: SamplingLimits | None = None) -> str:
    """The values setting ``name`` may take on a core with ``limits``, as a message writes them."""
    low, high, open_low = SAMPLING_RANGES[name]
    packed = limits.bounds(name) if limits is not None else None
    if packed is not None:
        packed_low, packed_high, _ = packed
        if packed_low > low or (open_low and packed_low >= low):
            low, open_low = packed_low, False  # the smallest normal value replaces an excluded zero
        high = min(high, packed_high)
    upper = "inf)" if high == _INF else f"{format_bound(high)}]"
    return f"{'(' if open_low else '['}{format_bound(low)}, {upper}"


def _check_sampling(params: SamplingParams, limits: SamplingLimits | None = None) -> SamplingParams:
    """Raise SamplingError naming the first setting outside its range (the meaningful values, narrowed to
    what the core's sampling inputs hold when ``limits`` are given); return ``params`` unchanged."""
    for name, (low, high, open_low) in SAMPLING_RANGES.items():
        value = getattr(params, name)
        meaningful = low < value <= high if open_low else low <= value <= high  # false for NaN
        if not meaningful or (limits is not None and not limits.fits(name, value)):
            raise SamplingError(f"{name} must lie in {sampling_range(name, limits)}, not {value!r}", name)
    return params


def resolve_sampling(
    defaults: ct.SamplingDefaults, request: Mapping[str, Any], seed: int | None, limits: SamplingLimits | None = None
) -> SamplingParams:
    """Complete sampling settings: request values over the core defaults over neutral values.

    ``seed`` None (a request that names no seed) draws a fresh one from the operating system's random
    source, within what the core's seed input holds (:func:`~helios_core.sampling.fresh_seed`), so
    unseeded requests sample independently; a given seed is kept, so seeded requests reproduce.

    Raises:
        SamplingError: a setting lies outside its meaningful range, or (with ``limits``, the core's
            :attr:`Bootstrap.sampling_limits`) does not fit the input the core packs it into.
    """
    values: dict[str, Any] = {}
    for name in _RESOLVED_SETTINGS:
        explicit = request.get(name)
        if explicit is not None:
            values[name] = explicit
        elif defaults.HasField(name):
            values[name] = getattr(defaults, name)
        else:
            values[name] = getattr(_NEUTRAL_SAMPLING, name)
    if seed is None:
        seed = fresh_seed(limits)
    return _check_sampling(SamplingParams(seed=seed, **values), limits)


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
    sampling_limits: SamplingLimits = field(default_factory=SamplingLimits)
    """What the core's sampling inputs hold (see :func:`resolve_sampling`)."""
    render_limits: RenderLimits = field(default_factory=RenderLimits)
    """Bounds of every chat-template render (time, output, value sizes, call depth)."""
    encoder: PromptEncoder = field(init=False, repr=False, compare=False)
    """Encodes renderings so client text stays plain text; built from ``tokenizer``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "encoder", PromptEncoder(self.tokenizer))

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
        tokenizer_json = _read_text(core, tokenizer_ids[0], cb.RESOURCE_KIND_TOKENIZER, "tokenizer")
        template = _read_text(core, template_ids[0], cb.RESOURCE_KIND_CHAT_TEMPLATE, "chat template")
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
            sampling_limits=SamplingLimits.of(contract),
        )

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Any] | None = None,
        input_chars: int | None = None,
        add_generation_prompt: bool = True,
        client_variables: Mapping[str, Any] | None = None,
    ) -> str:
        """Render a conversation, with the generation prompt appended unless ``add_generation_prompt``
        is false (the template's own variable of that name), within ``render_limits``.

        ``input_chars``: characters of client text the conversation holds (it scales the output
        limit); counted here when not given. ``client_variables``: a request's own template variables
        (``chat_template_kwargs``), over the core's; they never replace the names this method sets
        (:data:`RENDER_VARIABLES`). Every render failure raises PromptError."""
        special = self.frontend.template_tokens
        if input_chars is None:
            counter = ClientTextShield(None)
            counter.shield_value([list(messages), list(tools or []), dict(client_variables or {})])
            input_chars = counter.input_chars
        variables = {
            **self.template_variables,
            **(client_variables or {}),
            "messages": list(messages),
            "tools": list(tools) if tools else None,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": special.bos,
            "eos_token": "",
        }
        try:
            return render_template(self.template, self.render_limits, input_chars, variables)
        except TemplateRenderError as exc:
            raise PromptError(f"the chat template cannot render this conversation: {exc}") from exc

    def encode_prompt(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Any] | None = None) -> list[int]:
        """Rendered and tokenized prompt ids: the template's markup encodes as control tokens, the
        conversation's own text (messages and tools) as plain text."""
        shield = self.encoder.shield()
        shielded = shield.shield_value(list(messages))
        shielded_tools = shield.shield_value(list(tools)) if tools else None
        text = self.render(shielded, tools=shielded_tools, input_chars=shield.input_chars)
        ids = self.encoder.encode(text, shield)
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


RENDER_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})
"""The template variables :meth:`Bootstrap.render` sets itself."""


def compile_chat_template(source: str) -> Template:
    """Compile a chat template in the bounded sandbox chat templates render in."""
    try:
        return compile_template(source)
    except TemplateCompileError as exc:
        raise ContractError(f"the core's chat template does not compile: {exc}") from exc


def _read_text(core: CoreFile, resource_id: str, kind: int, what: str) -> str:
    """A UTF-8 text resource of the core (the reader refuses one over its kind's size limit unread)."""
    data = core.read_resource(resource_id, kind)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ContractError(f"the core's {what} (resource {resource_id!r}) is not UTF-8 text: {exc}") from exc
