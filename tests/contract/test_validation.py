"""prepare_contract and check_runtime_support: one test per rule, each a minimal edit of payload-v3.

Every test starts from a fresh copy of the golden fixture (``parts``), breaks exactly one rule and
checks that the ContractError names that rule. Positive controls show that the edits are minimal:
the same construction with the rule satisfied validates.
"""

from __future__ import annotations

import re

import pytest

from helios_core.contract import (
    THIRD_PARTY_IDENTIFIERS,
    RuntimeCapabilities,
    check_runtime_support,
)
from helios_core.errors import ContractError, UnsupportedFeatureError
from helios_core.wire import container_pb2 as cb
from helios_core.wire import contract_pb2 as ct
from helios_core.wire import manifest_pb2 as mf

FRONTEND_IDENTIFIERS = ["tool_parser", "reasoning_parser", "image_preparation", "image_layout"]


def rejects(parts, fragment: str, *also: str) -> str:
    """prepare_contract must raise ContractError containing ``fragment`` (and each of ``also``)."""
    with pytest.raises(ContractError, match=re.escape(fragment)) as info:
        parts.prepare()
    message = str(info.value)
    for other in also:
        assert other in message
    return message


def unsupported(parts, fragment: str) -> None:
    """Validation passes, but this runtime refuses the core naming ``fragment``."""
    prepared = parts.prepare()
    with pytest.raises(UnsupportedFeatureError, match=re.escape(fragment)):
        check_runtime_support(prepared, RuntimeCapabilities())


def set_xtml(parts) -> None:
    """A consistent XTML tool parser + XTML think reasoning frontend."""
    fe = parts.model.frontend
    fe.tool_parser = ct.TOOL_PARSER_XTML
    fe.reasoning_parser = ct.REASONING_PARSER_XTML_THINK
    fe.tool_syntax.opener = "<tool_calls>"
    fe.tool_syntax.xtml.block_open = "<tool_calls>"
    fe.tool_syntax.xtml.block_close = "</tool_calls>"
    fe.tool_syntax.xtml.call_element = "call"
    fe.tool_syntax.xtml.arg_element = "arg"
    fe.tool_syntax.xtml.think_element = "think"
    fe.reasoning_syntax.open = "<think>"
    fe.reasoning_syntax.close = "</think>"
    fe.reasoning_syntax.terminal_marker = "<tool_calls>"


def set_atem(parts) -> None:
    """A consistent ATEM tool parser + recipient-header reasoning frontend."""
    fe = parts.model.frontend
    fe.tool_parser = ct.TOOL_PARSER_ATEM
    fe.reasoning_parser = ct.REASONING_PARSER_RECIPIENT_HEADER
    fe.tool_syntax.opener = "<atem:function_calls>"
    fe.tool_syntax.atem.prefix = "atem:"
    fe.tool_syntax.atem.block = "function_calls"
    fe.tool_syntax.atem.invoke = "invoke"
    fe.tool_syntax.atem.parameter = "parameter"
    header = fe.reasoning_syntax.recipient_header
    header.start = "<|start|>"
    header.assistant_role = "assistant"
    header.recipient_prefix = " to="
    header.message = "<|message|>"
    header.end = "<|end|>"
    header.end_of_message = "<|eom|>"
    header.reasoning_recipient = "self"


# --------------------------------------------------------------------------- the fixture itself


def test_unmodified_fixture_validates_and_is_supported(parts) -> None:
    prepared = parts.prepare()
    check_runtime_support(prepared, RuntimeCapabilities())
    assert prepared.version == 3
    assert (prepared.sampled_size, prepared.logits_width) == (259, 320)
    assert (prepared.histogram_width, prepared.mask_words) == (320, 10)
    assert {g.operation for g in prepared.graphs.values()} >= {ct.OPERATION_PREFILL, ct.OPERATION_DECODE}


def test_execution_abi_label_never_gates_loading(parts) -> None:
    parts.execution.abi_label = "anything-else"
    check_runtime_support(parts.prepare(), RuntimeCapabilities())


def test_every_problem_is_listed_in_one_error(parts) -> None:
    parts.serving.served_name = ""
    parts.serving.context_tokens = 0
    message = rejects(parts, "invalid contract (2 problems)")
    assert "served_name is empty" in message
    assert "context_tokens must be positive" in message


# --------------------------------------------------------------------------- versions


@pytest.mark.parametrize("version", [0, 4])
def test_unsupported_contract_version(parts, version: int) -> None:
    parts.model.version = version
    rejects(parts, f"unsupported contract version {version}; this runtime loads versions 1, 2, 3")


# --------------------------------------------------------------------------- vocabulary


def test_sampled_size_must_be_positive(parts) -> None:
    parts.model.vocabulary.sampled_size = 0
    rejects(parts, "vocabulary.sampled_size must be positive")


def test_logits_width_below_sampled_size(parts) -> None:
    parts.model.vocabulary.sampled_size = 321
    rejects(parts, "vocabulary.logits_width 320 is smaller than sampled_size 321")


def test_histogram_width_must_equal_logits_width(parts) -> None:
    parts.model.vocabulary.histogram_width = 319
    rejects(parts, "vocabulary.histogram_width 319 must equal logits_width 320")


def test_mask_words_must_cover_logits(parts) -> None:
    parts.model.vocabulary.mask_words = 9
    rejects(parts, "vocabulary.mask_words 9 must equal ceil(logits_width / 32) = 10")


def test_version_3_rejects_implicit_histogram_width(parts) -> None:
    parts.model.vocabulary.histogram_width = 0
    rejects(parts, "vocabulary.histogram_width 0 must equal logits_width 320")


def test_version_3_rejects_implicit_mask_words(parts) -> None:
    parts.model.vocabulary.mask_words = 0
    rejects(parts, "vocabulary.mask_words 0 must equal ceil(logits_width / 32) = 10")


def test_version_1_defaults_histogram_width_and_mask_words(parts) -> None:
    parts.model.version = 1
    parts.model.vocabulary.histogram_width = 0
    parts.model.vocabulary.mask_words = 0
    prepared = parts.prepare()
    assert (prepared.histogram_width, prepared.mask_words) == (320, 10)


def test_version_1_defaults_logits_width_to_sampled_size(parts) -> None:
    # The defaulted width (259) then disagrees with the fixture's 320-wide histogram rows.
    parts.model.version = 1
    vocab = parts.model.vocabulary
    vocab.logits_width = vocab.histogram_width = vocab.mask_words = 0
    rejects(parts, "histogram rows are 320 wide, the vocabulary needs 259")


def test_input_vocabulary_size_must_be_positive(parts) -> None:
    parts.model.input_vocabulary.size = 0
    rejects(parts, "input_vocabulary.size must be positive")


def test_input_vocabulary_must_fit_the_embedding_table(parts) -> None:
    # tok_embd has 320 rows; an id in [320, 321) would reach the gather and fail the request.
    parts.model.input_vocabulary.size = 320
    parts.prepare()  # the positive control: every input id has a row
    parts.model.input_vocabulary.size = 321
    message = rejects(
        parts,
        "input_vocabulary.size 321 exceeds the 320 rows of embedding table 'tok_embd': program 'prefill_p16' "
        "node 'embedding' embeds input ids (PROMPT_TOKENS in 'input_ids'), so an id in [320, 321) would fail "
        "the gather",
    )
    assert message.count("embedding table") == 1  # once per table, not once per program


def test_input_vocabulary_is_checked_against_the_rows_a_view_reads(parts) -> None:
    # Not tied to a tensor name: the rows are those of the table argument's view, whatever its buffer.
    for program in ("prefill_p16", "mixed_p16", "resume_p16", "scored_prefill_p16"):
        parts.arg(program, "embedding", "table").view.shape[:] = [258, 32]
    rejects(parts, "input_vocabulary.size 259 exceeds the 258 rows of embedding table 'tok_embd'")


def test_input_vocabulary_is_checked_for_host_fed_pending_tokens(parts) -> None:
    # A decode program that embeds a host-owned pending token (PENDING_TOKEN) gathers input ids too.
    graph = parts.graph("decode_b4")
    graph.pending_token.binding_destination = "input_ids"
    graph.bindings.add(destination="input_ids", source=ct.VALUE_SOURCE_PENDING_TOKEN, indexing=ct.INDEXING_PACKED_TOKEN)
    arg = parts.arg("decode_b4", "embedding", "ids")
    arg.view.buffer = "input_ids"
    arg.view.shape[:] = [4]
    parts.prepare()
    parts.arg("decode_b4", "embedding", "table").view.shape[:] = [200, 32]
    rejects(
        parts,
        "input_vocabulary.size 259 exceeds the 200 rows of embedding table 'tok_embd': program 'decode_b4' node "
        "'embedding' embeds input ids (PENDING_TOKEN in 'input_ids')",
    )


def test_image_sentinel_outside_input_vocabulary(parts) -> None:
    parts.model.input_vocabulary.image_sentinel_ids.append(259)
    rejects(parts, "input_vocabulary: image sentinel 259 lies outside [0, 259)")


# --------------------------------------------------------------------------- frontend identifiers


@pytest.mark.parametrize("field", FRONTEND_IDENTIFIERS)
def test_frontend_identifier_zero(parts, field: str) -> None:
    setattr(parts.model.frontend, field, 0)
    rejects(parts, f"frontend.{field} is unspecified (0); it must name an implementation")


@pytest.mark.parametrize("value", [99, 99_999, 200_000])
@pytest.mark.parametrize("field", FRONTEND_IDENTIFIERS)
def test_frontend_identifier_unknown(parts, field: str, value: int) -> None:
    setattr(parts.model.frontend, field, value)
    rejects(
        parts,
        f"frontend.{field} {value} is neither a built-in identifier nor in the third-party range 100000-199999",
    )


@pytest.mark.parametrize("value", [THIRD_PARTY_IDENTIFIERS.start, THIRD_PARTY_IDENTIFIERS.stop - 1])
@pytest.mark.parametrize("field", ["tool_parser", "reasoning_parser"])  # image identifiers: test_vision_validation
def test_frontend_identifier_third_party_range_is_accepted(parts, field: str, value: int) -> None:
    setattr(parts.model.frontend, field, value)
    parts.prepare()


# --------------------------------------------------------------------------- frontend syntax


def test_xtml_and_atem_pairs_validate(make_parts) -> None:
    for configure in (set_xtml, set_atem):
        parts = make_parts()
        configure(parts)
        parts.prepare()


def test_xtml_think_requires_xtml_tool_parser(parts) -> None:
    fe = parts.model.frontend
    fe.reasoning_parser = ct.REASONING_PARSER_XTML_THINK
    fe.reasoning_syntax.open = "<think>"
    fe.reasoning_syntax.close = "</think>"
    rejects(
        parts,
        "reasoning parser REASONING_PARSER_XTML_THINK requires tool parser TOOL_PARSER_XTML, not TOOL_PARSER_NONE",
    )


def test_recipient_header_requires_atem_tool_parser(parts) -> None:
    set_atem(parts)
    fe = parts.model.frontend
    fe.tool_parser = ct.TOOL_PARSER_JSON_TAGS
    fe.tool_syntax.json_tags.call_open = "<tool_call>"
    rejects(
        parts,
        "reasoning parser REASONING_PARSER_RECIPIENT_HEADER requires tool parser TOOL_PARSER_ATEM, "
        "not TOOL_PARSER_JSON_TAGS",
    )


def test_reasoning_terminal_marker_must_equal_tool_opener(parts) -> None:
    set_xtml(parts)
    parts.model.frontend.reasoning_syntax.terminal_marker = "<tool_call>"
    rejects(parts, "reasoning terminal marker '<tool_call>' must equal the tool syntax's opener '<tool_calls>'")


def test_tool_syntax_family_must_match_parser(parts) -> None:
    fe = parts.model.frontend
    fe.tool_parser = ct.TOOL_PARSER_FUNCTION_TAGS
    fe.tool_syntax.opener = "<tool_call>"
    fe.tool_syntax.json_tags.call_open = "<tool_call>"
    rejects(
        parts,
        "tool parser TOOL_PARSER_FUNCTION_TAGS reads tool_syntax.function_tags, but the core declares json_tags",
    )


def test_tool_syntax_family_missing(parts) -> None:
    fe = parts.model.frontend
    fe.tool_parser = ct.TOOL_PARSER_DSML
    fe.tool_syntax.opener = "<function_calls>"
    rejects(parts, "reads tool_syntax.dsml, but the core declares no family")


def test_tool_syntax_opener_must_be_declared(parts) -> None:
    set_xtml(parts)
    parts.model.frontend.tool_syntax.opener = ""
    parts.model.frontend.reasoning_syntax.terminal_marker = ""
    rejects(parts, "frontend: tool_syntax.opener must be declared")


def test_tool_syntax_without_tool_parser(parts) -> None:
    parts.model.frontend.tool_syntax.opener = "<tool_call>"
    rejects(parts, "frontend: tool_syntax is declared but the tool parser is NONE")


def test_reasoning_syntax_without_reasoning_parser(parts) -> None:
    parts.model.frontend.reasoning_syntax.open = "<think>"
    rejects(parts, "frontend: reasoning_syntax is declared but the reasoning parser is NONE")


def test_think_tags_need_open_and_close(parts) -> None:
    fe = parts.model.frontend
    fe.reasoning_parser = ct.REASONING_PARSER_THINK_TAGS
    fe.reasoning_syntax.open = "<think>"
    rejects(parts, "frontend: reasoning_syntax.open and .close must be declared")


@pytest.mark.parametrize("field", ["start", "message", "end", "end_of_message", "reasoning_recipient"])
def test_recipient_header_fields_must_be_declared(parts, field: str) -> None:
    set_atem(parts)
    setattr(parts.model.frontend.reasoning_syntax.recipient_header, field, "")
    rejects(parts, f"frontend: reasoning_syntax.recipient_header.{field} must be declared")


def test_prefix_boundaries_validate_in_version_3(parts) -> None:
    parts.model.frontend.prefix_boundaries.add(
        roles=[ct.MESSAGE_ROLE_USER, ct.MESSAGE_ROLE_TOOL],
        constraint=ct.RENDERING_CONSTRAINT_INDEPENDENT,
    )
    parts.prepare()


def test_prefix_boundaries_need_version_3(parts) -> None:
    parts.model.version = 2
    parts.model.frontend.prefix_boundaries.add(
        roles=[ct.MESSAGE_ROLE_USER], constraint=ct.RENDERING_CONSTRAINT_INDEPENDENT
    )
    rejects(parts, "frontend.prefix_boundaries needs contract version 3 (core declares 2)")


@pytest.mark.parametrize(
    "roles", [[], [ct.MESSAGE_ROLE_UNSPECIFIED], [ct.MESSAGE_ROLE_USER, ct.MESSAGE_ROLE_UNSPECIFIED]]
)
def test_prefix_boundary_roles_must_be_specified(parts, roles: list[int]) -> None:
    parts.model.frontend.prefix_boundaries.add(roles=roles, constraint=ct.RENDERING_CONSTRAINT_INDEPENDENT)
    rejects(parts, "frontend.prefix_boundaries: every rule names one or more known roles")


def test_prefix_boundary_constraint_must_be_specified(parts) -> None:
    parts.model.frontend.prefix_boundaries.add(roles=[ct.MESSAGE_ROLE_USER])
    rejects(parts, "frontend.prefix_boundaries: unknown or unspecified rendering constraint")


def test_template_variable_must_be_json(parts) -> None:
    parts.model.frontend.template_variables.add(name="enable_thinking", json_value="true")
    parts.prepare()
    parts.model.frontend.template_variables.add(name="mode", json_value="fast")
    rejects(parts, "frontend.template_variables['mode'] is not JSON")


def test_plugin_parameters_must_be_json(parts) -> None:
    parts.model.frontend.plugin_parameters_json = '{"budget": 3'
    rejects(parts, "frontend.plugin_parameters_json is not JSON")


@pytest.mark.parametrize("value", ["[1, 2]", '"text"', "3", "null"])
def test_plugin_parameters_must_be_an_object(parts, value: str) -> None:
    parts.model.frontend.plugin_parameters_json = value
    rejects(parts, "frontend.plugin_parameters_json must be a JSON object")


def test_an_empty_plugin_parameters_object_validates(parts) -> None:
    parts.model.frontend.plugin_parameters_json = "{}"
    parts.prepare()


# --------------------------------------------------------------------------- buffers and resources


def test_buffer_declared_twice(parts) -> None:
    parts.execution.buffers.append(parts.buffer("scratch.h"))
    rejects(parts, "buffer 'scratch.h' is declared twice")


def test_buffer_without_role(parts) -> None:
    parts.buffer("scratch.h").role = mf.BUFFER_ROLE_UNSPECIFIED
    rejects(parts, "buffer 'scratch.h' has unknown role 0")


def test_buffer_with_unknown_dtype(parts) -> None:
    parts.buffer("scratch.h").dtype = 77
    rejects(parts, "buffer 'scratch.h' has unknown dtype 77")


def test_buffer_with_empty_shape(parts) -> None:
    parts.buffer("scratch.h").shape[0].size = 0
    rejects(parts, "buffer 'scratch.h' has an empty shape")


def test_weights_buffer_names_no_resource(parts) -> None:
    parts.buffer("tok_embd").resource_id = ""
    rejects(parts, "weights buffer 'tok_embd' names no resource")


def test_buffer_names_unknown_resource(parts) -> None:
    parts.buffer("tok_embd").resource_id = "ghost"
    rejects(parts, "buffer 'tok_embd' names unknown resource 'ghost'")


def test_weights_buffer_on_resource_of_another_kind(parts) -> None:
    parts.buffer("tok_embd").resource_id = "tokenizer"
    rejects(
        parts,
        "buffer 'tok_embd' uses resource 'tokenizer' as RESOURCE_KIND_WEIGHTS, but it is declared "
        "RESOURCE_KIND_TOKENIZER",
    )


def test_state_buffer_with_resource_needs_state_init(parts) -> None:
    parts.buffer("pending_tokens").resource_id = "weights.embed"
    rejects(
        parts,
        "buffer 'pending_tokens' uses resource 'weights.embed' as RESOURCE_KIND_STATE_INIT, but it is "
        "declared RESOURCE_KIND_WEIGHTS",
    )


def test_weights_buffer_reads_past_its_resource(parts) -> None:
    parts.buffer("tok_embd").resource_offset = 4
    rejects(parts, "buffer 'tok_embd' reads bytes up to 40964 of resource 'weights.embed', which decodes to 40960")


def add_module_resource(parts) -> None:
    parts.resources.append(cb.ExecutableResource(id="kernels", kind=cb.RESOURCE_KIND_MODULE, decoded_nbytes=64))


def test_module_names_unknown_resource(parts) -> None:
    parts.execution.modules.add(name="kernels", target="sm_90a", resource_id="ghost")
    rejects(parts, "module 'kernels' names unknown resource 'ghost'")


def test_module_resource_must_be_a_module(parts) -> None:
    parts.execution.modules.add(name="kernels", target="sm_90a", resource_id="tokenizer")
    rejects(
        parts,
        "module 'kernels' uses resource 'tokenizer' as RESOURCE_KIND_MODULE, but it is declared "
        "RESOURCE_KIND_TOKENIZER",
    )


# --------------------------------------------------------------------------- transport


@pytest.mark.parametrize("frames", [0, 3])
def test_transport_frames(parts, frames: int) -> None:
    parts.execution.transport.frames = frames
    rejects(parts, f"transport.frames must be 1 or 2, not {frames}")


def test_transport_entry_declared_twice(parts) -> None:
    parts.execution.transport.entries.append(parts.entry("temperature"))
    rejects(parts, "transport entry 'temperature' is declared twice or shadows a buffer")


def test_transport_entry_shadows_a_buffer(parts) -> None:
    parts.add_entry("scratch.h", mf.DTYPE_F32, (4,))
    rejects(parts, "transport entry 'scratch.h' is declared twice or shadows a buffer")


def test_transport_entry_with_unknown_dtype(parts) -> None:
    parts.add_entry("extra", 77, (4,))
    rejects(parts, "transport entry 'extra' has unknown dtype 77")


def test_transport_entry_with_empty_shape(parts) -> None:
    parts.add_entry("extra", mf.DTYPE_I32, ())
    rejects(parts, "transport entry 'extra' has an empty shape")


def test_transport_owned_entry_must_exist(parts) -> None:
    parts.execution.transport.frame_index_entry = "ghost"
    rejects(parts, "transport names unknown entry 'ghost' for its own use")


# --------------------------------------------------------------------------- state views and cache


def test_state_view_declared_twice(parts) -> None:
    parts.model.state_views.append(parts.state_view("pending_token"))
    rejects(parts, "state view 'pending_token' is declared twice")


@pytest.mark.parametrize("buffer", ["scratch.h", "ghost", "page_table"])
def test_state_view_on_non_persistent_buffer(parts, buffer: str) -> None:
    parts.state_view("pending_token").buffer = buffer
    rejects(parts, f"state view 'pending_token' names '{buffer}', which is not a persistent buffer")


def test_state_view_with_zero_extent(parts) -> None:
    parts.state_view("pending_token").byte_extent = 0
    rejects(parts, "state view 'pending_token' has zero extent")


def test_state_view_wider_than_its_row_stride(parts) -> None:
    parts.state_view("output_counts").row_stride = 640
    rejects(parts, "state view 'output_counts': offset + extent exceeds its row stride")


def test_state_view_outside_its_buffer(parts) -> None:
    parts.state_view("pending_token").row_stride = 8
    rejects(parts, "state view 'pending_token' ends at byte 28 of 'pending_tokens', which has 16 bytes")


def test_cache_page_tokens_must_be_positive(parts) -> None:
    parts.model.cache.page_tokens = 0
    rejects(parts, "cache.page_tokens must be positive")


def test_history_region_without_kind(parts) -> None:
    parts.region("kv").kind = ct.HISTORY_KIND_UNSPECIFIED
    rejects(parts, "history region 'kv' has unknown kind 0")


def test_paged_region_tokens_per_record(parts) -> None:
    parts.region("kv").tokens_per_record = 0
    rejects(parts, "history region 'kv': tokens_per_record must be at least 1")


def test_paged_region_plane_must_be_a_cache_plane(parts) -> None:
    parts.region("kv").planes.append("scratch.h")
    rejects(parts, "history region 'kv' names 'scratch.h', which is not a cache plane")


def test_cache_plane_leading_dimension_is_pages(parts) -> None:
    parts.buffer("cache.k0").shape[0].symbol = mf.DIM_SYMBOL_STATE_ROWS
    rejects(parts, "cache plane 'cache.k0': its leading dimension must be CACHE_PAGES")


def test_paged_kv_planes_hold_page_tokens_positions_a_page(parts) -> None:
    # The fixture's planes are [CACHE_PAGES, 4, kvh, hd]; the kernels take the page size from that
    # dimension while packing computes cache slots from page_tokens.
    parts.model.cache.page_tokens = 8
    message = rejects(
        parts,
        "cache plane 'cache.k0' of paged-kv region 'kv': its second dimension must be 8 tokens a page "
        "(page_tokens 8), not 4",
    )
    for plane in ("cache.k1", "cache.v0", "cache.v1"):
        assert f"cache plane {plane!r} of paged-kv region 'kv'" in message


def test_one_paged_kv_plane_of_another_page_size_is_named(parts) -> None:
    parts.buffer("cache.v1").shape[1].size = 8  # larger, so the programs' views of it still fit
    message = rejects(
        parts,
        "cache plane 'cache.v1' of paged-kv region 'kv': its second dimension must be 4 tokens a page "
        "(page_tokens 4), not 8",
    )
    assert message.startswith("invalid contract: ")  # that plane alone


def test_sliding_window_planes_hold_page_tokens_positions_a_page(parts) -> None:
    region = parts.region("kv")
    region.kind = ct.HISTORY_KIND_SLIDING_WINDOW
    region.window_tokens = 16
    _window_attention(parts, 16)
    parts.prepare()  # the positive control: planes of page_tokens positions
    parts.model.cache.page_tokens = 2
    rejects(
        parts,
        "cache plane 'cache.k0' of sliding-window region 'kv': its second dimension must be 2 tokens a page "
        "(page_tokens 2), not 4",
    )


def test_paged_region_names_no_planes(parts) -> None:
    del parts.region("kv").planes[:]
    rejects(parts, "history region 'kv' names no planes")


def test_sliding_window_region_needs_window_tokens(parts) -> None:
    parts.model.cache.regions.add(name="swa", kind=ct.HISTORY_KIND_SLIDING_WINDOW)
    rejects(parts, "sliding-window region 'swa' must declare window_tokens")


def test_page_table_view_must_be_a_transport_entry(parts) -> None:
    parts.model.cache.page_table_views[0].buffer = "ghost"
    rejects(parts, "page-table view names 'ghost', which is not a transport entry")


def test_page_table_view_must_be_integer(parts) -> None:
    parts.entry("page_table").dtype = mf.DTYPE_F32
    rejects(parts, "page-table view 'page_table' must be an integer entry")


def test_page_table_view_names_unknown_region(parts) -> None:
    parts.model.cache.page_table_views[0].region = "ghost"
    rejects(parts, "page-table view 'page_table' names unknown region 'ghost'")


@pytest.mark.parametrize(("offset", "pages", "shown"), [(1, 16, "1..17"), (0, 17, "0..17"), (0, 0, "0..0")])
def test_page_table_view_outside_its_entry(parts, offset: int, pages: int, shown: str) -> None:
    view = parts.model.cache.page_table_views[0]
    view.page_offset = offset
    view.pages_per_row = pages
    rejects(parts, f"page-table view 'page_table': pages {shown} exceed its row extent 16")


def test_a_context_no_page_table_row_holds_is_inconsistent(parts) -> None:
    view = parts.model.cache.page_table_views[0]
    page_tokens = parts.model.cache.page_tokens
    parts.serving.context_tokens = view.pages_per_row * page_tokens  # a full row: consistent
    parts.prepare()
    parts.serving.context_tokens = view.pages_per_row * page_tokens + 1
    rejects(
        parts,
        f"page-table view {view.buffer!r} holds {view.pages_per_row} pages of {page_tokens} tokens a row, fewer than "
        f"the {view.pages_per_row + 1} a request at context_tokens {view.pages_per_row * page_tokens + 1} needs",
    )


# --------------------------------------------------------------------------- graphs and programs


def test_graph_declared_twice(parts) -> None:
    parts.model.graphs.append(parts.graph("decode_b4"))
    rejects(parts, "graph 'decode_b4' is declared twice")


def test_graph_operation_must_agree_with_its_program(parts) -> None:
    parts.program("decode_b4").operation = ct.OPERATION_PREFILL
    rejects(parts, "graph 'decode_b4' declares operation decode but the execution catalog's program is prefill")


@pytest.mark.parametrize("operation", [ct.OPERATION_UNSPECIFIED, 10, 42])
def test_graph_with_unknown_operation(parts, operation: int) -> None:
    parts.graph("decode_b1").operation = operation
    parts.program("decode_b1").operation = operation
    rejects(parts, f"graph 'decode_b1' has unknown operation {operation}")


def test_program_without_graph_contract(parts) -> None:
    parts.execution.programs.add(name="orphan", operation=ct.OPERATION_DECODE)
    rejects(parts, "execution program 'orphan' has no graph contract")


def test_graph_contract_without_program(parts) -> None:
    programs = parts.execution.programs
    del programs[[p.name for p in programs].index("decode_b4")]
    rejects(
        parts,
        "graph 'decode_b4' has no program in the execution catalog",
        "missing graph variant: max_concurrency is 4 but the widest decode program holds 2 rows",
    )


def test_graph_depends_on_unknown_resource(parts) -> None:
    parts.graph("decode_b4").resource_dependencies.append("ghost")
    rejects(parts, "graph 'decode_b4' depends on unknown resource 'ghost'")


def test_missing_prefill_variant(parts) -> None:
    parts.remove_graph("prefill_p16")
    rejects(parts, "missing graph variant: no prefill program")


def test_missing_initialize_variant(parts) -> None:
    # Every admitted request's first round is `initialize` (it resets the request's state rows); a core
    # without one used to pass validation and fail startup's warm-up with an internal scheduler error.
    parts.remove_graph("initialize")
    message = rejects(parts, "missing graph variant: no initialize program")
    assert message == "invalid contract: missing graph variant: no initialize program"


def test_missing_decode_variant(parts) -> None:
    for name in ("decode_b1", "decode_b2", "decode_b4"):
        parts.remove_graph(name)
    rejects(parts, "missing graph variant: no decode program")


def test_max_concurrency_above_widest_decode_program(parts) -> None:
    parts.serving.max_concurrency = 5
    rejects(parts, "missing graph variant: max_concurrency is 5 but the widest decode program holds 4 rows")


@pytest.mark.parametrize("operation", ["snapshot", "restore"])
def test_snapshots_need_snapshot_and_restore_programs(parts, operation: str) -> None:
    parts.serving.snapshot_capacity = 2
    rejects(parts, f"missing graph variant: snapshots are declared but there is no {operation} program")


# --------------------------------------------------------------------------- value bindings


def test_binding_destination_must_be_a_transport_entry(parts) -> None:
    parts.binding("decode_b4", "temperature").destination = "ghost"
    rejects(parts, "graph 'decode_b4' binding 'ghost': destination is not a registered transport entry")


def test_binding_to_a_buffer_is_not_a_transport_entry(parts) -> None:
    parts.binding("decode_b4", "temperature").destination = "scratch.logits"
    rejects(parts, "graph 'decode_b4' binding 'scratch.logits': destination is not a registered transport entry")


@pytest.mark.parametrize("owned", ["frame_index", "submission_sequence"])
def test_binding_to_transport_owned_entry(parts, owned: str) -> None:
    parts.graph("decode_b4").bindings.add(
        destination=owned, source=ct.VALUE_SOURCE_SAMPLING_STEP, indexing=ct.INDEXING_SCALAR
    )
    rejects(
        parts,
        f"graph 'decode_b4' binding '{owned}': frame index and submission sequence belong to the transport",
    )


@pytest.mark.parametrize("source", [ct.VALUE_SOURCE_UNSPECIFIED, 99])
def test_binding_with_unknown_source(parts, source: int) -> None:
    parts.binding("decode_b4", "top_k").source = source
    rejects(parts, f"graph 'decode_b4' binding 'top_k': unknown value source {source}")


def test_float_source_into_integer_destination(parts) -> None:
    parts.entry("temperature").dtype = mf.DTYPE_I32
    rejects(parts, "graph 'decode_b4' binding 'temperature': a float source needs a float destination, not i32")


def test_integer_source_into_float_destination(parts) -> None:
    parts.entry("top_k").dtype = mf.DTYPE_F32
    rejects(parts, "graph 'decode_b4' binding 'top_k': an integer source needs an integer destination, not f32")


def test_binding_indexing_unspecified(parts) -> None:
    parts.binding("decode_b4", "top_k").indexing = ct.INDEXING_UNSPECIFIED
    rejects(parts, "graph 'decode_b4' binding 'top_k': unknown indexing 0")


@pytest.mark.parametrize(
    "indexing", [ct.INDEXING_SUBMISSION_ROW, ct.INDEXING_ACTIVE_ROW, ct.INDEXING_PHYSICAL_REQUEST_ROW]
)
def test_row_indexed_destination_smaller_than_batch(parts, indexing: int) -> None:
    parts.add_entry("narrow", mf.DTYPE_I32, (3,))
    parts.graph("decode_b4").bindings.add(destination="narrow", source=ct.VALUE_SOURCE_SLOT, indexing=indexing)
    rejects(parts, "graph 'decode_b4' binding 'narrow': 3 rows cannot hold batch capacity 4")


def test_packed_token_destination_smaller_than_p(parts) -> None:
    parts.graph("prefill_p16").extents.packed_token_capacity = 17
    rejects(parts, "graph 'prefill_p16' binding 'input_ids': 16 rows cannot hold 17 packed tokens")


def test_histogram_destination_geometry(parts) -> None:
    parts.entry("prompt_histogram").shape[-1] = 321
    rejects(
        parts,
        "graph 'initialize' binding 'prompt_histogram': histogram rows are 321 wide, the vocabulary needs 320",
    )


def test_mask_destination_geometry(parts) -> None:
    parts.entry("grammar_mask").shape[-1] = 11
    rejects(parts, "graph 'decode_b4' binding 'grammar_mask': mask rows are 11 words, the vocabulary needs 10")


def test_mask_destination_must_hold_32_bit_words(parts) -> None:
    parts.entry("grammar_mask").dtype = mf.DTYPE_U8
    rejects(parts, "graph 'decode_b4' binding 'grammar_mask': grammar masks are 32-bit words")


def test_candidate_mask_destination_geometry(parts) -> None:
    parts.add_entry("candidate_masks", mf.DTYPE_U32, (4, 9))
    parts.graph("decode_b4").bindings.add(
        destination="candidate_masks",
        source=ct.VALUE_SOURCE_CANDIDATE_GRAMMAR_MASKS,
        indexing=ct.INDEXING_SUBMISSION_ROW,
    )
    rejects(parts, "binding 'candidate_masks': mask rows are 9 words, the vocabulary needs 10")


def test_destination_bound_twice(parts) -> None:
    graph = parts.graph("decode_b4")
    graph.bindings.append(parts.binding("decode_b4", "temperature"))
    rejects(parts, "graph 'decode_b4': destination 'temperature' is bound 2 times")


def test_one_source_may_feed_several_destinations(parts) -> None:
    parts.add_entry("temperature_copy", mf.DTYPE_F32, (4,))
    parts.graph("decode_b4").bindings.add(
        destination="temperature_copy",
        source=ct.VALUE_SOURCE_TEMPERATURE,
        indexing=ct.INDEXING_SUBMISSION_ROW,
    )
    prepared = parts.prepare()
    assert {"temperature", "temperature_copy"} <= prepared.graphs["decode_b4"].input_destinations


def add_image_slot_binding(parts) -> None:
    parts.add_entry("image_slot", mf.DTYPE_I32, (4,))
    parts.graph("prefill_p16").bindings.add(
        destination="image_slot",
        source=ct.VALUE_SOURCE_IMAGE_FEATURE_SLOT,
        indexing=ct.INDEXING_SUBMISSION_ROW,
    )


@pytest.mark.parametrize("layout", [ct.IMAGE_LAYOUT_NONE, ct.IMAGE_LAYOUT_UNSPECIFIED])
def test_image_sources_need_an_image_layout(parts, layout: int) -> None:
    parts.model.frontend.image_layout = layout
    add_image_slot_binding(parts)
    rejects(parts, "graph 'prefill_p16' binding 'image_slot': image sources need a selected image layout")


def test_image_tensor_needs_an_output_name(parts) -> None:
    parts.model.frontend.image_layout = ct.IMAGE_LAYOUT_RASTER_SPAN
    parts.add_entry("pixels", mf.DTYPE_F32, (64, 48))
    parts.graph("prefill_p16").bindings.add(
        destination="pixels", source=ct.VALUE_SOURCE_IMAGE_TENSOR, indexing=ct.INDEXING_SCALAR
    )
    rejects(parts, "graph 'prefill_p16' binding 'pixels': IMAGE_TENSOR needs an image_output name")


def test_speculative_prefix_limit_outside_speculative_program(parts) -> None:
    parts.add_entry("prefix_limit", mf.DTYPE_I32, (4,))
    parts.graph("decode_b4").bindings.add(
        destination="prefix_limit",
        source=ct.VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT,
        indexing=ct.INDEXING_SUBMISSION_ROW,
    )
    rejects(
        parts,
        "graph 'decode_b4' binding 'prefix_limit': speculative prefix limits belong to speculative programs",
    )


# --------------------------------------------------------------------------- state accesses, pending token


def test_access_to_unknown_state_view(parts) -> None:
    parts.graph("decode_b4").state_accesses.add(view="ghost", mode=ct.ACCESS_MODE_READ)
    rejects(parts, "graph 'decode_b4' accesses unknown state view 'ghost'")


def test_state_access_without_mode(parts) -> None:
    parts.access("decode_b4", "output_counts").mode = ct.ACCESS_MODE_UNSPECIFIED
    rejects(parts, "graph 'decode_b4': access to 'output_counts' has unknown mode 0")


def test_device_owned_pending_token_needs_a_read(parts) -> None:
    parts.access("decode_b4", "pending_token").mode = ct.ACCESS_MODE_WRITE
    rejects(parts, "graph 'decode_b4': it must declare a read of its pending token view 'pending_token'")


def test_device_owned_pending_token_must_be_a_state_view(parts) -> None:
    parts.graph("decode_b4").pending_token.state_view = "ghost"
    rejects(parts, "graph 'decode_b4': pending token view 'ghost' is not a state view")


@pytest.mark.parametrize("producer", ["prefill_p16", "mixed_p16", "resume_p16", "scored_prefill_p16"])
def test_pending_token_producers_must_declare_a_write(parts, producer: str) -> None:
    parts.access(producer, "pending_token").mode = ct.ACCESS_MODE_READ
    rejects(
        parts,
        f"graph '{producer}' produces the device-owned pending token but declares no write of state view "
        "'pending_token'",
    )


def test_host_owned_pending_token_needs_a_pending_token_binding(parts) -> None:
    parts.graph("decode_b4").pending_token.binding_destination = "input_ids"
    rejects(parts, "graph 'decode_b4': host-owned pending token needs a PENDING_TOKEN binding to 'input_ids'")


def test_host_owned_pending_token_with_binding_validates(parts) -> None:
    graph = parts.graph("decode_b4")
    graph.pending_token.binding_destination = "input_ids"
    graph.bindings.add(destination="input_ids", source=ct.VALUE_SOURCE_PENDING_TOKEN, indexing=ct.INDEXING_PACKED_TOKEN)
    parts.prepare()


# --------------------------------------------------------------------------- speculative programs


def test_speculative_program_validates(parts) -> None:
    graph = parts.add_speculative()
    prepared = parts.prepare()
    extents = prepared.graphs[graph.name].extents
    assert (extents.batch_capacity, extents.token_capacity, extents.packed_token_capacity) == (4, 4, 16)
    assert extents.selectable_width == 4
    assert prepared.graphs[graph.name].length_source == ct.VALUE_SOURCE_QUERY_LENGTH


def test_speculative_program_with_prefix_limit_validates(parts) -> None:
    graph = parts.add_speculative()
    parts.add_entry("prefix_limit", mf.DTYPE_I32, (4,))
    graph.bindings[0].destination = "prefix_limit"
    graph.bindings[0].source = ct.VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT
    assert parts.prepare().graphs[graph.name].length_source == ct.VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT


def test_speculative_p_must_be_explicit_even_in_version_2(parts) -> None:
    parts.model.version = 2
    parts.add_speculative(packed=0)
    rejects(parts, "graph 'speculative_w4': packed_token_capacity (P) must be declared explicitly")


def test_version_3_requires_explicit_p_everywhere(parts) -> None:
    parts.graph("decode_b2").extents.packed_token_capacity = 0
    rejects(parts, "graph 'decode_b2': packed_token_capacity (P) must be declared explicitly")


def test_version_2_defaults_p_of_non_speculative_programs(parts) -> None:
    parts.model.version = 2
    parts.graph("decode_b2").extents.packed_token_capacity = 0
    assert parts.prepare().graphs["decode_b2"].extents.packed_token_capacity == 2


def test_batch_capacity_must_be_positive(parts) -> None:
    parts.graph("decode_b1").extents.batch_capacity = 0
    rejects(parts, "graph 'decode_b1': batch_capacity (B) must be positive")


def test_speculative_without_length_source(parts) -> None:
    del parts.add_speculative().bindings[:]
    rejects(
        parts,
        "graph 'speculative_w4': a speculative program binds exactly one length source "
        "(QUERY_LENGTH or SPECULATIVE_PREFIX_LIMIT), found 0",
    )


def test_speculative_with_two_length_sources(parts) -> None:
    graph = parts.add_speculative()
    parts.add_entry("prefix_limit", mf.DTYPE_I32, (4,))
    graph.bindings.add(
        destination="prefix_limit",
        source=ct.VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT,
        indexing=ct.INDEXING_SUBMISSION_ROW,
    )
    rejects(
        parts,
        "a speculative program binds exactly one length source (QUERY_LENGTH or SPECULATIVE_PREFIX_LIMIT), found 2",
    )


def test_width_one_speculative_program_draws_no_proposals(parts) -> None:
    parts.add_speculative(width=1, packed=4, draft=1, widths=(1,))
    rejects(parts, "graph 'speculative_w4': a width-one speculative program draws no proposals (D must be 0)")


def test_width_one_speculative_program_validates(parts) -> None:
    parts.add_speculative(width=1, packed=4, draft=0, widths=(1,))
    parts.prepare()


def test_wide_speculative_program_needs_draft_tokens(parts) -> None:
    parts.add_speculative(draft=0)
    rejects(parts, "graph 'speculative_w4': draft_tokens (D) must be declared for width 4")


def test_confidence_width_must_equal_draft_tokens(parts) -> None:
    parts.add_speculative().confidence_width = 2
    rejects(parts, "graph 'speculative_w4': confidence_width 2 must equal D = 3")


def test_draft_capacity_must_hold_draft_tokens(parts) -> None:
    parts.add_speculative().extents.draft_capacity = 2
    rejects(parts, "graph 'speculative_w4': draft_capacity is smaller than D")


def test_speculative_p_above_b_times_w(parts) -> None:
    parts.add_speculative(packed=17)
    rejects(parts, "graph 'speculative_w4': P exceeds B x W")


def test_declared_speculative_width_above_every_program(parts) -> None:
    graph = parts.add_speculative(draft=2)  # min(D + 1, W) = 3
    assert graph.confidence_width == 2
    rejects(parts, "missing graph variant: no speculative program serves width 4 (min(D + 1, W))")


def test_speculative_programs_need_declared_widths(parts) -> None:
    parts.add_speculative(widths=())
    rejects(parts, "speculative programs exist but speculative_widths declares none")


def test_speculative_programs_need_version_2(parts) -> None:
    parts.model.version = 1
    parts.add_speculative()
    rejects(parts, "graph 'speculative_w4': speculative programs need contract version 2 or later")


@pytest.mark.parametrize("field", ["draft_tokens", "confidence_width"])
def test_non_speculative_program_draws_no_proposals(parts, field: str) -> None:
    graph = parts.graph("decode_b4")
    if field == "draft_tokens":
        graph.extents.draft_tokens = 1
    else:
        graph.confidence_width = 1
    rejects(parts, "graph 'decode_b4': only speculative programs draw proposals or produce confidence")


def test_non_speculative_program_reports_no_draft_cursor(parts) -> None:
    parts.graph("decode_b4").cursor.reports_draft_cursor = True
    rejects(parts, "graph 'decode_b4': only speculative programs report a draft cursor")


# --------------------------------------------------------------------------- tuned bindings


def test_tuned_binding_validates(parts) -> None:
    parts.add_tuned()
    parts.prepare()


def test_tuned_binding_to_non_tuned_buffer(parts) -> None:
    parts.add_tuned()
    parts.execution.tuning[0].outputs.append("scratch.h")
    parts.graph("decode_b4").tuned_bindings[0].buffer = "scratch.h"
    rejects(parts, "graph 'decode_b4' tuned binding 'scratch.h': not a tuned buffer")


def test_tuned_binding_producer_not_in_tuning_catalog(parts) -> None:
    parts.add_tuned().producer = "ghost"
    rejects(parts, "graph 'decode_b4' tuned binding 'tuned.table': producer 'ghost' is not in the tuning catalog")


def test_tuned_binding_not_declared_as_producer_output(parts) -> None:
    parts.add_tuned()
    del parts.execution.tuning[0].outputs[:]
    rejects(
        parts,
        "graph 'decode_b4' tuned binding 'tuned.table': producer 'tune_table' does not declare it as an output",
    )


def test_tuning_producer_without_program(parts) -> None:
    parts.add_tuned()
    del parts.execution.tuning_programs[:]
    rejects(parts, "tuning producer 'tune_table' has no program in the tuning catalog")


def test_tuned_binding_naming_a_request_input_is_rejected(parts) -> None:
    # A transport entry is never a TUNED buffer, so a tuned binding to a request input fails as such.
    parts.add_tuned().buffer = "temperature"
    parts.execution.tuning[0].outputs.append("temperature")
    rejects(parts, "graph 'decode_b4' tuned binding 'temperature': not a tuned buffer")


def test_tuned_binding_overlapping_writable_state(parts) -> None:
    parts.add_tuned()
    parts.model.state_views.add(name="tuned_view", buffer="tuned.table", byte_extent=4)
    parts.graph("prefill_p16").state_accesses.add(view="tuned_view", mode=ct.ACCESS_MODE_WRITE)
    rejects(parts, "graph 'decode_b4' tuned binding 'tuned.table': overlaps writable graph state")


def test_tuned_buffer_readable_through_a_state_view_validates(parts) -> None:
    parts.add_tuned()
    parts.model.state_views.add(name="tuned_view", buffer="tuned.table", byte_extent=4)
    parts.graph("prefill_p16").state_accesses.add(view="tuned_view", mode=ct.ACCESS_MODE_READ)
    parts.prepare()


def test_tuned_binding_overlapping_cache_storage(parts) -> None:
    parts.add_tuned()
    parts.model.cache.regions.add(name="continuation", kind=ct.HISTORY_KIND_CONTINUATION, planes=["tuned.table"])
    rejects(parts, "graph 'decode_b4' tuned binding 'tuned.table': overlaps cache storage")


def test_tuned_bindings_need_version_2(parts) -> None:
    parts.model.version = 1
    parts.add_tuned()
    rejects(parts, "graph 'decode_b4': tuned bindings need contract version 2 or later")


# --------------------------------------------------------------------------- cursor, RNG


def test_cursor_lag_validates_in_version_3(parts) -> None:
    parts.graph("decode_b4").cursor.lag_tokens = 1
    parts.prepare()


@pytest.mark.parametrize("version", [1, 2])
def test_cursor_lag_needs_version_3(parts, version: int) -> None:
    parts.model.version = version
    parts.graph("decode_b4").cursor.lag_tokens = 1
    rejects(parts, "graph 'decode_b4': completion-cursor lag needs contract version 3")


def test_rng_reservation_names_a_stream(parts) -> None:
    parts.graph("decode_b4").rng_reservations[0].stream = ""
    rejects(parts, "graph 'decode_b4': an RNG reservation names no stream")


# --------------------------------------------------------------------------- program nodes


def test_node_declared_twice(parts) -> None:
    parts.node("decode_b4", "embedding").name = "load_pending_token"
    rejects(parts, "program 'decode_b4' node 'load_pending_token' is declared twice")


def test_node_depends_on_a_later_node(parts) -> None:
    parts.node("decode_b4", "load_pending_token").depends_on.append("embedding")
    rejects(
        parts,
        "program 'decode_b4' node 'load_pending_token' depends on 'embedding', which does not precede it",
    )


def test_node_depends_on_an_earlier_node_validates(parts) -> None:
    parts.node("decode_b4", "embedding").depends_on.append("load_pending_token")
    parts.prepare()


def test_node_missing_a_required_argument(parts) -> None:
    node = parts.node("decode_b4", "l0.attn_norm")
    del node.args[[a.name for a in node.args].index("weight")]
    rejects(parts, "program 'decode_b4' node 'l0.attn_norm' (rmsnorm) lacks arguments ['weight']")


def test_node_with_unknown_argument(parts) -> None:
    node = parts.node("decode_b4", "l0.attn_norm")
    node.args.add(name="bias", view=mf.BufferView(buffer="blk.0.attn_norm.weight", shape=[32]))
    rejects(parts, "program 'decode_b4' node 'l0.attn_norm' (rmsnorm) has unknown arguments ['bias']")


def test_node_missing_an_attribute(parts) -> None:
    del parts.node("decode_b4", "l0.attn_norm").attributes[:]
    rejects(parts, "program 'decode_b4' node 'l0.attn_norm' (rmsnorm) lacks attributes ['eps']")


def test_node_view_past_the_end_of_its_buffer(parts) -> None:
    parts.arg("decode_b4", "l0.attn_norm", "weight").view.element_offset = 1
    rejects(
        parts,
        "program 'decode_b4' node 'l0.attn_norm' argument 'weight' reads past the end of 'blk.0.attn_norm.weight'",
    )


def test_node_view_past_the_end_of_a_transport_entry(parts) -> None:
    parts.arg("prefill_p16", "embedding", "ids").view.shape[:] = [17]
    rejects(parts, "program 'prefill_p16' node 'embedding' argument 'ids' reads past the end of 'input_ids'")


def test_node_view_names_unknown_buffer(parts) -> None:
    parts.arg("decode_b4", "l0.attn_norm", "weight").view.buffer = "ghost"
    rejects(parts, "program 'decode_b4' node 'l0.attn_norm' argument 'weight' names unknown buffer 'ghost'")


def test_tuning_program_nodes_are_checked(parts) -> None:
    parts.add_tuned()
    node = parts.execution.tuning_programs[0].nodes.add(name="fill", op=mf.OpRef(name="rmsnorm", version=1))
    node.attributes.add(name="eps", float_value=1e-5)
    rejects(parts, "program 'tune_table' node 'fill' (rmsnorm) lacks arguments ['out', 'weight', 'x']")


def test_launch_names_unknown_module(parts) -> None:
    parts.node("decode_b4", "l0.attn_norm").launches.add(target="sm_90a", module="ghost", symbol="rmsnorm")
    rejects(parts, "program 'decode_b4' node 'l0.attn_norm': launch names unknown module 'ghost'")


def test_launch_on_a_module_validates(parts) -> None:
    add_module_resource(parts)
    parts.execution.modules.add(name="kernels", target="sm_90a", resource_id="kernels")
    launch = parts.node("decode_b4", "l0.attn_norm").launches.add(
        target="sm_90a", module="kernels", symbol="k", grid=[4, 1, 1], block=[128, 1, 1], programmatic_wait=True
    )
    launch.params.add(kind=mf.PARAM_KIND_ADDRESS, buffer="scratch.h")
    launch.params.add(kind=mf.PARAM_KIND_ADDRESS, buffer="positions")
    launch.params.add(kind=mf.PARAM_KIND_ADDRESS)  # an unused compiler scratch pointer: null
    parts.prepare()


def test_launch_needs_three_grid_and_block_dimensions(parts) -> None:
    add_module_resource(parts)
    parts.execution.modules.add(name="kernels", target="sm_90a", resource_id="kernels")
    parts.node("decode_b4", "l0.attn_norm").launches.add(target="sm_90a", module="kernels", symbol="k", grid=[4])
    rejects(parts, "program 'decode_b4' node 'l0.attn_norm': a launch needs three grid and three block dimensions")


def test_launch_block_holds_at_most_1024_threads(parts) -> None:
    add_module_resource(parts)
    parts.execution.modules.add(name="kernels", target="sm_90a", resource_id="kernels")
    parts.node("decode_b4", "l0.attn_norm").launches.add(
        target="sm_90a", module="kernels", symbol="k", grid=[1, 1, 1], block=[1024, 2, 1]
    )
    rejects(parts, "program 'decode_b4' node 'l0.attn_norm': launch block [1024, 2, 1] must hold 1 to 1024 threads")


def test_launch_target_must_match_its_module(parts) -> None:
    add_module_resource(parts)
    parts.execution.modules.add(name="kernels", target="sm_90a", resource_id="kernels")
    parts.node("decode_b4", "l0.attn_norm").launches.add(target="sm_80", module="kernels", symbol="k")
    rejects(parts, "program 'decode_b4' node 'l0.attn_norm': module 'kernels' is built for sm_90a, not sm_80")


def test_launch_parameter_names_unknown_buffer(parts) -> None:
    add_module_resource(parts)
    parts.execution.modules.add(name="kernels", target="sm_90a", resource_id="kernels")
    launch = parts.node("decode_b4", "l0.attn_norm").launches.add(target="sm_90a", module="kernels", symbol="k")
    launch.params.add(kind=mf.PARAM_KIND_ADDRESS, buffer="ghost")
    rejects(parts, "program 'decode_b4' node 'l0.attn_norm': launch parameter names unknown buffer 'ghost'")


# --------------------------------------------------------------------------- serving metadata


def test_served_name_must_be_set(parts) -> None:
    parts.serving.served_name = ""
    rejects(parts, "served_name is empty")


def test_aliases_must_be_distinct(parts) -> None:
    parts.serving.aliases.extend(["tiny", "tiny"])
    rejects(parts, "served_name and aliases must be distinct")


def test_alias_must_differ_from_served_name(parts) -> None:
    parts.serving.aliases.append(parts.serving.served_name)
    rejects(parts, "served_name and aliases must be distinct")


@pytest.mark.parametrize("field", ["context_tokens", "prefill_tokens", "max_concurrency"])
def test_serving_capacities_must_be_positive(parts, field: str) -> None:
    setattr(parts.serving, field, 0)
    rejects(parts, f"{field} must be positive")


def test_eos_token_ids_must_be_declared(parts) -> None:
    del parts.serving.defaults.eos_token_ids[:]
    rejects(parts, "defaults.eos_token_ids must name at least one token")


# --------------------------------------------------------------------------- runtime support


def test_operator_with_unknown_name_is_a_runtime_question(parts) -> None:
    parts.node("decode_b4", "l0.attn_norm").op.name = "fancy_norm"
    unsupported(parts, "program 'decode_b4' node 'l0.attn_norm' uses operator fancy_norm version 1 (unknown operator)")


def test_operator_with_unknown_version_is_a_runtime_question(parts) -> None:
    parts.node("decode_b4", "l0.attn_norm").op.version = 7
    unsupported(parts, "program 'decode_b4' node 'l0.attn_norm' uses operator rmsnorm version 7 (known versions: [1])")


def _window_attention(parts, window: int | None) -> None:
    """Set (or, with None, remove) the window attribute of every attention node."""
    for program in parts.execution.programs:
        for node in program.nodes:
            if node.op.name == "paged_attention":
                kept = [a for a in node.attributes if a.name != "window"]
                del node.attributes[:]
                node.attributes.extend(kept)
                if window is not None:
                    node.attributes.add(name="window", int_value=window)


def test_a_sliding_window_history_is_implemented(parts) -> None:
    region = parts.region("kv")
    region.kind = ct.HISTORY_KIND_SLIDING_WINDOW
    region.window_tokens = 16
    _window_attention(parts, 16)
    check_runtime_support(parts.prepare(), RuntimeCapabilities())


@pytest.mark.parametrize(("window", "shown"), [(None, 0), (0, 0), (17, 17)])
def test_attention_over_a_sliding_window_must_stay_inside_it(parts, window: int | None, shown: int) -> None:
    region = parts.region("kv")
    region.kind = ct.HISTORY_KIND_SLIDING_WINDOW
    region.window_tokens = 16
    _window_attention(parts, window)
    rejects(
        parts,
        f"program 'decode_b1' node 'l0.attention': attention over sliding-window region 'kv' has window {shown}, "
        "which must lie in [1, 16]",
    )


def test_a_sliding_window_region_with_planes_checks_them_as_cache_planes(parts) -> None:
    region = parts.region("kv")
    region.kind = ct.HISTORY_KIND_SLIDING_WINDOW
    region.window_tokens = 16
    _window_attention(parts, 16)
    region.planes.append("scratch.h")
    rejects(parts, "history region 'kv' names 'scratch.h', which is not a cache plane")


def test_a_runtime_without_a_history_kind_refuses_it(parts) -> None:
    parts.region("kv").kind = ct.HISTORY_KIND_PAGED_LATENT
    check_runtime_support(parts.prepare(), RuntimeCapabilities())
    capabilities = RuntimeCapabilities(
        history_kinds=RuntimeCapabilities().history_kinds - {ct.HISTORY_KIND_PAGED_LATENT}
    )
    with pytest.raises(UnsupportedFeatureError) as caught:
        check_runtime_support(parts.prepare(), capabilities)
    assert str(caught.value) == (
        "history region 'kv' has kind HISTORY_KIND_PAGED_LATENT, which this runtime does not implement yet"
    )


def test_paged_latent_page_tokens_must_hold_whole_records(parts) -> None:
    region = parts.region("kv")
    region.kind = ct.HISTORY_KIND_PAGED_LATENT
    region.tokens_per_record = 3
    rejects(parts, "history region 'kv': page_tokens 4 is not a multiple of its tokens_per_record 3")


def test_paged_latent_planes_hold_one_record_per_tokens_per_record(parts) -> None:
    region = parts.region("kv")
    region.kind = ct.HISTORY_KIND_PAGED_LATENT
    region.tokens_per_record = 2
    plane = region.planes[0]
    rejects(
        parts,
        f"cache plane {plane!r} of paged-latent region 'kv': its second dimension must be 2 records a page "
        "(page_tokens 4 / tokens_per_record 2), not 4",
    )


def test_page_table_views_over_one_entry_must_not_overlap(parts) -> None:
    view = parts.model.cache.page_table_views[0]
    view.pages_per_row = 8
    parts.model.cache.page_table_views.add(buffer=view.buffer, page_offset=7, region=view.region, pages_per_row=9)
    rejects(parts, f"page-table views over {view.buffer!r} overlap: columns 0..8 and 7..16")


def test_more_ranks_than_the_runtime_has(parts) -> None:
    parts.execution.ranks = 2
    check_runtime_support(parts.prepare(), RuntimeCapabilities())  # thread ranks: any count
    with pytest.raises(UnsupportedFeatureError) as caught:
        check_runtime_support(parts.prepare(), RuntimeCapabilities(ranks=1))
    assert str(caught.value) == "the core needs 2 tensor-parallel ranks; this runtime has 1"
    check_runtime_support(parts.prepare(), RuntimeCapabilities(ranks=2))


def test_speculative_operation_is_supported_and_a_runtime_without_it_refuses(parts) -> None:
    parts.add_speculative()
    check_runtime_support(parts.prepare(), RuntimeCapabilities())
    without = RuntimeCapabilities().operations - {ct.OPERATION_SPECULATIVE}
    with pytest.raises(UnsupportedFeatureError) as caught:
        check_runtime_support(parts.prepare(), RuntimeCapabilities(operations=without))
    assert "graph 'speculative_w4' has operation speculative, which this runtime does not implement yet" in str(
        caught.value
    )


# --------------------------------------------------------------------------- malformed declarations


@pytest.mark.parametrize(
    "breakage",
    [
        "state buffer empty shape",
        "state buffer unknown dtype",
        "cache plane empty shape",
        "bound entry empty shape",
    ],
)
def test_malformed_declarations_are_reported_not_crashed(parts, breakage: str) -> None:
    if breakage == "state buffer empty shape":
        parts.buffer("pending_tokens").ClearField("shape")
    elif breakage == "state buffer unknown dtype":
        parts.buffer("pending_tokens").dtype = 77
    elif breakage == "cache plane empty shape":
        parts.buffer("cache.k0").ClearField("shape")
    else:
        parts.entry("temperature").ClearField("shape")
    with pytest.raises(ContractError):
        parts.prepare()


def test_nodes_of_unknown_operators_still_have_their_views_checked(parts) -> None:
    node = parts.execution.programs[0].nodes.add(name="future")
    node.op.name = "future_op"
    node.op.version = 1
    node.args.add(name="x").view.buffer = "no_such_buffer"
    rejects(parts, "argument 'x' names unknown buffer 'no_such_buffer'")


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda p: setattr(p.buffer("scratch.h"), "role", 99), "buffer 'scratch.h' has unknown role 99"),
        (lambda p: setattr(p.model.cache.regions[0], "kind", 42), "history region 'kv' has unknown kind 42"),
        (
            lambda p: setattr(p.graph("decode_b4").bindings[0], "indexing", 9),
            "graph 'decode_b4' binding 'state_rows': unknown indexing 9",
        ),
        (
            lambda p: setattr(p.graph("decode_b4").state_accesses[0], "mode", 7),
            "graph 'decode_b4': access to 'prompt_presence' has unknown mode 7",
        ),
        (
            lambda p: setattr(p.execution.completion[0], "field", 500),
            "completion record 'out_sampled_ids' has unknown field 500",
        ),
        (
            lambda p: setattr(p.execution.completion[0], "buffer", "scratch.h"),
            "completion record names 'scratch.h', which is not a completion buffer",
        ),
        (
            lambda p: setattr(p.buffer("scratch.h").shape[0], "symbol", 17),
            "buffer 'scratch.h' has an unknown dimension symbol",
        ),
    ],
)
def test_unknown_enum_numbers_are_rejected(parts, mutate, message: str) -> None:
    mutate(parts)
    rejects(parts, message)


def test_image_sentinel_inside_the_sampled_range_is_rejected(parts) -> None:
    parts.model.input_vocabulary.image_sentinel_ids.append(5)
    rejects(parts, "input_vocabulary: image sentinel 5 lies inside the sampled range [0, 259)")


def test_plugin_parameters_for_built_in_implementations_are_unknown_fields(parts) -> None:
    parts.model.frontend.plugin_parameters_json = '{"window": 4}'
    rejects(parts, "frontend.plugin_parameters_json has unknown fields ['window']")


def test_plugin_parameters_are_left_to_a_selected_third_party_plugin(parts) -> None:
    parts.model.frontend.tool_parser = 100_001
    parts.model.frontend.ClearField("tool_syntax")
    parts.model.frontend.plugin_parameters_json = '{"window": 4}'
    parts.prepare()
