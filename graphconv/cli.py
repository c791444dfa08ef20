"""The `graphconv` command line: thin shells over the Python API.

Every failure ends in one line on stderr and the contract's exit code (1 bad input or unsupported model,
2 verification failed, 3 internal error); `--debug` adds the traceback. Usage errors are bad input (1).
"""

from __future__ import annotations

import errno
import json
import os
import sys
import traceback
import warnings
from pathlib import Path

import click

from graphconv.errors import GraphconvError, InputError, disk_full
from graphconv.progress import Progress
from graphconv.compiler.targets import TARGETS
from graphconv.frontend.tasks import NAMES as TASK_NAMES
from graphconv.version import __version__

_DEBUG = {"on": False}
_WRITING: dict = {"path": None}


def _set_debug(on: bool) -> None:
    """--debug: tracebacks of internal errors, and onnxruntime's own log (graphconv/verify/reference.py)."""
    _DEBUG["on"] = on
    if on:
        os.environ["GRAPHCONV_DEBUG"] = "1"
        if not sys.warnoptions:
            warnings.simplefilter("default")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="graphconv")
def cli() -> None:
    """Compile PyTorch-born ONNX models into verified MindSpore MindIR for Ascend."""


def _precision_options(command):
    """--precision and --keep-fp32, shared by compile and debug (passes.precision)."""
    command = click.option("--keep-fp32", "keep_fp32", metavar="OP,...",
                           help="Op types computed in fp32 at fp16/bf16: replaces the default set (`graphconv "
                                "passes` lists it); +OP,... adds to it; none keeps nothing.")(command)
    from passes.precision import PRECISIONS

    return click.option("--precision", type=click.Choice(PRECISIONS), default="fp32",
                        show_default=True,
                        help="Weights and compute dtype; numerically sensitive ops stay fp32 "
                             "(see --keep-fp32).")(command)


@cli.command("compile")
@click.argument("model", type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path),
              help="MindIR to write (default: MODEL with .mindir); for a generation pair, the new folder.")
@click.option("--target", type=click.Choice(list(TARGETS)), default="ascend", show_default=True,
              help="; ".join(f"{t.name}: {t.help}" for t in TARGETS.values()) + ".")
@click.option("--no-simplify", is_flag=True, help="Skip onnxsim.")
@click.option("--no-verify", is_flag=True, help="Skip running the MindIR against the oracle (report: unverified).")
@click.option("--inputs", "inputs", multiple=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Reference inputs (.npz keyed by graph input name); repeatable. Default: generated. For a "
                   "generation pair: prefill=FILE.npz or decode=FILE.npz.")
@click.option("--dim", "dims", multiple=True, metavar="NAME=A,B",
              help="Two sizes for a symbolic dim in the generated reference inputs; repeatable.")
@click.option("--mask-input", "mask_inputs", multiple=True, metavar="NAME",
              help="Treat this input as an attention mask (left-padded row, padded outputs skipped).")
@_precision_options
@click.option("--atol", type=float, help="Absolute tolerance (default: the precision's, 1e-4 for fp32).")
@click.option("--rtol", type=float, help="Relative tolerance (default: the precision's, 1e-4 for fp32).")
@click.option("--report", "report_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the JSON report here.")
@click.option("--emit-source", type=click.Path(file_okay=False, path_type=Path),
              help="Also write the generated MindSpore network.py and network.ckpt into this new directory.")
@click.option("--passes", "pass_spec", metavar="P1,P2,...",
              help="The pass pipeline, in order (default: every default pass; see `graphconv passes`).")
@click.option("--disable-pass", "disable_passes", multiple=True, metavar="NAME",
              help="Leave this pass out; repeatable.")
@click.option("--plugin", "plugins", multiple=True, metavar="MODULE",
              help="Import MODULE first; its register_pass/rewrite_pass calls add passes. Repeatable.")
@click.option("--verify-each", is_flag=True,
              help="Check the graph against the oracle after every pass; name the first pass that breaks it.")
@click.option("--layer-streamed/--whole-network", "layer_streamed", default=None,
              help="Verify block by block and run onnxruntime layer by layer, one layer's weights at a time "
                   "(default: past 2 GiB of weights), or whole.")
@click.option("--save-fused", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the fused ONNX graph (mindspore-domain ops with their function bodies).")
@click.option("--bundle", type=click.Path(file_okay=False, path_type=Path),
              help="Also write an Ascend deploy bundle into this new directory (see docs/cli.md).")
@click.option("--soc", default="Ascend910B", show_default=True, help="Ascend SoC the bundle's commands target.")
@click.option("--cann", metavar="VERSION", help="CANN version for the bundle's ATC commands (default: newest known).")
@click.option("--shape-range", "shape_range", metavar="DIM=MIN..MAX,...",
              help="Ranges of the symbolic dims for the bundle's dynamic-shape profiles, e.g. batch=1..8,seq=1..2048.")
@click.option("--stateful-cache/--no-stateful-cache", "stateful_cache", default=None,
              help="Generation folder: hold the KV cache in place (Parameters written by each call), or pass it in "
                   "and out (default: in place where the graph and the capacity allow, else in and out, saying why).")
@click.option("--max-batch", type=click.IntRange(min=1), default=8, show_default=True,
              help="Generation folder, cache held in place: its rows (prompts per generate call).")
@click.option("--max-seq-len", type=click.IntRange(min=2),
              help="Generation folder, cache held in place: its positions (default: the model's "
                   "max_position_embeddings, at most 4096).")
@click.option("--cpu-twin/--no-cpu-twin", "cpu_twin", default=None,
              help="Generation folder, --target ascend: write the cpu MindIRs too (default: where this host's "
                   "memory can run them).")
@click.option("--tp", type=int, metavar="N",
              help="Tensor parallelism over N ranks: -o names a new directory of rank_<i>.mindir, plan.json and an "
                   "msrun launch script; verified under msrun on CPU (see docs/cli.md).")
@click.option("--quantize", metavar="SCHEME",
              help="Quantize the float model first, with onnxruntime's tools: w4a16[:GROUP] (default group 128), "
                   "w8a16[:GROUP] (default per channel) or w8a8 (with --calibration); see docs/cli.md.")
@click.option("--calibration", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE.npz",
              help="--quantize w8a8: calibration inputs (.npz keyed by graph input name, as --inputs).")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report on stdout instead of the summary.")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors.")
@click.option("--debug", is_flag=True, help="Show tracebacks of internal errors.")
def compile_cmd(model, output, target, no_simplify, no_verify, inputs, dims, mask_inputs, precision, keep_fp32,
                atol, rtol, report_path, emit_source, pass_spec, disable_passes, plugins, verify_each, layer_streamed,
                save_fused, bundle, soc, cann, shape_range, tp, as_json, quiet, debug, **flags):
    """Compile MODEL (.onnx) into a MindIR, verified against onnxruntime on CPU.

    MODEL may be the folder `graphconv export --task text-generation-with-past` wrote: both graphs are
    compiled and verified into the new folder -o GEN_DIR (see docs/cli.md), ready for `graphconv generate`.
    """
    from graphconv import interrupts
    from graphconv.generation.build import compile_generation, is_generation_source
    from graphconv.generation.report import summary
    from graphconv.options import CompileOptions, GenerationOptions, parse_dims, parse_shape_ranges
    from graphconv.pipeline import compile_model

    _set_debug(debug)
    options = CompileOptions(
        output=output, target=target, simplify=not no_simplify, verify=not no_verify, inputs=tuple(inputs),
        dims=parse_dims(dims), mask_inputs=tuple(mask_inputs), atol=atol, rtol=rtol, report_path=report_path,
        emit_source=emit_source, passes=pass_spec, disable_passes=tuple(disable_passes), plugins=tuple(plugins),
        verify_each=verify_each, save_fused=save_fused, bundle=bundle, soc=soc, cann=cann,
        shape_ranges=parse_shape_ranges(shape_range), precision=precision, keep_fp32=keep_fp32,
        layer_streamed=layer_streamed, tp=tp, quantize=flags.pop("quantize"), calibration=flags.pop("calibration"),
        generation=GenerationOptions(**flags))  # (the rest: --[no-]stateful-cache, --max-batch, ...)
    options.validate()
    _writing(output or model.with_suffix(".mindir"))
    interrupts.one_result()
    progress = Progress.for_cli(quiet)
    if is_generation_source(model, options):
        report = compile_generation(model, options, progress)
        if as_json:
            click.echo(json.dumps(report, indent=2, default=str))
        elif not quiet:
            click.echo(summary(report))
        return
    if model.is_dir():
        raise click.UsageError(f"{model} is a folder without generation.json: give an .onnx file")
    try:
        report = compile_model(model, options, progress)
    except GraphconvError as e:
        if getattr(e, "report", None) is not None and e.exit_code == 2 and not quiet:
            click.echo(e.report.to_json() if as_json else e.report.summary(), err=not as_json)
        raise
    if as_json:
        click.echo(report.to_json())
    elif not quiet:
        click.echo(report.summary())


@cli.command("export")
@click.argument("source", metavar="SOURCE")
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path),
              help="ONNX file to write (a factory), or the new directory to create (a checkpoint folder).")
@click.option("--task", type=click.Choice(TASK_NAMES), default="auto", show_default=True,
              help="Checkpoint folders: which graphs to export, by optimum's task names; auto takes the task the "
                   "config implies and prints it.")
@click.option("--dtype", type=click.Choice(["fp32", "auto", "bf16", "fp16"]), default="fp32", show_default=True,
              help="Checkpoint folders: the stored weights' dtype (auto: the checkpoint's); the graph computes in "
                   "fp32 (a Cast where a bf16/fp16 weight is read).")
@click.option("--opset", type=int, help="ONNX opset (14-28). Default: 17 for a factory, 18 for a checkpoint folder.")
@click.option("--exporter", type=click.Choice(["auto", "dynamo", "torchscript"]), default="auto", show_default=True,
              help="auto: dynamo (dynamic_shapes), then TorchScript (dynamic_axes) if dynamo refuses the model. "
                   "Checkpoint folders: dynamo.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors.")
@click.option("--debug", is_flag=True, help="Show tracebacks of internal errors.")
def export_cmd(source, output, task, dtype, opset, exporter, as_json, quiet, debug):
    """Export a PyTorch model to ONNX with dynamic axes and check it against PyTorch at two shapes.

    SOURCE is a factory or a local transformers checkpoint folder. A factory PACKAGE.MODULE:FACTORY() returns
    (module, example_inputs, dynamic_axes): example_inputs maps input names to tensors (passed as keyword
    arguments), dynamic_axes maps input names to {axis: dim name}. A zoo name such as `llama` (see
    models/__init__.py) works too.

    A checkpoint folder (config.json and *.safetensors, as save_pretrained writes it; loaded locally, no remote
    code) exports the task --task names, or by default the one its config implies; -o names a new directory
    that receives model.onnx (or prefill.onnx and decode.onnx for text-generation-with-past) and generation.json.
    """
    import dataclasses
    import json

    from graphconv import interrupts

    _set_debug(debug)
    _writing(output)
    interrupts.one_result()
    progress = Progress.for_cli(quiet)
    from graphconv.frontend.export import is_factory_name
    from graphconv.frontend.hf_export import DEFAULT_OPSET, export_checkpoint, is_checkpoint_dir

    # A folder when --task says so, or when SOURCE is a directory and no factory name (a zoo name such as
    # `llama` stays the factory even where a folder of that name happens to be in the working directory).
    if task != "auto" or (is_checkpoint_dir(source) and not is_factory_name(source)):
        if exporter != "auto":
            raise click.UsageError("--exporter applies to factories; checkpoint folders export with dynamo")
        result = export_checkpoint(source, output, task, dtype=dtype, opset=opset or DEFAULT_OPSET,
                                   progress=progress)
        if as_json:
            click.echo(json.dumps({"path": str(result.out_dir), **result.generation}, indent=2))
            return
        for note in result.generation["notes"]:
            progress.warn(note)
        if not quiet:
            files = ", ".join(r.path.name for r in result.graphs.values())
            click.echo(f"wrote {result.out_dir}: {files}, generation.json ({result.model_type}, "
                       f"{result.generation['task']})")
            for name, r in result.graphs.items():
                for shape in dict.fromkeys(c["shape"] for c in r.checks):
                    cs = [c for c in r.checks if c["shape"] == shape]
                    click.echo(f"  {name}: onnxruntime vs PyTorch at {shape} {cs[0]['inputs']}: {len(cs)} "
                               f"outputs, max_abs {max(c['max_abs'] for c in cs):.3g}")
        return

    from graphconv.frontend.export import export_pytorch, load_factory

    if output.is_dir():
        raise click.UsageError(f"-o {output} is a directory (a factory exports one .onnx file)")
    opset = opset or 17
    try:
        build = load_factory(source)
    except (ValueError, ImportError) as e:
        raise click.UsageError(f"cannot load factory {source!r}: {e}") from None
    built = build()
    if not (isinstance(built, tuple) and len(built) == 3 and isinstance(built[1], dict)):
        raise click.UsageError(f"{source} must return (module, example_inputs: dict, dynamic_axes: dict)")
    module, example_inputs, dynamic_axes = built
    progress.info(f"export {source} with {exporter} at opset {opset}")
    result = export_pytorch(module, example_inputs, output, dynamic_axes, opset=opset, exporter=exporter)
    if as_json:
        click.echo(json.dumps({**dataclasses.asdict(result), "path": str(result.path)}, indent=2))
        return
    for note in result.warnings:
        progress.warn(note)
    if not quiet:
        click.echo(f"wrote {result.path} ({result.exporter} exporter, opset {result.opset})")
        for c in result.checks:
            click.echo(f"  onnxruntime vs PyTorch at {c['shape']} {c['inputs']}: max_abs {c['max_abs']:.3g} "
                       f"cosine {c['cosine']:.6f}")


@cli.command("generate")
@click.argument("gen_dir", metavar="GEN_DIR", type=click.Path(file_okay=False, path_type=Path))
@click.option("--input-ids", "input_ids", metavar="'1,2,3;4,5'",
              help="The prompts: token ids separated by commas, prompts by semicolons.")
@click.option("--input-ids-file", type=click.Path(dir_okay=False, path_type=Path),
              help="The prompts as a JSON list of lists of token ids.")
@click.option("--prompt", "texts", multiple=True, metavar="TEXT",
              help="A prompt as text (repeatable), encoded by the checkpoint's tokenizer; the output is decoded.")
@click.option("--max-new-tokens", type=int, default=16, show_default=True, help="New tokens per prompt, at most.")
@click.option("--device", type=click.Choice(["auto", "ascend", "cpu"]), default="auto", show_default=True,
              help="auto: the --target MindIRs on an Ascend host, else the cpu ones (*.cpu.mindir).")
@click.option("--check", is_flag=True,
              help="Compare every step's logits with onnxruntime running the ONNX pair on the same inputs.")
@click.option("--onnx-dir", type=click.Path(file_okay=False, path_type=Path),
              help="With --check: the folder of prefill.onnx + decode.onnx (default: generation.json's "
                   "source_dir, else GEN_DIR/onnx).")
@click.option("--atol", type=float, default=1e-4, show_default=True, help="With --check: the logits' tolerance.")
@click.option("--do-sample", is_flag=True,
              help="Sample each token as transformers' generate(do_sample=True) does (default: greedy).")
@click.option("--temperature", type=float,
              help="With --do-sample (default: the checkpoint's generation_config, else 1).")
@click.option("--top-k", type=int, help="With --do-sample: keep the k highest logits, 0 keeps all (default: the "
              "checkpoint's, else 50).")
@click.option("--top-p", type=float, help="With --do-sample: keep the smallest set of tokens whose probability "
              "reaches p (default: the checkpoint's, else 1).")
@click.option("--seed", type=int, help="With --do-sample: the random seed (default: one is drawn, and printed).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing but the ids and errors.")
@click.option("--debug", is_flag=True, help="Show tracebacks of internal errors.")
def generate_cmd(gen_dir, input_ids, input_ids_file, texts, max_new_tokens, device, check, onnx_dir, atol, do_sample,
                 temperature, top_k, top_p, seed, as_json, quiet, debug):
    """Greedy decoding (or, with --do-sample, sampling) with the compiled generation folder GEN_DIR (what
    `graphconv compile` writes for an `export --task text-generation-with-past` folder). Prints one line per
    prompt: its new token ids, or with --prompt its new text as a JSON string."""
    import tempfile

    from graphconv.generation.run import generate, parse_input_ids, read_input_ids_file

    _set_debug(debug)
    _writing(tempfile.gettempdir())  # (its only files: a private directory there)
    if [input_ids is not None, input_ids_file is not None, bool(texts)].count(True) != 1:
        raise click.UsageError("give the prompts with --input-ids, --input-ids-file or --prompt (one of them)")
    given = {"--temperature": temperature, "--top-k": top_k, "--top-p": top_p, "--seed": seed}
    if not do_sample and any(v is not None for v in given.values()):
        raise click.UsageError(f"{', '.join(k for k, v in given.items() if v is not None)} "
                               "go(es) with --do-sample (greedy decoding draws nothing)")
    prompts = parse_input_ids(input_ids) if input_ids is not None else \
        read_input_ids_file(input_ids_file) if input_ids_file is not None else None
    progress = Progress.for_cli(quiet)
    try:
        sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed} if do_sample else None
        result = generate(gen_dir, prompts, max_new_tokens, check=check, device=device, onnx_dir=onnx_dir,
                          atol=atol, progress=progress, text=list(texts) if texts else None, sampling=sampling)
    except GraphconvError as e:
        if getattr(e, "result", None) is not None and as_json:
            click.echo(e.result.to_json())
        raise
    if as_json:
        click.echo(result.to_json())
        return
    for k, seq in enumerate(result.sequences):
        click.echo(json.dumps(result.texts[k], ensure_ascii=False) if result.texts is not None
                   else " ".join(str(t) for t in seq))
    if check and not quiet:
        worst = max(s["max_abs"] for s in result.steps)
        click.echo(f"check: {len(result.steps)} steps match onnxruntime (max_abs {worst:.3g})", err=True)


@cli.command("matrix")
@click.option("--full", is_flag=True, help="Every zoo model x exporter x opset 14-28, and every hf/ architecture x "
              "exporter at 17, 18, 23 and dynamo at 24-28 (long).")
@click.option("--model", "models", multiple=True, metavar="NAME",
              help="Only these models (repeatable): zoo names, or hf/NAME for models/architectures.py.")
@click.option("--exporter", "exporters", multiple=True, type=click.Choice(["dynamo", "torchscript"]))
@click.option("--opset", "opsets", multiple=True, type=int)
@click.option("--no-docs", is_flag=True, help="Do not rewrite docs/opset-matrix.md and .json.")
@click.option("--json", "as_json", is_flag=True, help="Print the cells as JSON on stdout.")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors.")
def matrix_cmd(full, models, exporters, opsets, no_docs, as_json, quiet):
    """Run the opset compatibility matrix and regenerate docs/opset-matrix.md.

    Default: the CI slice (dynamo at opsets 17 and 18 for every plain zoo model; dynamo 18 for the hf/
    architectures of the CI slice). A cell passes when its fused census equals the architecture's. Exit code 2
    when a cell that passed in docs/opset-matrix.json now fails or a fused-primitive count dropped.
    """
    import dataclasses
    import json

    from graphconv.tools import matrix
    from graphconv.errors import VerificationError

    known = matrix.model_names(full=True)
    names = list(models) or matrix.model_names(full)
    unknown = [m for m in names if m not in known]
    if unknown:
        raise click.UsageError(f"unknown zoo model(s) {unknown}; choose from {', '.join(known)}")
    exporters = exporters or (matrix.EXPORTERS if full else matrix.SLICE["exporters"])
    hf_opsets = opsets or (matrix.HF_OPSETS if full else matrix.HF_SLICE_OPSETS)
    opsets = opsets or (matrix.OPSETS if full else matrix.SLICE["opsets"])
    progress = Progress.for_cli(quiet)
    baseline = matrix.load_baseline()
    cells = matrix.run_matrix(names, exporters, opsets, progress, hf_opsets=hf_opsets)
    if not no_docs:
        matrix.write_docs(cells)
    if as_json:
        click.echo(json.dumps([dataclasses.asdict(c) for c in cells], indent=1))
    elif not quiet:
        passed = sum(c.status == "pass" for c in cells)
        click.echo(f"{passed} of {len(cells)} cells pass")
        for c in cells:
            if c.status != "pass":
                click.echo(f"  {c.key}: {c.status}: {c.reason[:200]}")
    found = matrix.regressions(cells, baseline)
    if found:
        raise VerificationError(f"{len(found)} regression(s): " + "; ".join(found))


@cli.command("debug")
@click.argument("model", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--inputs", type=click.Path(dir_okay=False, path_type=Path), help="Inputs (.npz); default: generated.")
@click.option("--target", type=click.Choice(["cpu"]), default="cpu", show_default=True,
              help="The network to run (fused ops replaced by their reference bodies).")
@click.option("--passes", "pass_spec", metavar="P1,P2,...", help="Pass pipeline (default: the default one).")
@_precision_options
@click.option("--atol", type=float, help="Absolute tolerance (default: the precision's, 1e-4 for fp32).")
@click.option("--rtol", type=float, help="Relative tolerance (default: the precision's, 1e-4 for fp32).")
@click.option("--mask-input", "mask_inputs", multiple=True, metavar="NAME", help="Treat NAME as an attention mask.")
@click.option("--save", type=click.Path(file_okay=False, path_type=Path),
              help="Write each compared tensor pair as NAME.onnxruntime.npy / NAME.mindspore.npy here.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (rows and first_divergent) on stdout.")
def debug_cmd(model, inputs, target, pass_spec, precision, keep_fp32, atol, rtol, mask_inputs, save, as_json):
    """Run onnxruntime and the MindSpore network with every intermediate tensor exposed; name the first
    node that exceeds the tolerance."""
    import json

    from graphconv.verify.debug import debug

    report = debug(model, inputs, target, pass_spec, atol, rtol, save, tuple(mask_inputs), precision, keep_fp32)
    click.echo(json.dumps(report.to_dict(), indent=1) if as_json else report.table())


@cli.command("inspect")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--fusions", is_flag=True,
              help="ONNX: also run the fusion analysis of a compile (simplify + passes, nothing lowered or "
                   "written): per family the candidates, how many fuse, and each refusal with its pass and reason.")
@click.option("--passes", "pass_spec", metavar="P1,P2,...", help="With --fusions: the pass pipeline.")
@click.option("--disable-pass", "disabled", multiple=True, metavar="NAME", help="With --fusions: leave a pass out.")
@click.option("--no-simplify", is_flag=True, help="With --fusions: skip onnxsim.")
@click.option("--json", "as_json", is_flag=True,
              help="JSON on stdout: `ops` (ONNX, custom domains keyed domain::Op) or `primitives` (MindIR, "
                   "call-weighted census); with --fusions also `fusions` and `coverage`.")
def inspect_cmd(file, fusions, pass_spec, disabled, no_simplify, as_json):
    """Show inputs, outputs, op or primitive histogram, fused ops and parameters of an .onnx or .mindir; the
    parameters of a .ckpt (name, shape, dtype, source ONNX initializer from the names file beside it)."""
    import json

    from graphconv.tools.inspect import inspect, summary

    options = dict(passes=pass_spec, disable_passes=tuple(disabled), simplify=not no_simplify) if fusions else {}
    if not fusions and (pass_spec or disabled or no_simplify):
        raise InputError("--passes, --disable-pass and --no-simplify go with --fusions")
    info = inspect(file, fusions=fusions, **options)
    click.echo(json.dumps(info, indent=2) if as_json else summary(info))


@cli.command("conformance")
@click.option("--filter", "pattern", metavar="REGEX", help="Only node tests whose name matches (re.search).")
@click.option("--no-docs", is_flag=True, help="Do not rewrite docs/conformance.md (a --filter run never does).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary and every case as JSON on stdout.")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors.")
def conformance_cmd(pattern, no_docs, as_json, quiet):
    """Run onnx's node test suite through graphconv.tools.backend; print passed / failed / unsupported per op and in
    total, and regenerate docs/conformance.md (full runs only)."""
    import dataclasses
    import json
    import re

    from graphconv.tools import conformance

    if pattern:
        try:
            re.compile(pattern)
        except re.error as e:
            raise click.UsageError(f"--filter {pattern!r}: {e}") from None
    progress = Progress.for_cli(quiet)
    summary, outcomes, seconds = conformance.conformance(pattern, progress)
    if not pattern and not no_docs:
        progress.info(f"wrote {conformance.write_docs(summary, outcomes, seconds)}")
    if as_json:
        click.echo(json.dumps({"summary": summary, "seconds": round(seconds, 1),
                               "cases": [dataclasses.asdict(o) for o in outcomes]}, indent=1))
        return
    if quiet:
        return
    click.echo(f"{'op':<28} {'passed':>6} {'failed':>6} {'unsupp':>6}   (applicable cases; +N not applicable)")
    for op, c in summary["ops"].items():
        ap, ot = c["applicable"], c["other"]
        extra = f"   +{ot['cases']} n/a ({ot['passed']} pass)" if ot["cases"] else ""
        click.echo(f"{op:<28} {ap['passed']:>6} {ap['failed']:>6} {ap['unsupported']:>6}{extra}")
    t, a = summary["total"], summary["applicable"]
    click.echo(f"total {t['cases']} cases: {t['passed']} passed, {t['failed']} failed, {t['unsupported']} unsupported")
    click.echo(f"applicable {a['cases']}: {a['passed']} passed ({a['percent']}%), {a['failed']} failed, "
               f"{a['unsupported']} unsupported  [{seconds / 60:.1f} min]")


@cli.command("passes")
@click.option("--plugin", "plugins", multiple=True, metavar="MODULE", help="Import MODULE's passes too.")
def passes_cmd(plugins):
    """List the available passes, in default pipeline order."""
    import passes

    passes.load_plugins(tuple(plugins))
    for p in passes.available_passes():
        flag = "" if p.default else " (not in the default pipeline)"
        origin = "" if p.origin == "builtin" else f" [{p.origin}]"
        click.echo(f"{p.name:<20} {p.description}{flag}{origin}")
    from passes.precision import KEEP_FP32

    click.echo(f"\nkept in fp32 at --precision fp16/bf16 (--keep-fp32): {','.join(KEEP_FP32)}")


def _writing(path) -> None:
    """The output a command writes: a full disk's error names it (graphconv.errors.disk_full)."""
    _WRITING["path"] = None if path is None else str(Path(path).absolute())


def main(argv: list[str] | None = None) -> None:
    from graphconv import interrupts

    _WRITING["path"] = None
    previous = interrupts.install()  # SIGINT, SIGTERM: exit 130, 143 after the cleanup (graphconv/interrupts.py)
    if not sys.warnoptions:
        # Libraries' warnings (numpy's "overflow encountered" on a model's own values, deprecations) are not
        # graphconv's output: a failure is one line, and what a run noticed is in its report. --debug shows them.
        warnings.simplefilter("ignore")
    try:
        # (click's own main() answers an interrupt with an empty line on stderr: the run's one line is ours)
        with cli.make_context("graphconv", list(sys.argv[1:] if argv is None else argv)) as ctx:
            cli.invoke(ctx)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except (click.exceptions.Abort, KeyboardInterrupt):
        interrupts.exit_interrupted()
    except click.UsageError as e:
        click.echo(f"graphconv: error: {e.format_message()}", err=True)
        sys.exit(1)
    except Exception as e:  # noqa: BLE001 - the one place internal errors become exit code 3
        if _DEBUG["on"]:
            traceback.print_exc()
        if interrupts.received() is not None:  # (an error the interrupt's unwinding caused: still the interrupt)
            interrupts.exit_interrupted()
        if isinstance(e, OSError) and e.errno == errno.EPIPE:  # (stdout closed by its reader: as click's main)
            sys.stdout = None
            sys.exit(1)
        e = disk_full(e, _WRITING["path"]) or e  # (wherever the writer was: one line, exit 1)
        if isinstance(e, GraphconvError):
            click.echo(f"graphconv: error: {e}", err=True)
            sys.exit(e.exit_code)
        click.echo(f"graphconv: internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback)",
                   err=True)
        sys.exit(3)
    finally:
        interrupts.restore(previous)
    sys.exit(0)


def run() -> None:
    """The `graphconv` command (its console script, and `python -m graphconv`): main(), then the process ends
    as graphconv.runtime.scheduling.end says (without the interpreter's teardown, by default). main() itself
    ends in SystemExit (in-process callers, tests)."""
    from graphconv import interrupts

    try:
        main()
        code = 0
    except SystemExit as e:
        if isinstance(e.code, str):  # (click's, or a library's, message instead of a number)
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except KeyboardInterrupt:  # (a signal in main's first or last instructions)
        code = interrupts.interrupted()
    interrupts.ignore()
    from graphconv.runtime import scheduling

    scheduling.end(code)
