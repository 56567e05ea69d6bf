"""Loading a checkpoint into the driver's weight buffer (errors: test_bad_input.py)."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from drivers.cpu.driver import HUGE_PAGE, CpuDevice
from runtime_glue.ouro.checkpoint import STACKED, load_weights


def test_every_tensor_is_loaded_and_stacked_weights_are_views_of_their_members(
    tiny_ckpt, tiny_config
):
    weights = load_weights(tiny_ckpt, tiny_config, CpuDevice())
    on_disk: dict[str, torch.Tensor] = {}
    for path in sorted(tiny_ckpt.glob("*.safetensors")):
        on_disk.update(load_file(path))
    assert set(on_disk) < set(weights)
    for name, tensor in on_disk.items():
        assert torch.equal(weights[name], tensor), name
    storage = weights["lm_head.weight"].untyped_storage().data_ptr()
    assert all(w.untyped_storage().data_ptr() == storage for w in weights.values())
    for layer in range(tiny_config.num_hidden_layers):
        p = f"model.layers.{layer}."
        for name, members in STACKED.items():
            stacked = weights[p + name]
            assert stacked.data_ptr() == weights[p + members[0]].data_ptr()
            assert torch.equal(stacked, torch.cat([on_disk[p + m] for m in members]))
    assert len(weights) == len(on_disk) + len(STACKED) * tiny_config.num_hidden_layers


def test_the_cpu_weight_buffer_is_aligned_for_huge_pages():
    buf = CpuDevice().alloc_weights(3 * HUGE_PAGE + 5, torch.bfloat16)
    assert buf.data_ptr() % HUGE_PAGE == 0 and buf.numel() == 3 * HUGE_PAGE + 5
    buf.fill_(1.5)  # writable all the way to the end
    assert buf[-1].item() == 1.5


def test_processes_that_write_the_embedded_checkpoint_together_all_get_a_whole_one(tmp_path):
    """The replicas of `serve --replicas N` start together and each writes the embedded
    checkpoint on first use: each copy is staged aside and renamed in, so every process gets
    the whole checkpoint and no staging directory is left."""
    import os
    import subprocess
    import sys

    from runtime_glue.ouro.config import OuroConfig

    code = (
        "from runtime_glue.ouro.toy import cached_checkpoint\n"
        "from runtime_glue.ouro.checkpoint import expected_tensors\n"
        "from runtime_glue.ouro.config import OuroConfig\n"
        "from safetensors import safe_open\n"
        "path = cached_checkpoint('tiny')\n"
        "names = set()\n"
        "for f in path.glob('*.safetensors'):\n"
        "    with safe_open(str(f), 'pt') as s: names |= set(s.keys())\n"
        "assert set(expected_tensors(OuroConfig.from_dir(path))) <= names\n"
        "print(path)\n"
    )
    env = {**os.environ, "RLT_HAL_CACHE": str(tmp_path)}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    paths = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(paths) == 1 and OuroConfig.from_dir(tmp_path / "toy-tiny-seed0").num_hidden_layers
    assert sorted(p.name for p in tmp_path.iterdir()) == ["toy-tiny-seed0"]
