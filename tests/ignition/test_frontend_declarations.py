"""Ignition's frontend declarations validate in a contract and resolve to built-in plugins."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from ignition.preparation import frontend as declarations

from helios_core.container.keys import TrustStore
from helios_core.container.reader import CoreFile
from helios_core.contract import prepare_contract
from helios_core.errors import ContractError
from helios_core.plugins.host import PluginHost
from helios_core.wire import contract_pb2 as ct

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "cores"

FAMILIES: dict[str, Callable[[], ct.FrontendContract]] = {
    "function_tags": declarations.function_tags,
    "argument_tags": declarations.argument_tags,
    "dsml": declarations.dsml,
    "json_tags": declarations.json_tags,
    "xtml": declarations.xtml,
    "recipient_header": declarations.recipient_header,
}


@pytest.fixture(scope="module")
def host() -> PluginHost:
    plugins = PluginHost(autoload=False)
    plugins.start()
    return plugins


def _validate(frontend: ct.FrontendContract) -> None:
    with CoreFile.open(
        FIXTURES / "payload-v3.core", TrustStore.from_paths([FIXTURES / "keys" / "signing.pub.pem"])
    ) as core:
        serving = ct.ServingContract()
        serving.CopyFrom(core.contract)
        serving.model.frontend.CopyFrom(frontend)
        prepare_contract(serving, core.execution, list(core.resources.values()))


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("reasoning", [False, True])
def test_each_family_validates_and_resolves(family: str, reasoning: bool, host: PluginHost) -> None:
    frontend = FAMILIES[family]()
    if reasoning and frontend.reasoning_parser == ct.REASONING_PARSER_NONE:
        frontend = declarations.with_think_tags(frontend, terminal=family in ("function_tags", "json_tags"))
    _validate(frontend)
    selected = host.resolve(frontend)
    assert (selected.tool_parser.identifier, selected.reasoning_parser.identifier) == (
        frontend.tool_parser,
        frontend.reasoning_parser,
    )
    assert selected.tool_parser.plugin == selected.reasoning_parser.plugin == "helios"


def test_a_terminal_marker_must_be_the_tool_opener() -> None:
    frontend = declarations.with_think_tags(declarations.json_tags(), terminal=True)
    frontend.reasoning_syntax.terminal_marker = "<other>"
    with pytest.raises(ContractError, match="must equal the tool syntax's opener"):
        _validate(frontend)
