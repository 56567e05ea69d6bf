"""A vLLM offline script as vLLM's docs write one, only the import changed (``from vllm import
LLM, SamplingParams``): tests/test_offline_api.py runs it as is. Argument: a checkpoint."""

import sys

from runtime_glue import LLM, SamplingParams

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
]
sampling_params = SamplingParams(n=2, temperature=0.8, top_p=0.95, max_tokens=8, seed=0)
llm = LLM(model=sys.argv[1])
outputs = llm.generate(prompts, sampling_params, use_tqdm=False)
for output in outputs:
    prompt = output.prompt
    for sample in output.outputs:
        print(
            f"Prompt: {prompt!r}, sample {sample.index}: {sample.text!r} ({len(sample.token_ids)} tokens)"
        )

conversation = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hello! How can I assist you today?"},
    {"role": "user", "content": "Write an essay about the importance of higher education."},
]
outputs = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
for output in outputs:
    print(f"Chat prompt: {output.prompt!r}, generated: {output.outputs[0].text!r}")
outputs = llm.chat([conversation, conversation[:2]], SamplingParams(temperature=0, max_tokens=4))
print(f"Conversations: {len(outputs)}, finished: {all(o.finished for o in outputs)}")
