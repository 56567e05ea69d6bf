"""Ouro's ``config.json``: parsing, defaults and the checks that reject what rlt-hal cannot run."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import attrs

SUPPORTED_DTYPES = ("bfloat16",)


@attrs.frozen
class OuroConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    total_ut_steps: int = 4
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 65536
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str = "bfloat16"
    # The exit defaults Ouro's config.json may carry (Ouro-1.4B's: threshold 1.0).
    early_exit_step: int | None = None
    early_exit_threshold: float | None = None

    @property
    def num_planes(self) -> int:
        """Per-depth KV planes: one per (loop, layer) pair."""
        return self.total_ut_steps * self.num_hidden_layers

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> OuroConfig:
        _reject_unsupported(raw, source)
        try:
            heads = int(raw["num_attention_heads"])
            values: dict[str, Any] = dict(
                vocab_size=int(raw["vocab_size"]),
                hidden_size=int(raw["hidden_size"]),
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
                total_ut_steps=int(raw.get("total_ut_steps", 4)),
                rope_theta=float(_rope_theta(raw)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 65536)),
                eos_token_ids=_as_ids(raw.get("eos_token_id")),
                bos_token_id=raw.get("bos_token_id"),
                torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
                early_exit_step=_optional(raw.get("early_exit_step"), int),
                early_exit_threshold=_optional(raw.get("early_exit_threshold"), float),
            )
        except KeyError as exc:
            raise ValueError(f"{source}: required field {exc.args[0]!r} is missing") from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: a field has the wrong type: {exc}") from None
        config = cls(**values)
        config.validate(source)
        return config

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> OuroConfig:
        check_model_dir(model_dir)
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: not found; a model directory needs config.json")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_dict(raw, str(path))

    def validate(self, source: str = "config.json") -> None:
        positive = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "total_ut_steps",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{source}: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{source}: num_attention_heads ({self.num_attention_heads}) must be a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"{source}: head_dim must be even for RoPE, got {self.head_dim}")
        step, threshold = self.early_exit_step, self.early_exit_threshold
        if step is not None and not 0 <= step < self.total_ut_steps:
            raise ValueError(
                f"{source}: early_exit_step must be in [0, {self.total_ut_steps}), got {step}"
            )
        if threshold is not None and not 0 < threshold <= 1:
            raise ValueError(f"{source}: early_exit_threshold must be in (0, 1], got {threshold}")
        if self.torch_dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"{source}: torch_dtype {self.torch_dtype!r} is not supported; "
                f"rlt-hal runs Ouro in {', '.join(SUPPORTED_DTYPES)}"
            )

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json an Ouro checkpoint carries (used by the toy checkpoint writer)."""
        eos: Any = list(self.eos_token_ids)
        return {
            "architectures": ["OuroForCausalLM"],
            "model_type": "ouro",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "total_ut_steps": self.total_ut_steps,
            "early_exit_step": self.early_exit_step,
            "early_exit_threshold": self.early_exit_threshold,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "use_sliding_window": False,
            "sliding_window": None,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else eos,
            "torch_dtype": self.torch_dtype,
            "use_cache": True,
        }


GET_A_CHECKPOINT = (
    "rlt-hal never downloads models: it needs a local directory in the Hugging Face layout "
    "(config.json, model.safetensors, tokenizer.json), e.g. from "
    "`hf download ByteDance/Ouro-1.4B --local-dir DIR`"
)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def check_model_dir(model_dir: str | Path) -> None:
    """Raise an error that says what is wrong and how to get a checkpoint, unless
    ``model_dir`` is an existing directory."""
    path = Path(model_dir)
    if path.is_dir():
        return
    if path.exists():
        raise NotADirectoryError(f"model directory {path} is not a directory; {GET_A_CHECKPOINT}")
    hub = (
        f" ({str(model_dir)!r} looks like a Hugging Face hub id)"
        if _HUB_ID.fullmatch(str(model_dir))
        else ""
    )
    raise FileNotFoundError(f"model directory {path} does not exist{hub}; {GET_A_CHECKPOINT}")


def _rope_theta(raw: dict[str, Any]) -> float:
    params = raw.get("rope_parameters") or {}
    return params.get("rope_theta", raw.get("rope_theta", 1_000_000.0))


def _optional(value: Any, kind):
    return None if value is None else kind(value)


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _reject_unsupported(raw: dict[str, Any], source: str) -> None:
    def reject(field: str, why: str) -> None:
        raise ValueError(f"{source}: field {field!r} {why}")

    if raw.get("model_type") != "ouro":
        reject("model_type", f"must be 'ouro', got {raw.get('model_type')!r}")
    if raw.get("rope_scaling"):
        reject("rope_scaling", f"is not supported (got {raw['rope_scaling']!r}); only plain RoPE")
    rope_type = (raw.get("rope_parameters") or {}).get("rope_type", "default")
    if rope_type != "default":
        reject("rope_parameters.rope_type", f"must be 'default', got {rope_type!r}")
    if raw.get("use_sliding_window"):
        reject("use_sliding_window", "is not supported: rlt-hal runs full attention only")
    layer_types = raw.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        reject("layer_types", "must all be 'full_attention' (sliding windows are not supported)")
    if raw.get("hidden_act", "silu") != "silu":
        reject("hidden_act", f"must be 'silu', got {raw.get('hidden_act')!r}")
    if raw.get("tie_word_embeddings"):
        reject("tie_word_embeddings", "must be false: Ouro has a separate lm_head")
    for field in ("attention_bias", "mlp_bias"):
        if raw.get(field):
            reject(field, "must be false: Ouro's projections have no biases")
