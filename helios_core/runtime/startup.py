"""Startup: from a core path and operator options to a running engine.

Owns the order of startup: open and verify the core (``loading.open_core``),
select capacities and programs (``contract.select``), load the native model
(runtime support, physical capacities, every program built once) while the
frontend assets (``Bootstrap.load``) and the structured-output compiler are
built beside it on a thread of their own, and start the model worker. Every
failure is a HeliosError that names what failed; when several steps fail, the
one that comes first in the order above is raised (the frontend assets before
the selection and the native model, the structured-output compiler after them).
"""

from __future__ import annotations

import gc
import threading
from dataclasses import dataclass
from pathlib import Path

from helios_core.container import CoreFile
from helios_core.contract import LoadOptions, PreparedContract, select
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
    worker_load_seconds: float | None = None
    """With the model worker in its own process: how long that process took from its start to ready
    (measured there); None when the worker is a thread of this process."""

    def close(self) -> None:
        """Stop the worker, release the model, close the core file, and let the collector see what
        startup froze again."""
        try:
            self.engine.shutdown()
        finally:
            self.verified.close()
            gc.unfreeze()


class FrontendBuild:
    """Builds the frontend assets and the structured-output compiler of a core on a thread of its own.

    Both read only the core's tokenizer and chat template and the contract, so they run while the
    native model loads. :meth:`result` waits and returns them, or raises what failed.
    """

    def __init__(self, core: CoreFile, contract: PreparedContract) -> None:
        self._core = core
        self._contract = contract
        self.bootstrap: Bootstrap | None = None
        self.grammar_compiler: GrammarCompiler | None = None
        self.bootstrap_failure: BaseException | None = None
        """What ``Bootstrap.load`` raised (the compiler is then not built)."""
        self.grammar_failure: BaseException | None = None
        """What building the structured-output compiler raised."""
        self._thread = threading.Thread(target=self._build, name="helios-frontend-build", daemon=True)
        self._thread.start()

    def _build(self) -> None:
        contract = self._contract
        try:
            self.bootstrap = Bootstrap.load(self._core, contract)
        except BaseException as exc:
            self.bootstrap_failure = exc
            return
        try:
            self.grammar_compiler = GrammarCompiler(
                self.bootstrap.tokenizer,
                sampled_size=contract.sampled_size,
                logits_width=contract.logits_width,
                eos_token_ids=contract.eos_token_ids,
            )
        except BaseException as exc:
            self.grammar_failure = exc

    def join(self) -> None:
        """Wait until the build ended (it reads the core file: join before closing it)."""
        self._thread.join()

    def raise_bootstrap_failure(self) -> None:
        """Wait, then raise what ``Bootstrap.load`` raised, if it failed."""
        self.join()
        if self.bootstrap_failure is not None:
            raise self.bootstrap_failure

    def result(self) -> tuple[Bootstrap, GrammarCompiler]:
        """Wait, then the frontend assets and the compiler, or raise what failed."""
        self.raise_bootstrap_failure()
        if self.grammar_failure is not None:
            raise self.grammar_failure
        if self.bootstrap is None or self.grammar_compiler is None:
            raise RuntimeError("the frontend build ended without its result")
        return self.bootstrap, self.grammar_compiler


def start(path: Path, settings: TrustSettings, options: LoadOptions, *, backend: str = "auto") -> RunningModel:
    """Verify, load and start serving ``path``."""
    verified = open_core(path, settings, check_resources=False)
    try:
        frontend = FrontendBuild(verified.core, verified.contract)
        try:
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
        except BaseException:
            frontend.raise_bootstrap_failure()  # a frontend asset that does not load is named first
            raise
        try:
            bootstrap, grammar_compiler = frontend.result()
            engine = Engine(model, bootstrap.tokenizer, grammar_compiler)
        except BaseException:
            model.close()  # a GPU backend holds device memory and its context until closed
            raise
    except BaseException:
        verified.close()
        raise
    keep_out_of_collections()
    return RunningModel(verified, bootstrap, model, engine, grammar_compiler)


def keep_out_of_collections() -> None:
    """Move every object alive now into the collector's permanent generation (``gc.freeze``).

    What startup built (the contract, the programs and their launches, the tokenizer) lives as long as
    the model; left in the oldest generation, every full pass of the cyclic collector would walk it,
    and such a pass runs on whichever thread allocates at that moment, the model worker's included,
    between two rounds. :meth:`RunningModel.close` gives the objects back (``gc.unfreeze``) so that
    what the closed model leaves behind can be collected. Freezing moves the collector's lists whole (no
    pass over the objects); garbage alive at that moment waits for the unfreeze."""
    gc.freeze()
