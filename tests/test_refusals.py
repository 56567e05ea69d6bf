"""Every pair of features through every entry point that builds an engine: the one refusal
(``runtime_glue.engine.refusals``), word for word, or the tokens of the same plan with the
features that change no bit turned off.

Entry points: ``LLM(...)`` (the server and the benches build through it), ``LLM.variant``
(which sets the mode and adaptive depth of an engine already built) and
``LLM.with_speculation``. On the emulated npu (a test double for step graphs and fused kernels,
``drivers.npu``), greedy; deterministic mode unless the pair has fast mode. Step graphs change
no bit in any mode, and speculation none in deterministic mode (the plan admits only
row-invariant kernels there, whichever it measures fastest). Fast mode promises no bits: a verify
step's GEMMs see K + 1 rows where plain decoding's see one, and which rows a CPU's GEMM path
rounds alike differs between machines (avx2, avx512_bf16), so speculation in fast mode is
compared with the same pair built through the constructor, not with plain decoding (its
agreement with plain decoding is measured: ``bench speculative``, docs/benchmarks.md). The
command line (``generate``, ``serve``, ``bench``) builds through ``LLM`` and refuses the same way.
"""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest

from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams
from tests.helpers import GREEDY, prompt_of

FEATURES = {
    "speculation": dict(speculative_loops=1, num_speculative_tokens=3),
    "graphs": dict(step_graphs=True),
    "fast": dict(mode="fast"),
    "sharing": dict(kv_sharing="last"),
    "adaptive": dict(adaptive_depth=True),
    "depth": dict(depth_batching=True),
}


def _exact(pair) -> tuple[str, ...]:
    """The features of ``pair`` that change no bit of the plan they run under."""
    return ("graphs",) if "fast" in pair else ("speculation", "graphs", "depth")


PAIRS = list(itertools.combinations(FEATURES, 2))
PROMPTS = [prompt_of(9, seed=5), prompt_of(21, seed=6)]
BASE = dict(device="npu", block_size=16, num_blocks=48, max_num_seqs=4)


def _options(features) -> dict:
    options = {"mode": "deterministic", **BASE}
    for name in features:
        options.update(FEATURES[name])
    return options


def _tokens(llm: LLM) -> list[tuple[int, ...]]:
    params = SamplingParams(max_tokens=16, **GREEDY)
    return [out.token_ids for out in llm.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def built(tiny_ckpt):
    """Engines (or the ValueError that refused them) by the features they were built with,
    each built once per module."""
    cache: dict = {}

    def build(features: tuple[str, ...]):
        key = tuple(sorted(features))
        if key not in cache:
            try:
                cache[key] = LLM(tiny_ckpt, **_options(key))
            except ValueError as exc:
                cache[key] = exc
        return cache[key]

    return build


def _through(entry: str, pair: tuple[str, str], build) -> LLM:
    """The engine of ``pair`` built through ``entry`` (the other feature set first)."""
    if entry == "constructor":
        engine = build(pair)
        if isinstance(engine, ValueError):
            raise engine
        return engine
    late = "speculation" if entry == "with_speculation" else None
    if entry == "variant":
        late = next(f for f in pair if f in ("fast", "adaptive"))
    [early] = [f for f in pair if f != late]
    first = build((early,))
    assert isinstance(first, LLM), first
    if entry == "with_speculation":
        return first.with_speculation(1, 3)
    mode = "fast" if "fast" in pair else "deterministic"
    return first.variant(mode=mode, adaptive_depth="adaptive" in pair)


def _entries(pair) -> list[str]:
    entries = ["constructor"]
    if "speculation" in pair:
        entries.append("with_speculation")
    if {"fast", "adaptive"} & set(pair):  # what a variant sets
        entries.append("variant")
    return entries


CASES = [(pair, entry) for pair in PAIRS for entry in _entries(pair)]


@pytest.mark.parametrize("pair, entry", CASES, ids=[f"{'+'.join(p)}-{e}" for p, e in CASES])
def test_every_pair_through_every_entry_point_is_the_one_refusal_or_the_exact_plans_tokens(
    built, pair, entry
):
    constructed = built(pair)
    if isinstance(constructed, ValueError):  # refused: every entry point says the same
        with pytest.raises(ValueError) as err:
            _through(entry, pair, built)
        assert str(err.value) == str(constructed)
        assert "cannot be combined with" in str(err.value)
        return
    engine = _through(entry, pair, built)
    tokens = _tokens(engine)
    _assert_runs(engine, pair)  # no feature asked for was left off on the way
    reference = built(tuple(f for f in pair if f not in _exact(pair)))
    assert isinstance(reference, LLM), reference
    if reference is not engine:  # without exact features the constructor is the reference
        assert tokens == _tokens(reference)


def _assert_runs(llm: LLM, pair) -> None:
    """Each feature of ``pair`` is on in ``llm`` and did its work in the last generate."""
    stats, engine = llm.engine.stats, llm.engine
    on = {
        "speculation": stats.get("spec_verify_steps", 0) > 0,
        "graphs": engine.graphs is not None and engine.graphs.stats["graph_steps"] > 0,
        "fast": llm.plan.mode == "fast",
        "sharing": engine.shared is not None and llm.args.kv_sharing == "last",
        "adaptive": llm.plan.adaptive_depth,
        "depth": stats["depth_rows"] > 0,
    }
    assert all(on[f] for f in pair), {f: on[f] for f in pair}


def test_a_refused_pair_built_after_the_fact_raises_before_it_generates(built):
    """The bug this module guards: kv sharing refused speculation at construction, but
    ``with_speculation`` built the pair and generated other tokens than plain decoding."""
    sharing = built(("sharing",))
    with pytest.raises(ValueError, match="--speculative-loops cannot be combined with "
                       "--kv-sharing last"):  # fmt: skip
        sharing.with_speculation(1, 3)
    speculating = built(("speculation",))
    with pytest.raises(ValueError, match="cannot be combined with --adaptive-depth"):
        speculating.variant(mode="deterministic", adaptive_depth=True)


@pytest.mark.parametrize(
    "command", [["generate", "--prompt", "hi"], ["serve", "--port", "0"], ["bench", "latency"]]
)
def test_the_command_line_refuses_a_pair_with_the_same_message(tiny_ckpt, built, command):
    """``rlt-hal`` builds every engine through ``LLM`` (``build_llm``): a refused pair is one
    line naming it, and a usage error, before any weight loads or any port opens."""
    refused = built(("speculation", "sharing"))
    assert isinstance(refused, ValueError)
    pair = ["--speculative-loops", "1", "--kv-sharing", "last"]
    argv = [sys.executable, "-m", "runtime_glue.cli", *command, "--model", str(tiny_ckpt), *pair]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"rlt-hal: error: {refused}"
