"""Small Ouro checkpoints in the real HF layout, with a real byte-level BPE tokenizer.

Random presets: tests and ``make serve`` use these; their output is random text. Weights are
drawn large enough that greedy decoding does not collapse into one repeated token. The
``trained`` preset is trained here (``runtime_glue.ouro.train``) on the text every Python
ships (``runtime_glue.ouro.corpus``), so that quality can be measured.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

import attrs
import torch
from safetensors.torch import save_file

from hal.cache import cache_dir
from runtime_glue.ouro.checkpoint import INDEX_FILE, expected_tensors
from runtime_glue.ouro.config import OuroConfig
from runtime_glue.ouro.presets import PRESETS, TOKENIZER_VOCAB
from runtime_glue.ouro.progress import TrainingProgress, duration
from runtime_glue.ouro.train import Recipe

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# The Thinking variants' reasoning block, as Ouro-1.4B-Thinking writes it: "<think> ... </think>"
# then the answer. A --thinking toy checkpoint has both as tokens (the vocabulary's last two)
# and a template whose enable_thinking opens the block in the generation prompt (as the GRPO
# fine-tune's template does: LoopedLMs/ouro_rl); without it the model opens the block itself,
# as the released Thinking checkpoints do.
THINK_START, THINK_END = "<think>", "</think>"
THINKING_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking %}{{ '<think>\\n' }}{% endif %}"
    "{% endif %}"
)
_CORPUS = """\
Ouro is a looped language model: it runs the same stack of decoder layers several times for
every token, and each pass refines the hidden state before the next one begins. The runtime
keeps a separate key and value cache for every loop and every layer, so four loops over
twenty-four layers means ninety-six planes of cache for each request.
An inference server accepts requests over HTTP, schedules them in batches, runs the model on
an accelerator and streams the generated tokens back to the client as server-sent events.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 2048 4096.
def main():\n    print("hello, world")\n    return 0\n
User: What is two plus two? Assistant: Two plus two is four.
The Ascend NPU, the CUDA GPU and the CPU each run the same model through one driver interface.
"""


def preset_config(preset: str, total_ut_steps: int = 4, **overrides) -> OuroConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    values = {
        **PRESETS[preset],
        "total_ut_steps": total_ut_steps,
        "eos_token_ids": (0, 2),
        "bos_token_id": 1,
        "early_exit_threshold": 1.0,  # as Ouro-1.4B's config.json has it
        **overrides,
    }
    return OuroConfig(**values)


def train_tokenizer(vocab_size: int = TOKENIZER_VOCAB, texts: Iterable[str] | None = None):
    """A byte-level BPE (``tokenizers``) with Ouro's special tokens at ids 0, 1, 2, trained on
    ``texts`` (default: the random presets' fixed text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    if texts is None:
        # Numbers give the trainer enough distinct pairs to fill the vocabulary deterministically.
        numbers = " ".join(f"{i} {i * 37 % 9973}" for i in range(4000))
        texts = [_CORPUS] * 4 + [numbers]
    tok.train_from_iterator(texts, trainer)
    return tok


def random_weights(
    cfg: OuroConfig, seed: int = 0, gate_bias: float = 0.0
) -> dict[str, torch.Tensor]:
    """Random bf16 weights that keep greedy decoding varied.

    Unit-scale embeddings; 1/sqrt(fan_in) projections with sharper q/k (peaked attention) and
    lm_head (fewer near-ties); the sandwich norms' second weights near 0.3 so each block adds
    to the residual without washing out the token's identity. With all gains at 1, greedy
    sequences collapse into a handful of repeated tokens.
    """
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in expected_tensors(cfg).items():
        if name.endswith("layernorm_2.weight"):
            w = 0.3 * (1.0 + 0.1 * torch.randn(shape, generator=gen))
        elif name.endswith("norm.weight"):
            w = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name == "model.embed_tokens.weight":
            w = torch.randn(shape, generator=gen)
        elif name == "model.early_exit_gate.bias":
            w = torch.full(shape, gate_bias)  # higher: earlier exits
        else:
            gain = _GAINS.get(name.rsplit(".", 2)[-2], 1.0)
            w = torch.randn(shape, generator=gen) * (gain / math.sqrt(shape[-1]))
        weights[name] = w.to(torch.bfloat16).contiguous()
    return weights


_GAINS = {"q_proj": 2.0, "k_proj": 2.0, "lm_head": 4.0}


def write_checkpoint(
    out_dir: str | Path,
    cfg: OuroConfig,
    seed: int = 0,
    shards: int = 1,
    gate_bias: float = 0.0,
    thinking: bool = False,
) -> Path:
    """Write config.json, random safetensors (``shards`` > 1: with an index) and the tokenizer.
    ``gate_bias`` sets the exit gate's bias: the higher, the earlier tokens exit; ``thinking``:
    the Thinking layout's tokenizer and template (:func:`thinking_tokenizer`)."""
    weights = random_weights(cfg, seed, gate_bias)
    return write_files(out_dir, cfg, weights, shards, thinking=thinking)


def write_files(
    out_dir: str | Path,
    cfg: OuroConfig,
    weights: dict[str, torch.Tensor],
    shards: int = 1,
    tokenizer=None,
    thinking: bool = False,
) -> Path:
    """config.json, ``weights`` as safetensors (``shards`` > 1: with an index), the tokenizer
    (``thinking``: the Thinking layout's)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    if shards <= 1:
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        names = list(weights)
        weight_map = {}
        for k in range(shards):
            fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: weights[n] for n in names[k::shards]}
            save_file(part, str(out / fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, fname))
        total = sum(w.numel() * w.element_size() for w in weights.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
    write_tokenizer(out, tokenizer, thinking)
    return out


TRAINED_RECIPE = Recipe()
TRAINED_EXIT_THRESHOLD = 0.5  # config.json's early_exit_threshold (Ouro-1.4B's is 1.0)


def trained_config(total_ut_steps: int = 4) -> OuroConfig:
    return preset_config("trained", total_ut_steps, early_exit_threshold=TRAINED_EXIT_THRESHOLD)


def write_trained_checkpoint(
    out_dir: str | Path,
    recipe: Recipe = TRAINED_RECIPE,
    cfg: OuroConfig | None = None,
    progress: TrainingProgress | None = None,
) -> Path:
    """Train the ``trained`` preset (or ``cfg``) by ``recipe`` and write it, with
    ``training.json``: the recipe, its hash, the split rule, the run's losses and timing, and the
    training code's held-out figures (trained, at initialisation, and a unigram model).
    ``progress`` shows the four phases (corpus, tokenizer, training, evaluation) as they run."""
    from runtime_glue.ouro import corpus, train

    cfg = cfg or trained_config()
    progress = progress or TrainingProgress(enabled=False)
    start = time.perf_counter()
    tok, docs, train_ids, held = _training_data(cfg, recipe, progress)
    progress.phase(
        "training",
        f"{recipe.steps} steps of {recipe.batch} windows x {recipe.seq_len} tokens "
        f"on {recipe.threads} threads",
    )
    model, record = train.train(cfg, recipe, train_ids, progress)
    weights = model.bf16_weights()
    model.load_state_dict({n: w.float() for n, w in weights.items()})  # what the file holds
    write_files(out_dir, cfg, weights, tokenizer=tok)
    progress.phase(
        "evaluation", f"held-out loss per loop over {held[:, 1:].numel()} tokens, and baselines"
    )
    init = train.TrainOuro(cfg)
    train.init_weights(init, torch.Generator().manual_seed(recipe.seed))
    report = {
        "recipe": attrs.asdict(recipe),
        "recipe_hash": recipe.digest(cfg),
        "split": corpus.SPLIT_RULE,
        "documents": {"train": len(docs[0]), "held_out": len(docs[1])},
        "torch": torch.__version__,
        **record,
        "held_out": {
            "trained": train.loop_losses(model, held),
            "random_init": train.loop_losses(init, held),
            "unigram": corpus.unigram_perplexity(
                train_ids, held[:, 1:].flatten().tolist(), cfg.vocab_size
            ),
        },
    }
    report["total_seconds"] = time.perf_counter() - start
    (Path(out_dir) / TRAINING_FILE).write_text(json.dumps(report, indent=2))
    return Path(out_dir)


def _training_data(cfg: OuroConfig, recipe: Recipe, progress: TrainingProgress):
    """The tokenizer, the (train, held-out) documents, the training token stream and the
    held-out windows of ``recipe``, each phase announced on ``progress``."""
    from runtime_glue.ouro import corpus, train

    phase_start = time.perf_counter()
    progress.phase("corpus", f"reading Python's own documentation ({', '.join(recipe.sources)})")
    train_docs, held_docs = corpus.split(corpus.documents(recipe.sources))
    progress.say(
        f"  {len(train_docs)} documents to train on, {len(held_docs)} held out "
        f"({duration(time.perf_counter() - phase_start)})"
    )
    phase_start = time.perf_counter()
    progress.phase("tokenizer", f"a {cfg.vocab_size}-token byte-level BPE on the training text")
    tok = train_tokenizer(cfg.vocab_size, [d.text for d in train_docs])

    def encode(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in tok.encode_batch(texts)]

    train_ids = corpus.token_stream(encode, train_docs)
    held = train.windows(corpus.token_stream(encode, held_docs), recipe.seq_len)
    held = held[: max(1, recipe.eval_tokens // recipe.seq_len)]
    progress.say(
        f"  {len(train_ids)} training tokens ({duration(time.perf_counter() - phase_start)})"
    )
    return tok, (train_docs, held_docs), train_ids, held


TRAINING_FILE = "training.json"


def training_summary(model_dir: str | Path) -> str:
    """One line from a trained checkpoint's ``training.json``: time, final loss, held-out
    perplexity at the last loop, and where the record is."""
    path = Path(model_dir) / TRAINING_FILE
    record = json.loads(path.read_text())
    held = record.get("held_out", {}).get("trained", {}).get("perplexity_per_loop")
    perplexity = f", held-out perplexity {held[-1]:.2f} (last loop)" if held else ""
    return (
        f"trained in {duration(record['total_seconds'])}: final loss "
        f"{record['final_loss']:.3f}{perplexity}; the record: {path}"
    )


def cached_checkpoint(
    preset: str,
    seed: int = 0,
    recipe: Recipe = TRAINED_RECIPE,
    trained_cfg: OuroConfig | None = None,
) -> Path:
    """A preset's checkpoint in ``$RLT_HAL_CACHE`` (default ~/.cache/rlt-hal), written on first
    use: the embedded default model and the benchmark presets. ``trained`` is trained once by
    ``recipe`` (on ``trained_cfg``, default the preset's) and kept under the hash of both; its
    seed is the recipe's."""
    trained_cfg = trained_cfg or trained_config()
    if preset == "trained":
        path = cache_dir() / f"toy-trained-{recipe.digest(trained_cfg)}"
    else:
        path = cache_dir() / f"toy-{preset}-seed{seed}"
    if not (path / "config.json").is_file():
        # Written aside and renamed into place: processes that start together (the replicas
        # of `rlt-hal serve --replicas N`) never read a half-written checkpoint.
        staging = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        if preset == "trained":
            progress = TrainingProgress()
            progress.say(
                f"training the {preset!r} checkpoint into {path}: once, then cached "
                "(minutes: 10 to 30 on 2 cores)"
            )
            write_trained_checkpoint(staging, recipe, trained_cfg, progress)
            _into_place(staging, path)
            progress.say(training_summary(path))
        else:
            logger.warning("writing the random %s checkpoint to %s", preset, path)
            write_checkpoint(staging, preset_config(preset), seed=seed)
            _into_place(staging, path)
    return path


def _into_place(staging: Path, path: Path) -> None:
    try:
        staging.rename(path)
    except OSError:  # another process put its copy there first; both are the same
        shutil.rmtree(staging)


def thinking_tokenizer(vocab_size: int = TOKENIZER_VOCAB):
    """The random presets' tokenizer with ``<think>`` and ``</think>`` as its last two ids
    (added tokens, not special: they stay in the decoded text, where reasoning parsers find
    them)."""
    from tokenizers import AddedToken

    tok = train_tokenizer(vocab_size - 2)
    tok.add_tokens([AddedToken(t, normalized=False) for t in (THINK_START, THINK_END)])
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    return tok


def write_tokenizer(out: Path, tokenizer=None, thinking: bool = False) -> None:
    """``tokenizer`` (default: the random presets' one; ``thinking``: with the think tokens and
    the Thinking template) and its HF side files."""
    if thinking and tokenizer is None:
        tokenizer = thinking_tokenizer()
    (tokenizer or train_tokenizer()).save(str(out / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 65536,
        "chat_template": THINKING_TEMPLATE if thinking else CHATML_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}, indent=2))
