"""Scratch: profile a speculative b1 run's worker thread (not part of the project)."""
import cProfile, pstats, sys, time, io, os
from pathlib import Path
sys.argv = [sys.argv[0]]
ROOT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(ROOT / "contrib" / "ignition"), str(ROOT / "benchmarks")]
import speculative as sp, gpu_decode
from helios_core.runtime import engine as engine_mod

cores = Path(os.environ.get("CORES", "build/cores"))
plan = sp.make_plan(sp.parse_args(["--shapes", os.environ.get("SHAPE","1b"), "--batches", os.environ.get("BATCHES", "1,8"), *os.environ.get("EXTRA","").split()]))
signing, public = gpu_decode.keys_in(cores)
spec = sp.core_specs(plan, cores, signing)[0]
STATE = {"prof": None}
orig = engine_mod.Engine._step
def wrapped(self):
    prof = STATE["prof"]
    if prof is None:
        return orig(self)
    prof.enable()
    try:
        return orig(self)
    finally:
        prof.disable()
engine_mod.Engine._step = wrapped
import json
workload = json.load(open(os.environ["WORKLOAD"])) if os.environ.get("WORKLOAD") else None
for drafting in (False, True):
    running = sp._start(spec, public, plan, drafting=drafting)
    engine = running.engine
    vocab = running.verified.contract.sampled_size
    if workload is None:
        prompts = sp.random_prompts(plan.max_rows, plan.prompt, vocab, plan.seed + 17)
        out = gpu_decode.collect([engine.submit(r) for r in sp._requests("c", prompts, plan.tokens)], 120)
        workload = sp.repeating_workload(prompts, [r.tokens for r in out])
    gpu_decode.collect([engine.submit(r) for r in sp._requests("w", workload[:1], 8)], 60)
    b = int(os.environ.get("B", "1"))
    prof = STATE["prof"] = cProfile.Profile()
    t0 = time.perf_counter()
    before = sp.speculation_totals(engine.statistics())
    out = gpu_decode.collect([engine.submit(r) for r in sp._requests("m", workload[:b], plan.tokens)], 120)
    dt = time.perf_counter() - t0
    s = sp.speculation_summary(before, sp.speculation_totals(engine.statistics()))
    print(f"drafting={drafting} b={b}: {dt*1000:.1f} ms total for {plan.tokens} tokens: {dt*1000/plan.tokens:.3f} ms/token; {s}")
    STATE["prof"] = None
    gpu_decode._close(running, False)
    st = io.StringIO()
    pstats.Stats(prof, stream=st).sort_stats("tottime").print_stats(35)
    print(st.getvalue()[:9000])
