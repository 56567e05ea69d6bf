"""Helpers the test modules share: the HF reference with a cache, run_* cases, the CLI."""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from hal.eager import EagerBackend
from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams
from runtime_glue.ouro.config import OuroConfig
from tests.reference.ouro_hf import OuroReference

GREEDY = dict(temperature=0.0, ignore_eos=True)

# A chat template that renders tools (so tool_choice 'auto' can run), in Hermes' manner.
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def with_tool_template(ckpt: Path, folder: Path) -> Path:
    """A copy of checkpoint ``ckpt`` in ``folder`` whose chat template renders tools."""
    out = folder / "ckpt"
    shutil.copytree(ckpt, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = HERMES_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@functools.lru_cache(maxsize=4)
def reference(model_dir) -> OuroReference:
    return OuroReference(OuroConfig.from_dir(model_dir)).load(model_dir)


@functools.lru_cache(maxsize=64)
def reference_run(model_dir, prompt: tuple[int, ...], max_new: int):
    return reference(model_dir).generate(list(prompt), max_new)


def rlt_hal(*args: str, env=None) -> subprocess.CompletedProcess:
    """Run ``rlt-hal ARGS...`` in a fresh process, as a user would; output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "runtime_glue.cli.main", *args],
        capture_output=True,
        text=True,
        env=env,
    )


def request_slots(llm: LLM, req, n: int | None = None) -> torch.Tensor:
    """The cache slots of a running request's first ``n`` positions (all it holds if None)."""
    from hal.types import AttentionMetadata

    n = req.num_computed if n is None else n
    return AttentionMetadata.build(llm.kv_layout.block_size, [(n, 0, req.blocks)]).slot_mapping


def prompt_of(length: int, seed: int = 0, vocab: int = 1024) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=gen).tolist()


def run_parity_case(llm: LLM, model_dir, prompts: list[list[int]], max_new: int) -> None:
    """Each prompt, run alone, gives the reference's greedy tokens and bitwise-equal
    final-loop logits at every step."""
    for prompt in prompts:
        [out] = llm.generate(
            [prompt], SamplingParams(max_tokens=max_new, **GREEDY), return_logits=True
        )
        ref_tokens, ref_logits = reference_run(model_dir, tuple(prompt), max_new)
        assert list(out.token_ids) == ref_tokens, f"prompt of {len(prompt)} tokens diverged"
        assert torch.equal(out.logits, ref_logits), (
            f"logits differ by {(out.logits - ref_logits).abs().max().item()}"
        )


class PerturbedBackend(EagerBackend):
    """Test double: cpu_eager, except that the attention output of one plane is nudged at one
    position (any position when ``position`` is None): a driver with a planted error."""

    name = "perturbed_eager"

    def __init__(self, plane: int, position: int | None, by: float = 0.5) -> None:
        self.plane, self.position, self.by = plane, position, by

    def forward(self, query, plane, kv, meta, scaling, deterministic=False):
        out = super().forward(query, plane, kv, meta, scaling, deterministic)
        if plane == self.plane:
            for r in range(meta.num_requests):
                start, query_len, context_len = meta.request(r)
                for row in range(query_len):
                    if self.position in (None, context_len + row):
                        out[start + row] += self.by
        return out


def registry_with(backend, name: str = "perturbed"):
    """A registry whose only driver, ``name``, is the cpu driver with ``backend`` (a test
    double) as its one attention backend."""
    from drivers.cpu.driver import CpuDevice, CpuDriver
    from hal import DriverSpec, ProbeResult, Registry, hookimpl

    class Plugin:
        @hookimpl
        def rlt_hal_register_drivers(self):
            def create(**_):
                return CpuDriver(name, CpuDevice(), {backend.name: backend}, backend.name)

            return [DriverSpec(name, lambda: ProbeResult(True), create)]

    return Registry(plugins=[Plugin()])
