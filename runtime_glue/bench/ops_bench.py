"""``rlt-hal bench ops``: device ops per decode token and per layer pass, counted, not timed.

One request is prefilled, then each of a few decode steps runs under a
``hal.devops.DeviceOpCounter``: the model's forward pass (every op a device would launch for
the token: a view is no device op; an emulated torch_npu op is the one device op it stands
for) and, apart, the whole engine step (sampling, the host read of the token, the step's
metadata). Per layer pass = the forward's device ops per token / (loops x layers).

On an accelerator every device op is a host dispatch and a kernel launch, so these counts
say how launch-bound a plan is on hardware that is not here. On the emulated npu they are
counts of the emulated plan, labelled "emulated"; timings on it mean nothing.

``host_calls_per_step_graph_replay``: under step-graph replay, the device ops and copies the
engine issues around ``replay()``, per kind of step (a plain decode step, a speculative draft
step, a verify step); null while the engine has no step graphs. With speculation every figure
is given per kind of step: a draft step runs loops 0..E-1, a verify step loops E..T-1, and
"per layer pass" divides a step's ops by the loops x layers it ran.
"""

from __future__ import annotations

import statistics

import torch

from hal.devops import DeviceOpCounter
from runtime_glue.engine.llm import LLM
from runtime_glue.engine.sampling import SamplingParams

PROMPT_LEN = 16


def graph_host_calls(llm: LLM) -> dict[str, int] | None:
    """Host calls per decode step under graph replay (``--step-graphs``), by step kind
    (``decode``, or a speculative ``draft`` and ``verify``); None without graphs."""
    if llm.engine.graphs is None:
        return None
    from runtime_glue.bench.graph_bench import host_calls_by_kind

    return host_calls_by_kind(llm)


def _kind(step) -> str:
    """A forward's kind: a plain decode step, a speculative draft or verify step, or a
    depth-wise step (``--depth-batching``: one pass over the layers, one loop of a token)."""
    if step.depth is not None:
        return "depth"
    if len(step.spans) == 1:
        return "decode"
    return "verify" if step.kept is not None else "draft"


def _layer_passes(llm: LLM, step) -> int:
    """Loops x layers a forward runs: its spans' loops that hold rows."""
    loops = sum(len(span.loops) for span in step.spans if span.rows.numel())
    return loops * llm.config.num_hidden_layers


def count_decode(llm: LLM, steps: int = 3, prompt_len: int = PROMPT_LEN) -> dict:
    """Device ops of ``steps`` decode steps of one request, after its prefill (with
    speculation: enough steps for a round of drafts and its verify step)."""
    engine, model = llm.engine, llm.model
    if llm.speculative is not None:
        steps = max(steps, 2 * (llm.speculative.tokens + 2))
    if llm.args.depth_batching:  # a token takes a step a loop: count whole tokens
        steps = max(steps, 3 * llm.config.total_ut_steps)
    gen = torch.Generator().manual_seed(prompt_len)
    prompt = torch.randint(3, llm.config.vocab_size, (prompt_len,), generator=gen).tolist()
    rid = f"bench-ops-{id(llm)}"
    max_tokens = 4 * steps + 1  # a round of drafts never runs out of tokens
    engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    engine.step()  # the prefill, and the first token
    before = len(engine.requests[rid].output_ids)
    forwards: list[tuple[str, int, DeviceOpCounter]] = []
    inner = model.forward

    def counted(step_inputs):
        with DeviceOpCounter() as c:
            out = inner(step_inputs)
        forwards.append((_kind(step_inputs), _layer_passes(llm, step_inputs), c))
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
    tokens = len(engine.requests[rid].output_ids) - before
    engine.abort_request(rid)
    by_kind = {}
    for kind in ("decode", "draft", "verify", "depth"):
        mine = [(passes, c) for k, passes, c in forwards if k == kind]
        if mine:
            by_kind[kind] = {
                "device_ops_per_step": statistics.median(c.device_ops for _, c in mine),
                "device_ops_per_layer_pass": round(
                    statistics.median(c.device_ops / passes for passes, c in mine), 2
                ),
            }
    cfg = llm.config
    passes = cfg.total_ut_steps * cfg.num_hidden_layers
    per_token = statistics.median(c.device_ops for _, _, c in forwards)
    if llm.args.depth_batching:  # T forwards a token: all of them, over the tokens they made
        per_token = sum(c.device_ops for _, _, c in forwards) / max(tokens, 1)
    return {
        "plan": llm.plan.describe(),
        "mode": llm.plan.mode,
        "attention": llm.plan.attention,
        "speculative": None
        if llm.speculative is None
        else llm.speculative.describe(cfg.total_ut_steps),
        "device_ops_per_decode_token": per_token,
        "device_ops_per_layer_pass": max(k["device_ops_per_layer_pass"] for k in by_kind.values()),
        "by_step_kind": by_kind,
        "layer_passes": passes,
        "engine_step_device_ops": statistics.median(c.device_ops for c in step_counts),
        "host_reads_per_step": statistics.median(c.host_reads for c in step_counts),
        "steps_per_decode_token": steps / max(tokens, 1),
        "views_per_decode_token": statistics.median(sum(c.views.values()) for _, _, c in forwards),
        "top_ops": forwards[-1][2].summary()["top_ops"],
        "host_calls_per_step_graph_replay": graph_host_calls(llm),
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
        "| plan, step kind | device ops / step | / layer pass | engine step | host reads | "
        "host calls / step (graph replay) |",
        "|---|---|---|---|---|---|",
    ]
    for key in ("plan", "hf_exact"):
        row = report.get(key)
        if not row or "error" in row:
            continue
        graph = row["host_calls_per_step_graph_replay"]
        for kind, k in row["by_step_kind"].items():
            calls = "n/a" if graph is None else graph.get(kind, "n/a")
            lines.append(
                f"| {row['mode']}, {row['attention']}, {kind} steps | "
                f"{k['device_ops_per_step']:.0f} | {k['device_ops_per_layer_pass']:.1f} | "
                f"{row['engine_step_device_ops']:.0f} | {row['host_reads_per_step']:.0f} | "
                f"{calls} |"
            )
    plan = report["plan"]
    lines += [
        "",
        f"device ops per decode token ({plan['mode']}): {plan['device_ops_per_decode_token']:.0f}"
        f", {plan['steps_per_decode_token']:.2f} steps a token",
    ]
    top = ", ".join(f"{n} {c}" for n, c in report["plan"]["top_ops"].items())
    lines += ["", f"top ops ({report['plan']['mode']}): {top}"]
    for a in report.get("admissions", []):
        verdict = "admitted" if a["admitted"] else "REFUSED"
        lines.append(f"- {a['op']} {a['kernel']}: {verdict}, {a['why']}")
    return "\n".join(lines)
