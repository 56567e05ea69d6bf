"""The checkpoint's own tokenizer and chat template (transformers is used for nothing else)."""

from __future__ import annotations

from pathlib import Path


def load_tokenizer(model_dir: str | Path):
    path = Path(model_dir)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise FileNotFoundError(
            f"{path}: no tokenizer.json or tokenizer_config.json; the model "
            "directory must hold the checkpoint's tokenizer"
        )
    # The fast tokenizer class reads tokenizer.json and tokenizer_config.json (chat template
    # included) without consulting config.json, whose model_type transformers does not know.
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
