"""Runaway chat templates: each construct ends in a PromptError (400) naming the problem, quickly
and without large allocations; every Python error a template raises becomes a PromptError."""

from __future__ import annotations

import dataclasses
import time

import pytest
from frontend_builders import function_tags
from prompt_builders import TEMPLATE, TURN_MARKERS, bootstrap_for

from helios_core.frontend.bootstrap import Bootstrap, PromptError
from helios_core.frontend.template_sandbox import RenderLimits
from helios_core.server.errors import error_body, status_for
from helios_core.testing import byte_level_tokenizer

FAST = RenderLimits(time_s=0.5)
HI = [{"role": "user", "content": "hi"}]
LIMIT = FAST.output_chars(len("roleusercontenthi"))
"""Output and value limit of rendering HI: every client string (keys included) counts as input."""


def core_with(template: str, limits: RenderLimits = FAST) -> Bootstrap:
    boot = bootstrap_for(byte_level_tokenizer(TURN_MARKERS), function_tags(), template)
    return dataclasses.replace(boot, render_limits=limits)


def render_error(template: str, limits: RenderLimits = FAST) -> str:
    boot = core_with(template, limits)
    started = time.monotonic()
    with pytest.raises(PromptError) as caught:
        boot.encode_prompt(HI)
    assert time.monotonic() - started < 5.0
    assert status_for(caught.value) == 400
    assert error_body(caught.value)["error"]["type"] == "invalid_request_error"
    message = str(caught.value)
    assert message.startswith("the chat template cannot render this conversation: ")
    return message.removeprefix("the chat template cannot render this conversation: ")


RUNAWAY = {
    "nested large ranges": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "rendering took longer than 0.5 s",
    ),
    "nested ranges with output": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{{ 'x' * 1000 }}{% endfor %}{% endfor %}",
        f"the rendering grew beyond {LIMIT} characters",
    ),
    "huge string product": ("{{ 'x' * 10**12 }}", f"a repetition would hold 1000000000000 elements, more than {LIMIT}"),
    "huge list product": ("{{ (['ab'] * 10**9)|length }}", "a repetition would hold 3000000000 elements"),
    "doubling concatenation": (
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        f"a value would hold 2097152 elements, more than {LIMIT}",
    ),
    "doubling addition": (
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
        "a concatenation would hold 2097152 elements",
    ),
    "doubling nested lists": (
        "{% set ns = namespace(s=[1]) %}{% for i in range(64) %}{% set ns.s = [ns.s, ns.s] %}{% endfor %}",
        "a value would hold",
    ),
    "doubling captured block": (
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set b %}{{ ns.s }}{{ ns.s }}{% endset %}"
        "{% set ns.s = b %}{% endfor %}",
        "the rendering grew beyond",
    ),
    "huge power": ("{{ 7 ** (10**9) }}", "a power would need about 3000000000 bits, more than 65536"),
    "repeated squaring": (
        "{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
        "a product would need about",
    ),
    "deep recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "calls nest deeper than 100"),
    "exponential macro tree": (
        "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
        "rendering took longer than 0.5 s",
    ),
    "padding method": ("{{ 'x'.ljust(10**10) }}", "str.ljust would hold 10000000000 elements"),
    "padding filter": ("{{ 'x'|center(10**10) }}", "a padded text would hold 10000000000 elements"),
    "printf width": ("{{ '%0999999999d' % 1 }}", "a %-format would hold 999999999 elements"),
    "format width": ("{{ '{:>9999999999}'.format(1) }}", "a format would hold 9999999999 elements"),
    "replace product": ("{{ ('x' * 100000).replace('x', 'y' * 100000) }}", "str.replace would hold"),
    "join product": ("{{ ('x' * 100000)|join('y' * 100000) }}", "a join would hold"),
    "tojson of a shared structure": (
        "{% set ns = namespace(s=[1]) %}{% for i in range(18) %}{% set ns.s = [ns.s, ns.s] %}{% endfor %}"
        "{{ [ns.s, ns.s, ns.s, ns.s]|tojson }}",
        "a tojson value would hold",
    ),
}


@pytest.mark.parametrize("name", sorted(RUNAWAY))
def test_runaway_template_is_a_prompt_error(name: str) -> None:
    template, expected = RUNAWAY[name]
    assert expected in render_error(template)


PYTHON_ERRORS = {
    "OverflowError": ("{{ 10.0 ** 1000 }}", {}),
    "TypeError": ("{{ 1 + 'a' }}", {}),
    "ZeroDivisionError": ("{{ 1 // 0 }}", {}),
    "UnicodeDecodeError": ("{{ 'é'.encode('utf-8').decode('ascii') }}", {}),
    "ValueError": ("{{ ('9' * 5000)|int + 1 }}{{ '9' * 5000 | int }}{{ (10 ** 5000)|string }}", {}),
    # with the sandbox's own limits lifted, Python's limits end the render
    "RecursionError": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", {"call_depth": 10**6}),
    "MemoryError": ("{{ ([0] * 2**60)|length }}", {"output_base_chars": 2**62}),
}


@pytest.mark.parametrize("name", sorted(PYTHON_ERRORS))
def test_python_errors_are_prompt_errors(name: str) -> None:
    template, limits = PYTHON_ERRORS[name]
    message = render_error(template, dataclasses.replace(FAST, **limits))
    if name == "RecursionError":
        assert message.startswith("recursion too deep")
    elif name == "MemoryError":
        assert message == "out of memory"
    else:
        assert message.startswith(f"{name}: ")


def test_raise_exception_names_the_problem() -> None:
    assert render_error("{{ raise_exception('only user and assistant roles') }}") == "only user and assistant roles"


def test_lipsum_is_not_available() -> None:
    assert "'lipsum' is undefined" in render_error("{{ lipsum(10**6) }}")


def test_ordinary_templates_render_unchanged() -> None:
    boot = core_with(TEMPLATE, RenderLimits())
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "there"}]
    # (Jinja drops the template's final newline, as before)
    assert boot.render(messages) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nthere<|im_end|>\n<|im_start|>assistant"
    )
    features = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
        "{{ ns.n }}|{{ messages|map(attribute='role')|join(',') }}|{{ '%-4s|' % 'ab' }}{{ '{:>3}'.format(7) }}"
        "|{{ 'a b'.split()|tojson }}|{{ range(3)|sum }}|{{ 'x'|center(5) }}|{{ 2 ** 10 }}"
        "{% macro m(x) %}<{{ x }}>{% endmacro %}{{ m('y') }}"
    )
    assert core_with(features, RenderLimits()).render(messages) == (
        '2|user,assistant|ab  |  7|["a", "b"]|3|  x  |1024<y>'
    )


def test_output_limit_grows_with_the_client_text() -> None:
    boot = core_with("{% for m in messages %}{{ m.content }}{{ m.content }}{% endfor %}")
    large = "z" * (2 << 20)  # output 4 MiB: beyond the 1 MiB base, within 8 characters per input character
    assert len(boot.render([{"role": "user", "content": large}])) == 2 * len(large)
