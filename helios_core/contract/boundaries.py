"""Prefix-boundary rules: where a rendered prompt may be cut for prefix reuse, and a prompt's message layout.

Owns :class:`PromptLayout` (what the frontend knows of a rendered chat prompt: each message's role and
the token offset where its rendering ends, whether tools were declared, whether reasoning was stripped
from earlier assistant messages, and where the content of a continued final assistant message starts)
and :class:`PrefixBoundaries`, the core's ``FrontendContract.prefix_boundaries`` read once. A rule
allows a cut right after a message of one of its roles when its rendering constraint holds for the
request:

* ``INDEPENDENT``: always;
* ``INDEPENDENT_WITHOUT_TOOLS``: when the request declares no tools (the template renders tools into
  an earlier message);
* ``INDEPENDENT_UNLESS_REASONING_STRIPPED``: when no reasoning was stripped from an earlier assistant
  message.

:meth:`PrefixBoundaries.cuts` turns a layout into the token offsets where prefix reuse may end; the
runtime's residency then claims only the published pages that lie wholly before the last allowed cut
a prefix match covers. A core that declares no rules, or a request that carries no layout (a raw
completion prompt, which no template rendered), is matched on its tokens alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from helios_core.wire import contract_pb2 as ct

__all__ = ["PrefixBoundaries", "PromptLayout", "PromptMessage", "last_cut"]


class PromptMessage(msgspec.Struct, frozen=True, gc=False):
    """One rendered message: its ``MessageRole`` and the prompt token offset where its rendering ends."""

    role: int
    end: int


class PromptLayout(msgspec.Struct, frozen=True, gc=False):
    """What the frontend knows of a rendered chat prompt's structure (token offsets into its prompt ids)."""

    messages: tuple[PromptMessage, ...] = ()
    """The rendered messages in order; their ``end`` offsets never decrease."""
    tools: bool = False
    """The request declares tools."""
    reasoning_stripped: bool = False
    """The template stripped reasoning from an earlier assistant message."""
    continuation: int = -1
    """Where the content of a continued final assistant message starts (the prompt's tail from here
    continues that assistant turn); -1 when the prompt opens a new turn."""

    def problem(self, prompt_tokens: int) -> str | None:
        """Why this layout does not describe a prompt of ``prompt_tokens`` tokens; None when it does."""
        previous = 0
        for index, message in enumerate(self.messages):
            if not previous <= message.end <= prompt_tokens:
                return (
                    f"message {index} ends at token {message.end}, outside [{previous}, {prompt_tokens}] "
                    "(message ends must not decrease and must lie within the prompt)"
                )
            previous = message.end
        if not (self.continuation == -1 or 0 <= self.continuation <= prompt_tokens):
            return f"the continued assistant message starts at token {self.continuation}, outside [0, {prompt_tokens}]"
        return None


def _constraint_holds(constraint: int, layout: PromptLayout) -> bool:
    if constraint == ct.RENDERING_CONSTRAINT_INDEPENDENT:
        return True
    if constraint == ct.RENDERING_CONSTRAINT_INDEPENDENT_WITHOUT_TOOLS:
        return not layout.tools
    if constraint == ct.RENDERING_CONSTRAINT_INDEPENDENT_UNLESS_REASONING_STRIPPED:
        return not layout.reasoning_stripped
    return False  # an unknown constraint (validation refuses it) never allows a cut


@dataclass(frozen=True)
class PrefixBoundaries:
    """A core's prefix-boundary rules: per rule, the roles it names and its rendering constraint."""

    rules: tuple[tuple[frozenset[int], int], ...] = ()

    @classmethod
    def of(cls, frontend: ct.FrontendContract) -> PrefixBoundaries:
        return cls(tuple((frozenset(rule.roles), rule.constraint) for rule in frontend.prefix_boundaries))

    @property
    def restricted(self) -> bool:
        """The core declares rules: prefix reuse of a laid-out prompt ends only at allowed cuts."""
        return bool(self.rules)

    def allows(self, role: int, layout: PromptLayout) -> bool:
        """A cut right after a message of ``role`` is allowed for a request of ``layout``."""
        return any(role in roles and _constraint_holds(constraint, layout) for roles, constraint in self.rules)

    def cuts(self, layout: PromptLayout | None) -> tuple[int, ...] | None:
        """The token offsets where prefix reuse of ``layout``'s prompt may end, ascending; None when any
        offset may (no rules, or no layout)."""
        if not self.rules or layout is None:
            return None
        allowed = {message.end for message in layout.messages if self.allows(message.role, layout)}
        return tuple(sorted(allowed))


def last_cut(cuts: Sequence[int], limit: int) -> int:
    """The largest of ``cuts`` (ascending) that is at most ``limit``; 0 when none is."""
    best = 0
    for cut in cuts:
        if cut > limit:
            break
        best = cut
    return best
