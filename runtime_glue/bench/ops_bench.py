"""``rlt-hal bench ops``: device ops per decode token and per layer pass, counted, not timed.

One request is prefilled, then each of a few decode steps runs under a
``hal.devops.DeviceOpCounter``: the model's forward pass (every op a device would launch for
the token: a view is no device op; an emulated torch_npu op is the one device op it stands
for) and, apart, the whole engine step (sampling, the host read of the token, the step's
metadata). Per layer pass = the forward's device ops per token / (loops x layers).

On an accelerator every device op is a host dispatch and a kernel launch, so these counts
say how launch-bound a plan is on hardware that is not here. On the emulated npu they are
counts of the emulated plan, labelled "emulated"; timings on it mean nothing.

``host_calls_per_decode_step_graph_replay``: under step-graph replay, the device ops and
copies the engine issues around ``replay()``; null while the engine has no step graphs.
"""

from __future__ import annotations

import statistics

import torch

from hal.devops import DeviceOpCounter
from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams

PROMPT_LEN = 16


def graph_host_calls(llm: LLM) -> int | None:
    """Host calls per decode step under graph replay (``--step-graphs``); None without graphs."""
    if llm.engine.graphs is None:
        return None
    from runtime_glue.bench.graph_bench import host_calls_per_decode_step

    return host_calls_per_decode_step(llm, steps=2)["host_calls_per_step"]


def count_decode(llm: LLM, steps: int = 3, prompt_len: int = PROMPT_LEN) -> dict:
    """Device ops of ``steps`` decode steps of one request, after its prefill."""
    engine, model = llm.engine, llm.model
    gen = torch.Generator().manual_seed(prompt_len)
    prompt = torch.randint(3, llm.config.vocab_size, (prompt_len,), generator=gen).tolist()
    rid = f"bench-ops-{id(llm)}"
    engine.add_request(rid, prompt, SamplingParams(max_tokens=steps + 1, ignore_eos=True))
    engine.step()  # the prefill, and the first token
    forward_counts: list[DeviceOpCounter] = []
    inner = model.forward

    def counted(step_inputs):
        with DeviceOpCounter() as c:
            out = inner(step_inputs)
        forward_counts.append(c)
        return out

    model.forward = counted  # type: ignore[method-assign]
    step_counts = []
    graphs, engine.graphs = engine.graphs, None  # count what a step (and so its graph) issues
    try:
        for _ in range(steps):
            with DeviceOpCounter() as c:
                engine.step()
            step_counts.append(c)
    finally:
        del model.forward  # the class's method again
        engine.graphs = graphs
    while engine.has_unfinished():
        engine.step()
    cfg = llm.config
    passes = cfg.total_ut_steps * cfg.num_hidden_layers
    per_token = statistics.median(c.device_ops for c in forward_counts)
    return {
        "plan": llm.plan.describe(),
        "mode": llm.plan.mode,
        "attention": llm.plan.attention,
        "device_ops_per_decode_token": per_token,
        "device_ops_per_layer_pass": round(per_token / passes, 2),
        "layer_passes": passes,
        "engine_step_device_ops": statistics.median(c.device_ops for c in step_counts),
        "host_reads_per_step": statistics.median(c.host_reads for c in step_counts),
        "views_per_decode_token": statistics.median(sum(c.views.values()) for c in forward_counts),
        "top_ops": forward_counts[-1].summary()["top_ops"],
        "host_calls_per_decode_step_graph_replay": graph_host_calls(llm),
    }


def ops_report(llm: LLM, steps: int = 3) -> dict:
    """This plan's counts and, unless it is HF-exact already, the HF-exact plan's beside it."""
    emulated = bool(getattr(llm.driver.device, "emulated", False))
    report = {
        "device": llm.driver.label,
        "emulated": emulated,
        "model": str(llm.model_dir),
        "config": {
            "layers": llm.config.num_hidden_layers,
            "loops": llm.config.total_ut_steps,
            "hidden": llm.config.hidden_size,
        },
        "plan": count_decode(llm, steps),
    }
    if llm.plan.mode != "hf-exact":
        try:
            report["hf_exact"] = count_decode(llm.variant(mode="hf-exact"), steps)
        except (RuntimeError, ValueError) as exc:
            report["hf_exact"] = {"error": str(exc)}
    if llm.plan.admissions:
        report["admissions"] = [
            {"op": a.op, "kernel": a.kernel, "admitted": a.admitted, "why": a.why}
            for a in llm.plan.admissions
        ]
    return report


def markdown_ops(report: dict) -> str:
    label = f"{report['device']}{' (EMULATED)' if report['emulated'] else ''}"
    lines = [
        f"device ops per decode token on {label}, {report['config']['layers']} layers x "
        f"{report['config']['loops']} loops",
        "",
        "| plan | device ops / decode token | / layer pass | engine step | host reads | "
        "host calls / step (graph replay) |",
        "|---|---|---|---|---|---|",
    ]
    for key in ("plan", "hf_exact"):
        row = report.get(key)
        if not row or "error" in row:
            continue
        graph = row["host_calls_per_decode_step_graph_replay"]
        lines.append(
            f"| {row['mode']}, {row['attention']} | {row['device_ops_per_decode_token']:.0f} | "
            f"{row['device_ops_per_layer_pass']:.1f} | {row['engine_step_device_ops']:.0f} | "
            f"{row['host_reads_per_step']:.0f} | {'n/a' if graph is None else graph} |"
        )
    top = ", ".join(f"{n} {c}" for n, c in report["plan"]["top_ops"].items())
    lines += ["", f"top ops ({report['plan']['mode']}): {top}"]
    for a in report.get("admissions", []):
        verdict = "admitted" if a["admitted"] else "REFUSED"
        lines.append(f"- {a['op']} {a['kernel']}: {verdict}, {a['why']}")
    return "\n".join(lines)
