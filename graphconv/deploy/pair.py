"""The deploy bundle of a generation directory (`graphconv compile EXPORT_DIR -o GEN_DIR --bundle DIR`): each
graph's own bundle (DIR/decode/, and DIR/prefill/ where the prompt has its own graph: MindIR, ONNX, reference
cases, the MindSpore, Lite and ATC routes, written by the one-graph writer), plus at the top generation.json
and generate_mindspore.py, a generation script (greedy, or sampling) for an Ascend host whose loop is graphconv's own
(graphconv/runtime/decoding.py's source, copied, so the script needs numpy and MindSpore only), and a README."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

from graphconv.deploy.options import JIT_CONFIG
from graphconv.deploy.scripts import fill, template
from graphconv.generation import schema
from graphconv.version import tool_versions
from graphconv.runtime import decoding


def generate_script(inputs: dict[str, list[dict]]) -> str:
    """generate_mindspore.py; `inputs`: per graph, its inputs (name, dtype, shape) in order."""
    source = inspect.getsource(decoding)
    body = source[source.index("import numpy as np\n") + len("import numpy as np\n"):].strip("\n")
    head = fill(template("generate_mindspore.head.py.tmpl"), SOURCE=decoding.__name__.replace(".", "/") + ".py",
                INPUTS=json.dumps(inputs), JIT_CONFIG=repr(JIT_CONFIG), WRITTEN_BY=tool_versions()["mindspore"])
    return head + "\n\n" + body + "\n" + template("generate_mindspore.main.py.tmpl")


def write_pair_files(directory: Path, generation: dict, reports: dict[str, dict]) -> list[str]:
    """The top of the bundle (the graphs' bundles are already in directory/<graph>)."""
    inputs = {g: [{k: s[k] for k in ("name", "dtype", "shape")} for s in r["model"]["inputs"]]
              for g, r in reports.items()}
    schema.write(directory / schema.FILE, generation)
    script = directory / "generate_mindspore.py"
    script.write_text(generate_script(inputs))
    script.chmod(0o755)
    steps = {step: generation["graphs"][step].get("mindir", step) for step in schema.GRAPHS}
    how = (f"one graph, `{steps['decode']}`, for the prompt (with an empty cache) and each decode step"
           if steps["prefill"] == steps["decode"] else "the prefill for the prompt, the decode for each step")
    (directory / "README.md").write_text(
        f"# {generation.get('model_type', 'model')}: text generation on Ascend\n\n"
        f"- {', '.join(f'`{g}/`' for g in reports)}: each graph's bundle (its own README: the MindSpore, Lite and\n"
        "  ATC routes and the reference check `compare_outputs.py`).\n"
        f"- `generate_mindspore.py`: greedy generation on an Ascend host ({how}):\n"
        "  `python generate_mindspore.py --input-ids '1,2,3;4,5' --max-new-tokens 16`; `--do-sample` (with\n"
        "  `--temperature`, `--top-k`, `--top-p`, `--seed`) samples as transformers does.\n"
        "- `generation.json`: token ids, layer and head counts, the cache layout "
        f"({generation.get('cache_layout', 'BNSD')}), each graph's inputs and outputs.\n"
        f"- Context: the script sets `jit_config={JIT_CONFIG!r}`, as each graph's README says (\"Context\").\n"
        + _state_note(generation))
    return ["README.md", "generate_mindspore.py", "generation.json"]


def _state_note(generation: dict) -> str:
    state = generation["graphs"]["decode"].get("state")
    if not state:
        return ""
    return (f"- The KV cache is held in place, in the graph's own Parameters: {state['max_batch']} rows of "
            f"{state['max_seq_len']} positions\n  (a prompt plus its new tokens, less one, must fit). Each call "
            "takes only ids, mask and positions; nothing\n  needs resetting between requests (a call writes its "
            "positions before it reads them). Load the MindIR once\n  per process: the cache lives in its "
            "GraphCell. Its Parameters are stored without their bytes\n  (generation.json's `state.params`): "
            "give them zeros at load, `nn.GraphCell(graph, params_init={name:\n  Tensor(shape=..., dtype=..., "
            "init=Zero())})`, as generate_mindspore.py does.\n")
