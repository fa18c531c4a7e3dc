"""Startup: from a core path and operator options to a running engine.

Owns the order of startup: open and verify the core (``loading.open_core``),
load the frontend assets (``Bootstrap.load``), select capacities and programs
(``contract.select``), load the native model (runtime support, physical
capacities, every program built once) and start the model worker. Every
failure is a HeliosError that names what failed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from helios_core.contract import LoadOptions, select
from helios_core.frontend.bootstrap import Bootstrap
from helios_core.frontend.structured import GrammarCompiler
from helios_core.loading import TrustSettings, VerifiedCore, open_core
from helios_core.runtime.engine import Engine
from helios_core.runtime.native_model import NativeModel


@dataclass
class RunningModel:
    """Everything a served core holds, in ownership order."""

    verified: VerifiedCore
    bootstrap: Bootstrap
    model: NativeModel
    engine: Engine
    grammar_compiler: GrammarCompiler
    """The one structured-output compiler of this core's tokenizer, shared by preparation and the worker."""

    def close(self) -> None:
        """Stop the worker, release the model, close the core file."""
        try:
            self.engine.shutdown()
        finally:
            self.verified.close()


def start(path: Path, settings: TrustSettings, options: LoadOptions, *, backend: str = "auto") -> RunningModel:
    """Verify, load and start serving ``path``."""
    verified = open_core(path, settings, check_resources=False)
    try:
        bootstrap = Bootstrap.load(verified.core, verified.contract)
        selection = select(verified.contract, options)
        model = NativeModel.load(
            verified.core,
            verified.contract,
            selection,
            backend=backend,
            cache_pages=options.cache_pages,
            offload_pages=options.offload_pages,
            ranks=options.ranks,
            offload_checkpoints=options.offload_checkpoints,
        )
        try:
            contract = verified.contract
            grammar_compiler = GrammarCompiler(
                bootstrap.tokenizer,
                sampled_size=contract.sampled_size,
                logits_width=contract.logits_width,
                eos_token_ids=contract.eos_token_ids,
            )
            engine = Engine(model, bootstrap.tokenizer, grammar_compiler)
        except BaseException:
            model.close()  # a GPU backend holds device memory and its context until closed
            raise
    except BaseException:
        verified.close()
        raise
    return RunningModel(verified, bootstrap, model, engine, grammar_compiler)
