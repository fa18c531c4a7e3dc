"""bfloat16 key and value cache planes: the reference kernels, the build option, the lowering, a served core.

The reference kernels store bfloat16 planes as uint16 bit patterns, rounded to nearest even on write and
widened exactly on read; ``ignition build --cache-dtype bf16`` declares the planes and their snapshot rows
in bfloat16, the sm_90a attention kernels take them (and refuse planes of two types), and a core so built
serves on the reference backend: after the same prompt its first layer's planes hold exactly the rounded
values the float32-cache core holds (the first layer's keys and values do not depend on the cache).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from ignition.cli import main as ignition_main
from ignition.recipes.llama import Capacities

from helios_core.backends import reference_kernels as rk
from helios_core.container.keys import generate_keys
from helios_core.contract import LoadOptions
from helios_core.loading import TrustSettings, open_core
from helios_core.runtime.messages import Finished, PreparedRequest, SamplingParams
from helios_core.runtime.startup import start
from helios_core.wire import manifest_pb2 as mf

NAMESPACE = "helios-tests/cache-dtype"


def test_float32_to_bf16_bits_rounds_to_nearest_even() -> None:
    step = 2.0**-7  # one bfloat16 step at 1.0
    values = np.array([1.0, 1.0 + step / 2, 1.0 + 3 * step / 2, 1.0 + step / 2 + 2.0**-20, -2.5, 0.0], np.float32)
    widened = rk.bf16_bits_to_float32(rk.float32_to_bf16_bits(values))
    np.testing.assert_array_equal(widened, [1.0, 1.0, 1.0 + 2 * step, 1.0 + step, -2.5, 0.0])


def test_bf16_planes_round_on_write_and_attend_as_their_widened_values() -> None:
    rng = np.random.default_rng(3)
    pages, page_tokens, kv_heads, head_dim, tokens = 6, 4, 2, 8, 9
    k16 = np.zeros((pages, page_tokens, kv_heads, head_dim), np.uint16)
    v16 = np.zeros_like(k16)
    keys = rng.standard_normal((tokens, kv_heads, head_dim)).astype(np.float32)
    values = rng.standard_normal((tokens, kv_heads, head_dim)).astype(np.float32)
    table = np.array([[4, 1, 5]], np.int32)
    positions = np.arange(tokens, dtype=np.int32)
    slots = (table[0, positions // page_tokens] * page_tokens + positions % page_tokens).astype(np.int64)
    rk.kv_cache_write(k16, v16, keys, values, slots)
    stored = k16.reshape(-1, kv_heads, head_dim)[slots]
    np.testing.assert_array_equal(stored, rk.float32_to_bf16_bits(keys))
    k32, v32 = rk.bf16_bits_to_float32(k16), rk.bf16_bits_to_float32(v16)
    q = rng.standard_normal((tokens, 4, head_dim)).astype(np.float32)
    rows = np.zeros(tokens, np.int32)
    got = rk.paged_attention(q, k16, v16, table, rows, positions, 0.3)
    want = rk.paged_attention(q, k32, v32, table, rows, positions, 0.3)
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="equal float"):
        rk.paged_attention(q, k16, v32, table, rows, positions, 0.3)


def test_capacities_refuse_an_unknown_cache_dtype() -> None:
    with pytest.raises(ValueError, match="cache_dtype must be one of f32, bf16, got 'f16'"):
        Capacities(cache_dtype="f16")


def test_the_attention_lowering_takes_bf16_planes_and_refuses_mixed_ones() -> None:
    pytest.importorskip("triton")
    from ignition.kernels.lowering import LoweringError

    from tests.gpu.harness import lower

    arrays = {
        "q": np.zeros((8, 8, 64), np.float32),
        "k_plane": np.zeros((16, 16, 2, 64), np.uint16),
        "v_plane": np.zeros((16, 16, 2, 64), np.uint16),
        "page_table": np.zeros((8, 16), np.int32),
        "token_row": np.zeros(8, np.int32),
        "token_position": np.zeros(8, np.int32),
        "out": np.zeros((8, 8, 64), np.float32),
    }
    context, (launch,) = lower("paged_attention", arrays, {"scale": 0.125})
    assert launch.symbol == "attention_split_kernel"
    (module,) = context.modules.values()
    assert module.data[:4] == b"\x7fELF"
    mixed = {**arrays, "v_plane": np.zeros((16, 16, 2, 64), np.float32)}
    with pytest.raises(LoweringError, match="k_plane and v_plane must both be float32 or both bfloat16"):
        lower("paged_attention", mixed, {"scale": 0.125})


def _build(folder: Path, cache_dtype: str, keys: dict[str, Path]) -> Path:
    out = folder / f"{cache_dtype}.core"
    argv = ["build", "llama-synthetic", "--out", str(out), "--shape", "tiny", "--quiet", "--seed", "5"]
    argv += ["--sign-key", str(keys["signing"]), "--namespace", NAMESPACE, "--cache-dtype", cache_dtype]
    argv += ["--max-rows", "2", "--page-tokens", "4", "--cache-pages", "32", "--context", "64"]
    assert ignition_main(argv) == 0
    return out


def test_a_bf16_cache_core_declares_and_serves_bf16_planes(tmp_path: Path) -> None:
    keys = generate_keys(tmp_path / "keys")
    trust = TrustSettings((keys["public"],), NAMESPACE, None)
    cores = {dtype: _build(tmp_path, dtype, keys) for dtype in ("f32", "bf16")}
    core = open_core(cores["bf16"], trust, check_resources=False)
    try:
        buffers = core.contract.execution.buffers
        planes = {b.name: b.dtype for b in buffers if b.role == mf.BUFFER_ROLE_CACHE_PLANE}
        rows = {b.name: b.dtype for b in buffers if b.name.startswith("continuation.")}
    finally:
        core.close()
    plain = open_core(cores["f32"], trust, check_resources=False)
    try:
        identities = {core.contract.serving.cache_identity, plain.contract.serving.cache_identity}
    finally:
        plain.close()
    assert len(identities) == 2  # the cached values differ: prefixes and snapshots do not cross over
    assert planes and set(planes.values()) == {mf.DTYPE_BF16}
    assert rows and set(rows.values()) == {mf.DTYPE_BF16}
    first_layer: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for dtype, path in cores.items():
        running = start(path, trust, LoadOptions(max_active=2), backend="reference")
        try:
            prompt = list(range(3, 30))
            request = PreparedRequest("r", prompt, 6, SamplingParams(temperature=0.0), ignore_eos=True)
            events = list(running.engine.submit(request))
            assert isinstance(events[-1], Finished)
            buffers_now = running.model.backend.buffers  # type: ignore[attr-defined]
            first_layer[dtype] = (np.array(buffers_now["cache.k0"]), np.array(buffers_now["cache.v0"]))
        finally:
            running.close()
    k16, v16 = first_layer["bf16"]
    k32, v32 = first_layer["f32"]
    assert k16.dtype == np.uint16 and k32.dtype == np.float32
    assert np.count_nonzero(k32) > 0
    np.testing.assert_array_equal(k16, rk.float32_to_bf16_bits(k32))
    np.testing.assert_array_equal(v16, rk.float32_to_bf16_bits(v32))


def test_recipes_without_key_value_planes_refuse_the_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["build", "recurrent-synthetic", "--out", str(tmp_path / "r.core"), "--quiet", "--cache-dtype", "bf16"]
    assert ignition_main(argv) == 1
    assert capsys.readouterr().err == "ignition: error: recurrent-synthetic does not take --cache-dtype bf16\n"


def test_bf16_planes_take_two_bf16_products_where_float32_planes_take_three_tf32_ones(tmp_path: Path) -> None:
    """The sm_90a attention multiplies bf16 keys and values as they are (module docstring of
    ``ignition.kernels.attention``): a third of the matrix instructions of the TF32 form."""
    pytest.importorskip("triton")
    import glob
    import subprocess

    import triton

    from tests.gpu.harness import lower

    tools = glob.glob(str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"))
    if not tools:
        pytest.skip("nvdisasm is not shipped with this triton")
    counts = {}
    for plane in (np.float32, np.uint16):
        arrays = {
            "q": np.zeros((256, 32, 64), np.float32),
            "k_plane": np.zeros((64, 16, 8, 64), plane),
            "v_plane": np.zeros((64, 16, 8, 64), plane),
            "page_table": np.zeros((256, 64), np.int32),
            "token_row": np.zeros(256, np.int32),
            "token_position": np.zeros(256, np.int32),
            "out": np.zeros((256, 32, 64), np.float32),
        }
        context, _ = lower("paged_attention", arrays, {"scale": 0.125})
        (module,) = context.modules.values()
        cubin = tmp_path / f"{np.dtype(plane).name}.cubin"
        cubin.write_bytes(module.data)
        sass = subprocess.run([tools[0], str(cubin)], capture_output=True, text=True, check=True).stdout
        words = [word for line in sass.splitlines() for word in line.split()]
        counts[np.dtype(plane).name] = (
            sum(word.startswith("HMMA") and word.endswith(".BF16") for word in words),
            sum(word.startswith("HMMA") and word.endswith(".TF32") for word in words),
        )
    bf16_products, tf32_products = counts["float32"]
    assert bf16_products == 0 and tf32_products > 0
    bf16_products, tf32_products_of_bf16 = counts["uint16"]
    assert tf32_products_of_bf16 == 0
    # each product: three TF32 instructions of k = 8 against two bf16 ones of k = 16
    assert bf16_products * 3 == tf32_products
