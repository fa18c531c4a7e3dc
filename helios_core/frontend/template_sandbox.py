"""The bounded sandbox chat templates render in.

Owns compiling a chat template and rendering it within limits. Templates run in Jinja2's
immutable sandbox (no attribute writes, no mutation of lists, dicts or sets) with the conventions
chat templates are written for (``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, ``tojson``,
``raise_exception``, ``strftime_now``). A template is core data, so a runaway one must not hold a
preparation thread or the server's memory; every render is bounded by :class:`RenderLimits`:

* **time**: a wall-time deadline checked at every loop iteration, call, output piece and size check;
* **output**: the text a render produces (into its result or into captured blocks, macros and
  ``set`` blocks) is counted piece by piece against ``output_chars``;
* **values**: a string, list or dict a template builds (``*``, ``+``, ``~``, ``%``, ``set``, call
  arguments and results, padding and joining filters and methods) may not exceed ``value_size``
  elements, counted through nested containers *before* the operation runs where it can be;
  integers may not exceed ``int_bits`` bits (``**`` and ``*`` are checked before computing);
* **depth**: calls (macros, recursive loops, methods) nest at most ``call_depth`` deep.

Every failure while rendering (a limit, ``raise_exception``, an undefined operation, or a Python
error such as ``OverflowError``, ``ZeroDivisionError``, ``RecursionError`` or ``MemoryError``)
becomes :class:`TemplateRenderError` naming the problem. Render state lives in a per-thread
budget, so one compiled template serves several preparation threads at once.
"""

from __future__ import annotations

import json
import operator
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jinja2 import Template, TemplateError, nodes, pass_context
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

__all__ = ["RenderLimits", "TemplateCompileError", "TemplateRenderError", "compile_template", "render"]


class TemplateCompileError(Exception):
    """The template source does not compile."""


class TemplateRenderError(Exception):
    """A render failed or exceeded a limit (the message names the problem)."""


@dataclass(frozen=True)
class RenderLimits:
    """Bounds of one chat-template render (see the module docstring)."""

    time_s: float = 5.0
    """Wall time one render may take."""
    output_base_chars: int = 1 << 20
    """Output allowance of every render, in characters ..."""
    output_per_input_char: int = 8
    """... plus this many characters per character of client text the render receives."""
    call_depth: int = 100
    """Deepest nesting of calls (macros, recursive loops, methods)."""
    int_bits: int = 1 << 16
    """Largest integer a template may compute, in bits."""

    def output_chars(self, input_chars: int) -> int:
        """The output (and value size) limit of a render that receives ``input_chars`` of client text."""
        return self.output_base_chars + self.output_per_input_char * input_chars


class _Budget:
    """The limits and running totals of the render in progress on one thread."""

    __slots__ = ("call_depth", "deadline", "int_bits", "limits", "output", "output_limit")

    def __init__(self, limits: RenderLimits, input_chars: int) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.time_s
        self.output_limit = limits.output_chars(input_chars)
        self.int_bits = limits.int_bits
        self.output = 0
        self.call_depth = 0

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateRenderError(f"rendering took longer than {self.limits.time_s:g} s")

    def emit(self, chars: int) -> None:
        self.output += chars
        if self.output > self.output_limit:
            raise TemplateRenderError(f"the rendering grew beyond {self.output_limit} characters")

    def check_size(self, size: int, what: str) -> None:
        if size > self.output_limit:
            raise TemplateRenderError(f"{what} would hold {size} elements, more than {self.output_limit}")

    def check_int_bits(self, bits: int, what: str) -> None:
        if bits > self.int_bits:
            raise TemplateRenderError(f"{what} would need about {bits} bits, more than {self.int_bits}")


_local = threading.local()


def _budget() -> _Budget:
    budget: _Budget | None = getattr(_local, "budget", None)
    if budget is None:  # a template used outside render() (or a constant folded while compiling)
        return _Budget(RenderLimits(), 0)
    return budget


def _expanded_size(value: Any, budget: _Budget, limit: int) -> int:
    """Elements ``value`` holds counted through nested containers (shared ones each time they
    appear), stopping early once beyond ``limit``; strings count their characters."""
    if isinstance(value, str | bytes):
        return len(value)
    if not isinstance(value, list | tuple | dict | set | frozenset):
        return 1
    sizes: dict[int, int] = {}
    visiting: set[int] = set()
    steps = 0

    def walk(item: Any) -> int:
        nonlocal steps
        if isinstance(item, str | bytes):
            return len(item)
        if not isinstance(item, list | tuple | dict | set | frozenset):
            return 1
        key = id(item)
        known = sizes.get(key)
        if known is not None:
            return known
        if key in visiting:
            raise TemplateRenderError("a value contains itself")
        visiting.add(key)
        steps += 1
        if steps % 4096 == 0:
            budget.tick()
        total = 1
        children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
        for child in children:
            total += walk(child)
            if total > limit:
                break
        visiting.discard(key)
        sizes[key] = total
        return total

    return walk(value)


def _checked(value: Any, what: str) -> Any:
    budget = _budget()
    budget.tick()
    budget.check_size(_expanded_size(value, budget, budget.output_limit), what)
    if isinstance(value, int) and not isinstance(value, bool):
        budget.check_int_bits(value.bit_length(), what)
    return value


_SEQUENCE = (str, bytes, list, tuple)


def _mul(left: Any, right: Any) -> Any:
    budget = _budget()
    for seq, count in ((left, right), (right, left)):
        if isinstance(seq, _SEQUENCE) and isinstance(count, int):
            size = _expanded_size(seq, budget, budget.output_limit) if isinstance(seq, list | tuple) else len(seq)
            budget.check_size(size * max(count, 0), "a repetition")
            return operator.mul(left, right)
    if isinstance(left, int) and isinstance(right, int):
        budget.check_int_bits(left.bit_length() + right.bit_length(), "a product")
    return operator.mul(left, right)


def _pow(left: Any, right: Any) -> Any:
    budget = _budget()
    if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        budget.check_int_bits(left.bit_length() * right, "a power")
    return operator.pow(left, right)


def _add(left: Any, right: Any) -> Any:
    budget = _budget()
    if isinstance(left, _SEQUENCE) and isinstance(right, _SEQUENCE):
        limit = budget.output_limit
        budget.check_size(_expanded_size(left, budget, limit) + _expanded_size(right, budget, limit), "a concatenation")
    return operator.add(left, right)


_PRINTF_FIELD = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[a-zA-Z%]")
_FORMAT_NUMBERS = re.compile(r"\d+")


def _check_widths(numbers: list[int], arguments: Any, budget: _Budget, what: str) -> None:
    for number in numbers:
        budget.check_size(number, what)
    if any(_is_large_int(argument, budget) for argument in arguments):
        raise TemplateRenderError(f"{what} with a width argument above {budget.output_limit}")


def _is_large_int(value: Any, budget: _Budget) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > budget.output_limit


def _printf_numbers(fmt: str) -> tuple[list[int], bool]:
    """Width and precision numbers of a printf format, and whether any is taken from the arguments."""
    numbers: list[int] = []
    starred = False
    for width, precision in _PRINTF_FIELD.findall(fmt):
        for part in (width, precision):
            if part == "*":
                starred = True
            elif part:
                numbers.append(int(part))
    return numbers, starred


def _mod(left: Any, right: Any) -> Any:
    budget = _budget()
    if isinstance(left, str):
        numbers, starred = _printf_numbers(left)
        arguments = right if isinstance(right, tuple) else (right,)
        _check_widths(numbers, arguments if starred else (), budget, "a %-format")
        result = operator.mod(left, right)
        return _checked(result, "a %-format")
    return operator.mod(left, right)


_BINOPS: dict[str, Callable[[Any, Any], Any]] = {"*": _mul, "**": _pow, "+": _add, "%": _mod}


def _format_spec_numbers(fmt: str) -> list[int]:
    """Numbers inside the format specs (after ``:``) of a str.format string."""
    numbers: list[int] = []
    for field in re.findall(r"\{([^{}]*)", fmt):
        _, _, spec = field.partition(":")
        numbers.extend(int(n) for n in _FORMAT_NUMBERS.findall(spec))
    return numbers


def _check_str_method(obj: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], budget: _Budget) -> None:
    """Refuse a str method call whose result would exceed the value limit, before it runs."""
    method = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format and str.format_map
    owner = getattr(method, "__self__", None)
    name = getattr(method, "__name__", "")
    if not isinstance(owner, str):
        return
    if name in ("ljust", "rjust", "center", "zfill") and args and isinstance(args[0], int):
        budget.check_size(args[0], f"str.{name}")
    elif name == "expandtabs":
        tabsize = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(tabsize, int):
            budget.check_size(len(owner) + owner.count("\t") * max(tabsize, 0), "str.expandtabs")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        old, new = args[0], args[1]
        occurrences = len(owner) + 1 if not old else owner.count(old)
        budget.check_size(len(owner) + occurrences * max(len(new) - len(old), 0), "str.replace")
    elif name == "join" and args:
        _check_join(args[0], owner, budget, "str.join")
    elif name in ("format", "format_map"):
        numbers = _format_spec_numbers(owner)
        arguments = [*args, *kwargs.values()]
        if name == "format_map" and args and isinstance(args[0], Mapping):
            arguments = list(args[0].values())
        nested = re.search(r"\{[^{}]*\{", owner) is not None
        _check_widths(numbers, arguments if nested else (), budget, "a format")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with the checks of the module docstring."""

    intercepted_binops = frozenset(_BINOPS)

    def call_binop(self, context: Context, operator_name: str, left: Any, right: Any) -> Any:
        _budget().tick()
        handler = _BINOPS.get(operator_name)
        if handler is None:
            return super().call_binop(context, operator_name, left, right)
        return handler(left, right)

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.tick()
        if budget.call_depth >= budget.limits.call_depth:
            raise TemplateRenderError(f"calls nest deeper than {budget.limits.call_depth}")
        limit = budget.output_limit
        for argument in (*args, *kwargs.values()):
            if isinstance(argument, list | tuple | dict | set | frozenset | str):
                budget.check_size(_expanded_size(argument, budget, limit), "a call argument")
        _check_str_method(__obj, args, kwargs, budget)
        budget.call_depth += 1
        try:
            result = super().call(__context, __obj, *args, **kwargs)
        finally:
            budget.call_depth -= 1
        return _checked(result, "a call result")


class _Bounding(NodeTransformer):
    """Rewrites a parsed template so loops, output, concatenation and assignments are checked."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, "helios_loop", [], [], None, None, lineno=node.lineno)
        return node

    def visit_Output(self, node: nodes.Output) -> nodes.Node:
        self.generic_visit(node)
        node.nodes = [
            nodes.Filter(child, "helios_emit", [], [], None, None, lineno=node.lineno) for child in node.nodes
        ]
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return nodes.Filter(node, "helios_value", [], [], None, None, lineno=node.lineno)

    def visit_Assign(self, node: nodes.Assign) -> nodes.Node:
        self.generic_visit(node)
        node.node = nodes.Filter(node.node, "helios_value", [], [], None, None, lineno=node.lineno)
        return node

    def visit_AssignBlock(self, node: nodes.AssignBlock) -> nodes.Node:
        self.generic_visit(node)
        node.filter = nodes.Filter(node.filter, "helios_value", [], [], None, None, lineno=node.lineno)  # type: ignore[arg-type]
        return node


@pass_context
def _loop(context: Context, iterable: Any) -> Iterator[Any]:
    budget = _budget()
    for item in iterable:
        budget.tick()
        yield item


@pass_context
def _emit(context: Context, value: Any) -> Any:
    budget = _budget()
    budget.tick()
    if isinstance(value, str):
        budget.emit(len(value))
        return value
    budget.check_size(_expanded_size(value, budget, budget.output_limit), "an output value")
    return value


@pass_context
def _value(context: Context, value: Any) -> Any:
    return _checked(value, "a value")


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None) -> str:
    """JSON text of ``value`` (non-ASCII kept), produced in pieces so a huge result stops early."""
    budget = _budget()
    budget.check_size(_expanded_size(value, budget, budget.output_limit), "a tojson value")
    encoder = json.JSONEncoder(ensure_ascii=False, indent=indent)
    pieces: list[str] = []
    size = 0
    for piece in encoder.iterencode(value):
        size += len(piece)
        budget.check_size(size, "a tojson result")
        pieces.append(piece)
        if len(pieces) % 4096 == 0:
            budget.tick()
    return "".join(pieces)


def _bounded_filter(name: str, original: Callable[..., Any], check: Callable[..., None]) -> Callable[..., Any]:
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.tick()
        check(budget, *args, **kwargs)
        return _checked(original(*args, **kwargs), f"the {name} filter's result")

    bounded.__name__ = getattr(original, "__name__", name)
    # keep the pass-context/eval-context/environment marker of the original
    for marker in ("jinja_pass_arg",):
        if hasattr(original, marker):
            setattr(bounded, marker, getattr(original, marker))
    return bounded


def _width_check(position: int, keyword: str) -> Callable[..., None]:
    """A check that the numeric argument at ``position`` (or ``keyword``) times the lines stays in bounds."""

    def check(budget: _Budget, *args: Any, **kwargs: Any) -> None:
        width = args[position] if len(args) > position else kwargs.get(keyword)
        text = args[position - 1] if len(args) >= position else ""
        lines = str(text).count("\n") + 1 if isinstance(text, str) else 1
        if isinstance(width, int) and not isinstance(width, bool):
            budget.check_size(width * lines, "a padded text")
        elif isinstance(width, str):
            budget.check_size(len(width) * lines, "an indented text")

    return check


def _format_filter_check(budget: _Budget, *args: Any, **kwargs: Any) -> None:
    if args and isinstance(args[0], str):
        numbers, starred = _printf_numbers(args[0])
        _check_widths(numbers, (*args[1:], *kwargs.values()) if starred else (), budget, "a format")


def _batch_check(budget: _Budget, *args: Any, **kwargs: Any) -> None:
    count = args[1] if len(args) > 1 else kwargs.get("linecount")
    if isinstance(count, int):
        budget.check_size(count, "a batch")


def _check_join(items: Any, separator: Any, budget: _Budget, what: str) -> None:
    """Refuse joining ``items`` with ``separator`` when the result would exceed the value limit."""
    if isinstance(items, str):
        size, count = len(items), len(items)
    elif isinstance(items, list | tuple):
        size, count = sum(_expanded_size(item, budget, budget.output_limit) for item in items), len(items)
    else:
        return
    budget.check_size(size + max(count - 1, 0) * len(str(separator)), what)


def _join_check(budget: _Budget, *args: Any, **kwargs: Any) -> None:
    # do_join(eval_ctx, value, d="", attribute=None)
    if len(args) > 1:
        _check_join(args[1], args[2] if len(args) > 2 else kwargs.get("d", ""), budget, "a join")


def _replace_check(budget: _Budget, *args: Any, **kwargs: Any) -> None:
    # do_replace(eval_ctx, s, old, new, count=None)
    if len(args) >= 4 and isinstance(args[1], str):
        text, old, new = args[1], str(args[2]), str(args[3])
        occurrences = len(text) + 1 if not old else text.count(old)
        budget.check_size(len(text) + occurrences * max(len(new) - len(old), 0), "a replace")


def _no_check(budget: _Budget, *args: Any, **kwargs: Any) -> None:
    return None


def _sum(iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
    """The ``sum`` filter, adding one item at a time within the limits."""
    budget = _budget()
    total = start
    for item in iterable:
        value = item
        if attribute is not None:
            value = item.get(attribute) if isinstance(item, Mapping) else getattr(item, str(attribute), None)
        total = _add(total, value) if isinstance(total, _SEQUENCE) else operator.add(total, value)
        if isinstance(total, int):
            budget.check_int_bits(total.bit_length(), "a sum")
        budget.tick()
    return total


def compile_template(source: str) -> Template:
    """Compile ``source`` in the bounded sandbox (TemplateCompileError if it does not compile)."""
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    filters = env.filters
    filters["center"] = _bounded_filter("center", filters["center"], _width_check(1, "width"))
    filters["indent"] = _bounded_filter("indent", filters["indent"], _width_check(1, "width"))
    filters["format"] = _bounded_filter("format", filters["format"], _format_filter_check)
    filters["batch"] = _bounded_filter("batch", filters["batch"], _batch_check)
    filters["join"] = _bounded_filter("join", filters["join"], _join_check)
    filters["replace"] = _bounded_filter("replace", filters["replace"], _replace_check)
    filters["pprint"] = _bounded_filter("pprint", filters["pprint"], _no_check)
    filters["sum"] = _sum
    filters["tojson"] = _tojson
    filters["helios_loop"] = _loop
    filters["helios_emit"] = _emit
    filters["helios_value"] = _value
    env.globals.pop("lipsum", None)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        tree = env.parse(source)
        bounded = _Bounding().visit(tree)
        return env.from_string(bounded)
    except TemplateError as exc:
        raise TemplateCompileError(str(exc)) from exc


def render(template: Template, limits: RenderLimits, input_chars: int, variables: Mapping[str, Any]) -> str:
    """Render ``template`` with ``variables`` within ``limits`` (``input_chars``: the client text it receives)."""
    previous = getattr(_local, "budget", None)
    budget = _Budget(limits, input_chars)
    _local.budget = budget
    pieces: list[str] = []
    try:
        for piece in template.generate(**variables):
            pieces.append(piece)
            budget.tick()
        return "".join(pieces)
    except TemplateRenderError:
        raise
    except TemplateError as exc:
        raise TemplateRenderError(str(exc)) from exc
    except RecursionError as exc:
        raise TemplateRenderError(f"recursion too deep ({exc})") from exc
    except MemoryError as exc:
        raise TemplateRenderError("out of memory") from exc
    except Exception as exc:  # any Python error a template's expressions raise
        raise TemplateRenderError(f"{type(exc).__name__}: {exc}") from exc
    finally:
        _local.budget = previous
