"""Builders of the prompt tests: a core's Bootstrap from a tokenizer, a syntax family and a chat template."""

from __future__ import annotations

from typing import Any

from helios_core.frontend.bootstrap import Bootstrap, compile_chat_template
from helios_core.wire import contract_pb2 as ct

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}[r]{{ m.reasoning_content }}[/r]{% endif %}"
    "{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.id }}]{{ c.function.name }}{{ c.function.arguments|tojson }}"
    "[/call]{% endfor %}"
    "{% if m.tool_call_id %}[id {{ m.tool_call_id }}]{% endif %}<|im_end|>\n{% endfor %}"
    "{% for t in tools or [] %}[tool]{{ t.function.name }}:{{ t.function.description }}:"
    "{{ t.function.parameters|tojson }}{% endfor %}"
    "<|im_start|>assistant\n"
)
TURN_MARKERS = ["<|im_start|>", "<|im_end|>"]


def bootstrap_for(tokenizer: Any, frontend: ct.FrontendContract, template: str = TEMPLATE) -> Bootstrap:
    return Bootstrap(
        tokenizer=tokenizer,
        chat_template=template,
        frontend=frontend,
        eos_token_ids=(),
        sampling_defaults=ct.SamplingDefaults(),
        max_output_tokens=16,
        input_vocabulary=tokenizer.get_vocab_size(),
        template_variables={},
        template=compile_chat_template(template),
    )
