"""Bad checkpoints, configs and requests give clear errors that name what is at fault."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams
from runtime_glue.ouro.checkpoint import CheckpointError
from runtime_glue.ouro.config import OuroConfig
from tests.helpers import rlt_hal

Q0 = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture
def ckpt_copy(tiny_ckpt, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, dst)
    return dst


def _edit_weights(ckpt, edit):
    path = ckpt / "model.safetensors"
    weights = load_file(str(path))
    edit(weights)
    save_file(weights, str(path))
    return path


def _edit_config(ckpt, **changes):
    raw = json.loads((ckpt / "config.json").read_text())
    raw.update(changes)
    (ckpt / "config.json").write_text(json.dumps(raw))


def test_a_missing_tensor_is_named(ckpt_copy):
    _edit_weights(ckpt_copy, lambda w: w.pop(Q0))
    with pytest.raises(CheckpointError, match=f"missing tensor\\(s\\) {Q0}"):
        LLM(ckpt_copy)


def test_an_unexpected_tensor_is_named_with_its_file(ckpt_copy):
    _edit_weights(ckpt_copy, lambda w: w.update({"model.extra.weight": torch.zeros(2)}))
    with pytest.raises(
        CheckpointError,
        match=r"model.safetensors: unexpected tensor "
        r"'model.extra.weight'",
    ):
        LLM(ckpt_copy)


def test_a_misshaped_tensor_is_named_with_both_shapes(ckpt_copy):
    _edit_weights(ckpt_copy, lambda w: w.update({Q0: w[Q0][:-1].contiguous()}))
    with pytest.raises(
        CheckpointError,
        match=rf"tensor '{Q0}' has shape \[127, 64\], "
        r"config.json implies \[128, 64\]",
    ):
        LLM(ckpt_copy)


def test_a_tensor_of_the_wrong_dtype_is_named(ckpt_copy):
    _edit_weights(ckpt_copy, lambda w: w.update({Q0: w[Q0].float()}))
    with pytest.raises(CheckpointError, match=rf"tensor '{Q0}' has dtype F32, expected BF16"):
        LLM(ckpt_copy)


def test_a_truncated_file_names_the_file_and_the_first_tensor_cut_off(ckpt_copy):
    path = ckpt_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor '.*' is truncated"):
        LLM(ckpt_copy)


def test_a_file_cut_inside_its_header_is_reported(ckpt_copy):
    path = ckpt_copy / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="truncated or corrupt safetensors header"):
        LLM(ckpt_copy)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("model_type", "llama", "field 'model_type' must be 'ouro', got 'llama'"),
        (
            "rope_scaling",
            {"type": "linear", "factor": 2.0},
            "field 'rope_scaling' is not supported",
        ),
        ("use_sliding_window", True, "field 'use_sliding_window' is not supported"),
        ("layer_types", ["sliding_attention"] * 2, "field 'layer_types' must all be"),
        ("tie_word_embeddings", True, "field 'tie_word_embeddings' must be false"),
        ("torch_dtype", "float32", "torch_dtype 'float32' is not supported"),
        ("num_key_value_heads", 3, r"num_attention_heads \(4\) must be a multiple"),
    ],
)
def test_unsupported_config_values_are_rejected_naming_the_field(ckpt_copy, field, value, message):
    _edit_config(ckpt_copy, **{field: value})
    with pytest.raises(ValueError, match=message):
        OuroConfig.from_dir(ckpt_copy)


def test_a_missing_config_field_is_named(ckpt_copy):
    raw = json.loads((ckpt_copy / "config.json").read_text())
    del raw["hidden_size"]
    (ckpt_copy / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="required field 'hidden_size' is missing"):
        OuroConfig.from_dir(ckpt_copy)


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(tiny_ckpt, device="cpu", block_size=16, num_blocks=4)


def test_an_empty_prompt_is_rejected(llm):
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        llm.generate(["hello", ""])


@pytest.mark.parametrize(
    "max_tokens, message",
    [
        (0, r"max_tokens must be > 0, got 0 \(0 only with prompt_logprobs\)"),
        (-3, r"max_tokens must be > 0, got -3 \(0 only with prompt_logprobs\)"),
    ],
)
def test_max_tokens_must_be_positive_unless_only_the_prompt_is_scored(max_tokens, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(max_tokens=max_tokens)
    if max_tokens == 0:
        SamplingParams(max_tokens=0, prompt_logprobs=0)  # scoring the prompt only


def test_token_ids_outside_the_vocabulary_are_rejected(llm):
    with pytest.raises(ValueError, match=r"token ids \[5000\] are outside the vocabulary"):
        llm.generate([[1, 5000]])


def test_a_request_larger_than_the_whole_pool_is_rejected_with_both_numbers(llm):
    with pytest.raises(
        ValueError,
        match=r"needs 70 tokens of KV cache, but the whole pool "
        r"holds 64 tokens \(4 blocks of 16\)",
    ):
        llm.generate([[5] * 10], SamplingParams(max_tokens=60))
    assert llm.engine.num_free_blocks == 4 and not llm.engine.has_unfinished()


@pytest.mark.parametrize("block_size", [8, 24, 100])
def test_block_size_must_be_a_power_of_two_of_at_least_16(tiny_ckpt, block_size):
    with pytest.raises(
        ValueError, match=f"block_size must be a power of two >= 16, got {block_size}"
    ):
        LLM(tiny_ckpt, block_size=block_size)


def test_the_cli_reports_errors_without_a_traceback(ckpt_copy):
    _edit_weights(ckpt_copy, lambda w: w.pop(Q0))
    proc = rlt_hal("generate", "--model", str(ckpt_copy), "--prompt", "hi")
    assert proc.returncode == 2
    assert f"rlt-hal: error: {ckpt_copy}: missing tensor(s) {Q0}" in proc.stderr
    assert "Traceback" not in proc.stderr


GET_ONE = "hf download ByteDance/Ouro-1.4B --local-dir DIR"


def test_the_download_command_the_errors_name_is_installed_beside_rlt_hal():
    """huggingface_hub (installed with rlt-hal) ships ``hf``; it no longer ships
    ``huggingface-cli``."""
    import shutil
    import sys
    from pathlib import Path

    assert shutil.which(GET_ONE.split()[0], path=str(Path(sys.executable).parent))


@pytest.mark.parametrize(
    "given, says",
    [
        ("no-such-dir", "model directory no-such-dir does not exist; rlt-hal never downloads"),
        ("a-file", "model directory a-file is not a directory; rlt-hal never downloads"),
        (
            "ByteDance/Ouro-1.4B",
            "does not exist ('ByteDance/Ouro-1.4B' looks like a Hugging Face hub id); rlt-hal "
            "never downloads models",
        ),
    ],
    ids=["missing", "a-file", "hub-id"],
)
def test_a_model_that_is_not_a_local_directory_says_so_and_how_to_get_one(
    tmp_path, monkeypatch, given, says
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("not a checkpoint")
    with pytest.raises(OSError, match=re.escape(says)) as raised:
        LLM(given)
    assert GET_ONE in str(raised.value)


def test_a_directory_without_tokenizer_json_names_the_file(ckpt_copy):
    (ckpt_copy / "tokenizer.json").unlink()  # tokenizer_config.json stays
    with pytest.raises(FileNotFoundError, match=re.escape(f"{ckpt_copy / 'tokenizer.json'}: not")):
        LLM(ckpt_copy)


def test_a_hub_id_given_as_the_model_is_a_one_line_cli_error():
    proc = rlt_hal("generate", "--model", "ByteDance/Ouro-1.4B", "--prompt", "hi")
    assert proc.returncode == 2
    [line] = [x for x in proc.stderr.splitlines() if x.strip()]
    assert line.startswith("rlt-hal: error: model directory ByteDance/Ouro-1.4B does not exist")
    assert GET_ONE in line
