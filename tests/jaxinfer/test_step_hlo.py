"""What the compiled step does, read from XLA's optimized HLO (reference attention, CPU)."""

import re
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.experimental.layout import Format, Layout
from testpaths import FIXTURES

from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.loader import LoadedModel, load_model
from jaxinfer.models.registry import get_family
from jaxinfer.quant import QuantConfig
from jaxinfer.worker import kv_pool
from jaxinfer.worker.step_variants import plain_padding
from jaxinfer.worker.worker import Worker

CONFIG = ModelConfig(
    model_type="llama",
    family="llama",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=8192,
)


@pytest.fixture(scope="module")
def model():
    family = get_family("llama")
    params = family.init_params(CONFIG, jax.random.key(0))
    return LoadedModel(CONFIG, params, None, family, Path("random"))


def make_runner(model, num_steps: int = 1, **engine) -> Worker:
    config = EngineConfig(
        page_size=16,
        max_num_batched_tokens=8,
        max_num_seqs=8,
        token_buckets=(1, 8),
        penalties=False,
        compilation_cache_dir=None,
        num_decode_steps=num_steps,
        **engine,
    )
    return Worker(model, config, config.scheduler.max_model_len)


def compiled_step(model, bucket: int, num_steps: int = 1, **engine) -> tuple[str, Worker]:
    runner = make_runner(model, num_steps, **engine)
    inputs = runner.step.padding_inputs(bucket, False)
    return runner.step.lower(inputs, num_steps).compile().as_text(), runner


def cache_copies(hlo: str, cache_shape: tuple[int, ...], entry_only: bool = True) -> list[str]:
    """Copies (or copy-starts) of an array as large as a layer's cache: in the entry computation,
    or (entry_only=False) anywhere, loop bodies included."""
    size = int(np.prod(cache_shape))
    entry = hlo[hlo.index("\nENTRY") :] if entry_only else hlo
    found = []
    for line in entry.splitlines():
        m = re.search(r"= \w+\[([\d,]*)\]\S* (copy|copy-start)\(", line)
        if m and m.group(1) and int(np.prod([int(d) for d in m.group(1).split(",")])) == size:
            found.append(line.strip()[:120])
    return found


@pytest.mark.parametrize("max_model_len", [512, 8192])
@pytest.mark.parametrize("bucket", [1, 8])
def test_the_step_never_copies_a_layers_cache(model, max_model_len, bucket):
    """The cache is donated and updated in place: a decode step's cost follows the batch's
    contexts, not the pool (a one-token write used to copy every layer's cache each step)."""
    hlo, runner = compiled_step(model, bucket, max_model_len=max_model_len, num_pages=300)
    assert not cache_copies(hlo, runner.state.kv_caches[0].shape)


@pytest.mark.parametrize("max_model_len", [512, 8192])
def test_a_decode_window_never_copies_a_layers_cache(model, max_model_len):
    """Four decode steps in one call: the cache is carried through the loop and updated in place."""
    hlo, runner = compiled_step(model, 8, num_steps=4, max_model_len=max_model_len, num_pages=300)
    assert "while(" in hlo or "while (" in hlo
    assert not cache_copies(hlo, runner.state.kv_caches[0].shape, entry_only=False)


def split_computations(hlo: str) -> tuple[dict[str, str], str]:
    """{computation name: body} and the entry computation's name."""
    bodies, entry, name, lines = {}, None, None, []
    for line in hlo.splitlines():
        header = re.match(r"(ENTRY )?(%[\w.\-]+) .*\{$", line)
        if header and not line.startswith(" "):
            name, lines = header.group(2), []
            entry = name if header.group(1) else entry
        elif line == "}" and name is not None:
            bodies[name], name = "\n".join(lines), None
        elif name is not None:
            lines.append(line)
    return bodies, entry


def always_run(bodies: dict[str, str], entry: str) -> set[str]:
    """Computations the entry runs on every call: called, fused, looped, reduced, but not the
    branches of a conditional (those run only when taken)."""
    seen, todo = set(), [entry]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        body = re.sub(r"branch_computations=\{[^}]*\}|(true|false)_computation=%[\w.\-]+", "", bodies[name])
        todo += re.findall(r"(?:calls|to_apply|body|condition)=(%[\w.\-]+)", body)
        todo += [c for group in re.findall(r"calls=\{([^}]*)\}", body) for c in re.findall(r"%[\w.\-]+", group)]
    return seen


def vocab_sorts(body: str) -> list[str]:
    """Sorts of [B, V] rows, and top-k (the step's only top-k is over the vocabulary; XLA's TopK
    custom call shows only its [B, N] results on its line)."""
    vocab = CONFIG.vocab_size
    return [
        line.strip()[:120]
        for line in body.splitlines()
        if re.search(r'custom_call_target="TopK"|\btopk\(', line)
        or (re.search(r"\bsort\(", line) and re.search(rf"\[\d+,{vocab}\]", line))
    ]


def test_an_all_greedy_batch_without_logprobs_sorts_nothing(model):
    hlo, _ = compiled_step(model, 8, max_model_len=512, num_pages=64)
    bodies, entry = split_computations(hlo)
    assert any(vocab_sorts(body) for body in bodies.values())  # they exist, for rows that need them
    on_every_step = {name: vocab_sorts(bodies[name]) for name in always_run(bodies, entry)}
    assert not {name: found for name, found in on_every_step.items() if found}


def test_the_step_never_sorts_the_vocabulary(model):
    """Top-k and top-p bisect for their thresholds: the step's only vocabulary-wide selection is
    the top-N logprobs' TopK, under its conditional."""
    hlo, _ = compiled_step(model, 8, max_model_len=512, num_pages=64)
    found = [line for body in split_computations(hlo)[0].values() for line in vocab_sorts(body)]
    assert found and all(re.search(r'"TopK"|\btopk\(', line) for line in found), found


def test_an_all_greedy_decode_window_sorts_nothing(model):
    hlo, _ = compiled_step(model, 8, num_steps=4, max_model_len=512, num_pages=64)
    bodies, entry = split_computations(hlo)
    on_every_step = {name: vocab_sorts(bodies[name]) for name in always_run(bodies, entry)}
    assert not {name: found for name, found in on_every_step.items() if found}


def vocab_scatters(body: str) -> list[str]:
    """Scatters into a [B, V] array (the step's are the logit bias's; penalties are off here)."""
    return [
        line.strip()[:120]
        for line in body.splitlines()
        if re.search(r"\bscatter\(", line) and re.search(rf"\[\d+,{CONFIG.vocab_size}\]", line)
    ]


@pytest.mark.parametrize("num_steps", [1, 4])
def test_an_unbiased_batch_pays_nothing_for_logit_bias(model, num_steps):
    """The logit bias's [B, V] scatter is inside a conditional, taken only when a row has a bias."""
    hlo, _ = compiled_step(model, 8, num_steps=num_steps, max_model_len=512, num_pages=64)
    bodies, entry = split_computations(hlo)
    assert any(vocab_scatters(body) for body in bodies.values())  # it exists, for biased rows
    on_every_step = {name: vocab_scatters(bodies[name]) for name in always_run(bodies, entry)}
    assert not {name: found for name, found in on_every_step.items() if found}


@pytest.mark.parametrize("num_steps", [1, 4])
def test_the_greedy_twin_runs_no_conditional(model, num_steps):
    """The greedy twin of the decode step (greedy_variant; the window with windows on) has no
    conditional anywhere: on XLA:GPU each one copies its predicate to the host and holds the host
    until the device reaches it. The general step keeps them, for the rows that need them."""
    _, runner = compiled_step(model, 8, num_steps=num_steps, max_model_len=512, num_pages=64, greedy_variant=True)
    inputs = runner.step.padding_inputs(8, False)
    general = runner.step.lower(inputs, num_steps).compile().as_text()
    twin = runner.step.lower(plain_padding(inputs), num_steps).compile().as_text()
    conditionals = lambda hlo: re.findall(r"= .*\bconditional\(", hlo)  # noqa: E731
    assert conditionals(general) and not conditionals(twin)
    assert not vocab_sorts(twin) and not vocab_scatters(twin)


def _sub_jaxprs(eqn) -> list:
    """The jaxprs an equation calls with its own operands, one to one (jit, closed calls)."""
    subs = [
        p.jaxpr if hasattr(p, "jaxpr") else p
        for p in eqn.params.values()
        if isinstance(p, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr))
    ]
    return [j for j in subs if len(j.invars) == len(eqn.invars)]


def _count_weight_reads(jaxpr, names: dict, counts: dict) -> None:
    """Adds to counts[name] each contraction that reads a weight: a dot_general's right operand,
    or the product-and-sum an out-first weight runs as on the CPU (quant/out_first.py), which
    starts by broadcasting the weight with dims (0, 2); a reshape passes the weight through."""
    for eqn in jaxpr.eqns:
        ins = [names.get(v) if isinstance(v, jax.extend.core.Var) else None for v in eqn.invars]
        prim = eqn.primitive.name
        if prim == "dot_general" and ins[1] is not None:
            counts[ins[1]] += 1
        elif prim == "broadcast_in_dim" and ins[0] is not None and tuple(eqn.params["broadcast_dimensions"]) == (0, 2):
            counts[ins[0]] += 1
        elif prim == "reshape" and ins[0] is not None:
            names[eqn.outvars[0]] = ins[0]
        for sub in _sub_jaxprs(eqn):  # a layer is a jit of its own (models/layers.traced_once)
            inner = {var: name for var, name in zip(sub.invars, ins) if name is not None}
            _count_weight_reads(sub, inner, counts)


def weight_dots(model) -> dict[str, int]:
    """How many contractions of the traced step (bucket 8) read each parameter, by its path."""
    config = EngineConfig(
        page_size=16,
        max_num_batched_tokens=8,
        max_num_seqs=8,
        token_buckets=(1, 8),
        penalties=False,
        compilation_cache_dir=None,
        num_pages=64,
        max_model_len=512,
    )
    runner = Worker(model, config, 512)
    jaxpr = runner.step.trace(runner.step.padding_inputs(8, False)).jaxpr.jaxpr
    leaves = jax.tree_util.tree_flatten_with_path(runner.state.params)[0]
    paths = [jax.tree_util.keystr(path).removesuffix(".t") for path, _ in leaves]
    counts = dict.fromkeys(paths, 0)
    # the parameters are the step's first arguments; only matrices are weights of a contraction
    names = {var: path for var, path, (_, leaf) in zip(jaxpr.invars, paths, leaves) if leaf.ndim >= 2}
    _count_weight_reads(jaxpr, names, counts)
    return counts


def test_one_matmul_for_qkv_and_one_for_gate_up_per_layer(model):
    counts = weight_dots(model)
    for i in range(CONFIG.num_layers):
        layer = {path.split(".")[-1]: n for path, n in counts.items() if f".layers[{i}]." in path}
        assert layer == {"attn_norm": 0, "w_qkv": 1, "wo": 1, "mlp_norm": 0, "w_gate_up": 1, "w_down": 1}


@pytest.mark.parametrize("bucket,num_steps", [(1, 1), (8, 1), (1, 4), (8, 4)])
def test_the_step_never_transposes_copies_or_concatenates_a_weight(model, bucket, num_steps):
    """Nowhere in the compiled step, fusions and loop bodies included: XLA:CPU used to transpose
    the whole [H, D, E] output projection on every step to match the attention output's layout."""
    hlo, runner = compiled_step(model, bucket, num_steps=num_steps, max_model_len=512, num_pages=64)
    layer = runner.state.params.layers[0]
    sizes = {int(np.prod(getattr(layer, f).shape)) for f in ("w_qkv", "wo", "w_gate_up", "w_down")}
    for line in hlo.splitlines():  # of stored data: a parameter (of a fusion) or a tuple's element
        m = re.search(r"= \w+\[([\d,]+)\]\S* (concatenate|copy|transpose)\(%(param|get-tuple-element)", line)
        assert not (m and int(np.prod([int(d) for d in m.group(1).split(",")])) in sizes), line.strip()[:120]


def float_arrays_of_sizes(hlo: str, sizes: set[int]) -> list[str]:
    """Float arrays of these element counts that the program materializes: any instruction of the
    entry computation, loop bodies or branches (not the inside of a fusion, which streams)."""
    bodies, _ = split_computations(hlo)
    fused = set(re.findall(r"calls=(%[\w.\-]+)", hlo)) - set(re.findall(r"body=(%[\w.\-]+)", hlo))
    found = []
    for name, body in bodies.items():
        for line in body.splitlines() if name not in fused else ():
            m = re.search(r"= (f32|bf16|f16)\[([\d,]+)\]\S* [\w\-]+\((.*?)\)", line)
            from_data = m and re.sub(r"%constant[\w.]*|[ ,]", "", m.group(3))  # not a constant's broadcast
            if from_data and int(np.prod([int(d) for d in m.group(2).split(",")])) in sizes:
                found.append(f"{name}: {line.strip()[:120]}")
    return found


@pytest.mark.parametrize("quantization", [QuantConfig("int8"), QuantConfig("int4", 16)], ids=["int8", "int4"])
def test_a_decode_window_reads_quantized_weights_as_stored(quantization):
    """No float copy of a quantized weight anywhere in a window of one-token steps: left
    loop-invariant, XLA hoisted each weight's conversion out of the loop into a float copy made
    on every call (SmolLM2 int8 decoded at 0.52x of float on the CPU; 1.25x with the weights read
    as stored)."""
    model = load_model(FIXTURES / "hf" / "llama3", "float32", with_tokenizer=False, quantization=quantization)
    hlo, runner = compiled_step(model, 1, num_steps=4, max_model_len=64, num_pages=20)
    layer = runner.state.params.layers[0]
    sizes = {int(np.prod(getattr(layer, f).shape)) for f in ("w_qkv", "wo", "w_gate_up", "w_down")}
    assert int(np.prod(runner.state.kv_caches[0].shape)) not in sizes
    assert "while(" in hlo or "while (" in hlo
    assert not float_arrays_of_sizes(hlo, sizes)
    float_model = LoadedModel(model.config, model.family.init_params(model.config, jax.random.key(0)), None,
                              model.family, Path("random"))  # fmt: skip
    float_hlo, _ = compiled_step(float_model, 1, num_steps=4, max_model_len=64, num_pages=20)
    assert float_arrays_of_sizes(float_hlo, sizes)  # the check sees float weights where they are


ODD_LAYOUT = (1, 2, 3, 0)  # not the CPU's default (row-major): a dropped pin shows


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_every_jit_hands_the_caches_back_in_their_pinned_layout(model, monkeypatch, kv_cache_dtype):
    """The runner allocates its caches in a pinned layout (row-major in the engine,
    pallas_kernels.kv_layout) and every jit that carries them gives them back in it: the step, the
    decode window and the split step's forward. One that dropped the pin would hand back XLA's
    default layout, which on a TPU (head_dim 64) relays each layer's cache around the kernels, and
    the next call would compile again. Pinned here to a layout the CPU would not choose."""
    monkeypatch.setattr(
        kv_pool, "kv_cache_format", lambda sharding, ndim=4: Format(Layout(major_to_minor=ODD_LAYOUT), sharding)
    )
    config = EngineConfig(
        page_size=16,
        max_num_batched_tokens=8,
        max_num_seqs=8,
        token_buckets=(1, 8),
        penalties=False,
        compilation_cache_dir=None,
        num_decode_steps=4,
        structured_output_overlap=True,
        num_pages=40,
        kv_cache_dtype=kv_cache_dtype,
    )
    runner = Worker(model, config, 512)

    def pinned() -> bool:
        return all(
            c.format.layout.major_to_minor == ODD_LAYOUT
            for c in jax.tree.leaves(runner.state.kv_caches)
            if c.ndim == 4 and c.shape[0] == 40
        )

    assert pinned()
    runner.warm_up()
    compiled = runner.num_compiled()
    inputs = runner.step.padding_inputs(8, False)
    for run in (
        lambda: runner.step.execute(inputs),
        lambda: runner.step.execute(inputs, 4),
        lambda: runner.step.dispatch_sample(runner.step.dispatch_forward(inputs), inputs),
    ):
        jax.block_until_ready(run())
        assert pinned()
    assert runner.num_compiled() == compiled


def test_cuda_graph_options_for_windows_only_on_gpus(monkeypatch, caplog):
    """window_compiler_options: CUDA graphs over the window on a GPU, unless XLA_FLAGS sets them
    (the user's choice) or this XLA refuses the option (a warning; windows compile as before)."""
    from jaxinfer.worker import step_variants

    assert step_variants.window_compiler_options() is None  # the CPU
    monkeypatch.setattr(step_variants.jax, "default_backend", lambda: "gpu")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    assert step_variants.window_compiler_options() == {
        "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CONDITIONAL,WHILE"
    }
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")
    assert step_variants.window_compiler_options() is None
    monkeypatch.delenv("XLA_FLAGS")
    monkeypatch.setattr(step_variants, "COMMAND_BUFFER_TYPES", "FUSION,NO_SUCH_KIND")
    assert step_variants.window_compiler_options() is None and "without CUDA graphs" in caplog.text


def test_the_window_alone_compiles_with_the_window_options(model, monkeypatch):
    """The runner hands window_compiler_options to the window's jit and to no other: an option
    XLA refuses fails the window's compile and leaves the single step's alone."""
    monkeypatch.setattr(
        "jaxinfer.worker.compiled_step.window_compiler_options",
        lambda: {"xla_gpu_enable_command_buffer": "NO_SUCH_KIND"},
    )
    runner = make_runner(model, 4, max_model_len=512, num_pages=64)
    inputs = runner.step.padding_inputs(8, False)
    runner.step.lower(inputs, 1).compile()
    with pytest.raises(jax.errors.JaxRuntimeError, match="NO_SUCH_KIND"):
        runner.step.lower(inputs, 4).compile()
