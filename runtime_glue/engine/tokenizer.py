"""The checkpoint's own tokenizer and chat template (transformers is used for nothing else)."""

from __future__ import annotations

from pathlib import Path


def load_tokenizer(model_dir: str | Path):
    path = Path(model_dir)
    if not (path / "tokenizer.json").is_file():
        # Without it transformers' fast tokenizer would try to convert a slow one and fail
        # naming sentencepiece and tiktoken, not the file.
        raise FileNotFoundError(
            f"{path / 'tokenizer.json'}: not found; the model directory must hold the "
            "checkpoint's tokenizer.json (Ouro's checkpoints ship one)"
        )
    # The fast tokenizer class reads tokenizer.json and tokenizer_config.json (chat template
    # included) without consulting config.json, whose model_type transformers does not know.
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)


def render_chat(
    tokenizer, messages: list[dict], add_special_tokens: bool = False, **kwargs
) -> tuple[str, list[int]]:
    """``messages`` rendered by the tokenizer's chat template (``apply_chat_template``'s
    keyword arguments), and that text's token ids: a chat request's prompt, served or offline
    (the template writes the special tokens; ``/tokenize`` may ask for the tokenizer's too)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    return text, tokenizer.encode(text, add_special_tokens=add_special_tokens)
