"""The child's generation task: greedy decoding (or sampling) with a compiled prefill + decode pair
(graphconv/generation/run.py)."""

from __future__ import annotations

import time


def generate(task: dict) -> dict:
    """Both GraphCells loaded once, with dynamic set_inputs (one graph compile each, not one per cache
    length); the prompt prefilled, then one decode step per new token, present.* fed back as
    past_key_values.* (MindSpore Tensors, never copied to the host) and a 1 appended to the mask. A row that
    produced an eos is fed the pad id from then on. Returns the chosen tokens [batch][steps] and the seconds;
    with "logits" the last-position logits of every step go there (step0 the prefill's) for the parent's
    onnxruntime check."""
    import mindspore as ms
    import numpy as np
    from mindspore import Tensor, nn

    from graphconv.runtime import decoding, mindir_state, network

    if task["device"] == "ascend":
        ms.set_device("Ascend")
        ms.set_context(mode=ms.GRAPH_MODE)
    else:  # (once per process: a rank under msrun has set it before joining its group)
        network.cpu_graph_mode()
    t0 = time.perf_counter()
    cells = {}  # by MindIR: one graph may serve both steps (onnxruntime-genai's model builder)
    for name in ("prefill", "decode"):
        path = task[name]["mindir"]
        if path not in cells:
            # a stateful graph's cache: stored without its bytes, made as zeros here (runtime/mindir_state.py)
            cell = nn.GraphCell(ms.load(path), params_init=mindir_state.params_init(task[name].get("state_params")))
            cell.set_inputs(*network.placeholders(task[name]["inputs"]))
            cells[path] = cell
    load_seconds = time.perf_counter() - t0
    with np.load(task["prompt"]) as data:
        ids, mask = data["input_ids"], data["attention_mask"]
    saved, seconds, clock = {}, [], [time.perf_counter()]

    def run(name, ids, mask, positions, cache=None):
        clock[0] = time.perf_counter()
        graph = task[name]
        feed = decoding.step_feed(graph["inputs"], ids, mask, positions, cache, graph.get("empty_cache", False))
        out = cells[graph["mindir"]](*[Tensor(a) if isinstance(a, np.ndarray) else a for a in feed])
        if not isinstance(out, (tuple, list)):  # (one output: a stateful graph gives the logits only)
            out = (out,)
        return decoding.split_outputs(graph["outputs"], out, task.get("cache_feeds"))

    def on_step(step, logits):
        seconds.append(time.perf_counter() - clock[0])
        if task.get("logits"):
            saved[f"step{step}"] = logits

    sampling = task.get("sampling")
    choose = decoding.sampler(**sampling) if sampling else decoding.argmax
    tokens = decoding.decode_loop(lambda i, m, p: run("prefill", i, m, p),
                                  lambda i, m, p, cache: run("decode", i, m, p, cache),
                                  lambda logits: logits.asnumpy()[:, -1], ids, mask, task["max_new_tokens"],
                                  task["eos_token_ids"], task["pad_token_id"], on_step, choose)
    if task.get("logits"):
        np.savez(task["logits"], **saved)
    return {"tokens": tokens.tolist(), "logits": task.get("logits"),
            "timings": {"load": round(load_seconds, 3), "prefill": round(seconds[0], 4),
                        "decode": [round(s, 4) for s in seconds[1:]]}}
