"""The toy checkpoints' shapes, by preset name (no torch here: the command line lists them
before anything heavy loads). ``runtime_glue.ouro.toy`` writes and trains them."""

from __future__ import annotations

TOKENIZER_VOCAB = 1024

PRESETS: dict[str, dict] = {
    "tiny": dict(
        vocab_size=TOKENIZER_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    ),
    "small": dict(
        vocab_size=TOKENIZER_VOCAB,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
    ),
    # Trained, not random (write_trained_checkpoint): sized from steps/s measured here.
    "trained": dict(
        vocab_size=TOKENIZER_VOCAB,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
    ),
    "ouro-1.4b-shape": dict(
        vocab_size=49152,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=16,
        head_dim=128,
    ),
}
