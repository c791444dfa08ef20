"""Writing the bundle: the files the pipeline hands over (hard-linked when possible), the reference data, every
route's scripts and commands (built from the option tables, the profiles and the ATC-ready ONNX), the README
and manifest.json; then every command written is read back by the option tables' linter.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import onnx

from graphconv.verify import compare, reference
from graphconv.deploy.opset import AtcOnnx, clamp_opset
from graphconv.deploy.options import (CANN_OPSETS, DEFAULT_CANN, DOC, JIT_CONFIG, MINDSPORE_CANN, PRECISIONS,
                                      TOLERANCE_KEY, CommandError, cann_opset_range, check_command, check_lite_config,
                                      command, extract_commands, shell_line)
from graphconv.deploy.profiles import Dims, atc_input_shape, collect_dims, dim_key, profile_values, profiles
from graphconv.deploy.scripts import compare_script, fill, template
from graphconv.errors import InputError, InternalError
from graphconv.version import __version__

# ----------------------------------------------------------------------------------------------------------
# What the pipeline hands over.


@dataclasses.dataclass
class BundleContext:
    name: str
    mindir: Path
    variables: Path | None
    onnx_model: onnx.ModelProto  # the simplified ONNX, before fusion
    source: Path  # generated network.py
    checkpoint: Path  # network.ckpt
    inputs: list[dict]  # {"name", "dtype", "shape": [int | str | None]}
    outputs: list[dict]
    cases: list  # graphconv.verify.reference.ReferenceCase
    expected: list[dict] | None  # per case: output name -> np.ndarray
    precision: str = "fp32"
    target: str = "ascend"
    soc: str = "Ascend910B"
    cann: str | None = None
    shape_ranges: dict = dataclasses.field(default_factory=dict)  # dim -> (min, max)
    census: dict = dataclasses.field(default_factory=dict)
    tools: dict = dataclasses.field(default_factory=dict)
    warnings: list[str] = dataclasses.field(default_factory=list)


def check_options(inputs: list[dict], shape_ranges: dict, cann: str | None) -> None:
    """Raise InputError for bundle options that write_bundle would refuse (call it before a long compile)."""
    cann_opset_range(cann)
    collect_dims(inputs, [], shape_ranges)


# ----------------------------------------------------------------------------------------------------------
# Writing.


class _Writer:
    """All writes of one bundle; refuses any path that leaves the bundle directory."""

    def __init__(self, root: Path):
        self.root = Path(root).resolve()
        self.written: list[str] = []

    def path(self, rel: str) -> Path:
        p = (self.root / rel).resolve()
        if p != self.root and self.root not in p.parents:
            raise InternalError(f"bundle: refusing to write {rel!r} outside {self.root}")
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def _record(self, rel: str) -> None:
        self.written.append(Path(rel).as_posix())

    def text(self, rel: str, content: str, executable: bool = False) -> None:
        p = self.path(rel)
        p.write_text(content)
        if executable:
            p.chmod(0o755)
        self._record(rel)

    def npz(self, rel: str, arrays: dict[str, np.ndarray]) -> None:
        with open(self.path(rel), "wb") as f:
            np.savez(f, **arrays)
        self._record(rel)

    def npy(self, rel: str, array: np.ndarray) -> None:
        with open(self.path(rel), "wb") as f:
            np.save(f, array)
        self._record(rel)

    def link(self, src: Path, rel: str) -> str:
        """Hard link when src is on the same filesystem, else a copy; returns how."""
        dst = self.path(rel)
        try:
            os.link(src, dst)
            how = "hard link"
        except OSError:
            shutil.copy2(src, dst)
            how = "copy"
        self._record(rel)
        return how

    def onnx(self, rel: str, model: onnx.ModelProto) -> None:
        from graphconv.frontend.weights import save_self_contained

        for written in save_self_contained(model, self.path(rel)):  # weights beside it past 2 GB
            self._record(str(Path(rel).with_name(written.name)))


def _np_ready(arr: np.ndarray) -> tuple[np.ndarray, str]:
    """Arrays as plain numpy can read them back; bfloat16 (an ml_dtypes type) is stored as float32."""
    if arr.dtype.name == "bfloat16":
        return arr.astype(np.float32), "float32 (bfloat16 in the model)"
    return np.asarray(arr), str(arr.dtype)


def _mindir_info(path: Path) -> dict:
    try:
        from graphconv.verify import census

        m = census.read_mindir(path)
        return {"producer_name": m.producer_name, "model_version": m.model_version,
                "ir_version": m.ir_version, "mind_ir_version": int(m.mind_ir_version)}
    except Exception:  # noqa: BLE001 - informational only
        return {}


def write_bundle(directory: Path, ctx: BundleContext) -> list[str]:
    """Write the bundle into `directory` (it exists and is empty); returns the relative paths written."""
    directory = Path(directory)
    if not directory.is_dir():
        raise InputError(f"bundle directory {directory} does not exist")
    if any(directory.iterdir()):
        raise InputError(f"bundle directory {directory} is not empty")
    if ctx.precision not in PRECISIONS:
        raise InputError(f"bundle: unknown precision {ctx.precision!r} (choose from {', '.join(PRECISIONS)})")
    w = _Writer(directory)
    name = ctx.name
    dims = collect_dims(ctx.inputs, ctx.cases, ctx.shape_ranges)
    plan = _Plan(ctx, dims)

    # model, source, onnx
    how = {"mindir": w.link(ctx.mindir, f"model/{name}.mindir")}
    if ctx.variables is not None and Path(ctx.variables).is_dir():
        for f in sorted(Path(ctx.variables).rglob("*")):
            if f.is_file():
                w.link(f, f"model/{Path(ctx.variables).name}/{f.relative_to(ctx.variables).as_posix()}")
    how["source"] = w.link(ctx.source, "source/network.py")
    how["checkpoint"] = w.link(ctx.checkpoint, "source/network.ckpt")
    w.onnx(f"onnx/{name}.onnx", ctx.onnx_model)
    converted, atc_onnx, opset_warnings = clamp_opset(ctx.onnx_model, ctx.cann, ctx.cases, ctx.precision)
    ctx.warnings.extend(opset_warnings)
    if converted is not None:
        atc_onnx.path = f"onnx/{name}.opset{atc_onnx.opset}.onnx"
        w.onnx(atc_onnx.path, converted)
    else:
        atc_onnx.path = f"onnx/{name}.onnx"
    plan.atc_onnx = atc_onnx

    # reference data
    expected = ctx.expected
    if expected is None and ctx.cases:
        try:
            expected = reference.Oracle(ctx.onnx_model).run(ctx.cases)
        except Exception as e:  # noqa: BLE001
            ctx.warnings.append(f"bundle: no reference outputs ({e}); compare_outputs.py has nothing to compare")
    cases_meta = write_reference(w, ctx.inputs, ctx.outputs, ctx.cases, expected, ctx.precision)

    # scripts and configs
    w.text("compare_outputs.py", compare_script(), executable=True)
    w.text("mindspore/infer_mindspore.py", plan.mindspore_script(), executable=True)
    w.text("lite/converter.cfg", plan.lite_config())
    w.text("lite/convert_lite.sh", plan.lite_shell(), executable=True)
    w.text("lite/infer_lite.py", plan.lite_script(), executable=True)
    w.text("atc/atc_onnx.sh", plan.atc_onnx_shell(), executable=True)
    w.text("atc/export_air.py", plan.air_script(), executable=True)
    w.text("atc/atc_air.sh", plan.atc_air_shell(), executable=True)
    ctx.warnings.extend(plan.warnings)
    mindir_info = _mindir_info(ctx.mindir)
    w.text("README.md", plan.readme(how, mindir_info, cases_meta))
    manifest = {
        "graphconv": __version__, "name": name, "target": ctx.target, "soc": ctx.soc,
        "cann": ctx.cann or DEFAULT_CANN, "precision": ctx.precision, "tools": dict(sorted(ctx.tools.items())),
        "mindir": mindir_info, "inputs": ctx.inputs, "outputs": ctx.outputs,
        "shape_ranges": {k: list(v) for k, v in dims.ranges.items()},
        "profiles": {"dims": dims.dynamic, "values": [list(p) for p in plan.profiles]},
        "onnx": {"file": f"onnx/{name}.onnx", "opset": atc_onnx.original_opset, "atc_file": atc_onnx.path,
                 "atc_opset": atc_onnx.opset, "cann_row": atc_onnx.cann_row, "accepted": list(atc_onnx.accepted),
                 "converted": atc_onnx.converted},
        "commands": {k: [list(c) for c in v] for k, v in plan.commands.items()},
        "census": dict(sorted(ctx.census.items())), "warnings": list(ctx.warnings),
    }
    w.text("manifest.json", _json(manifest) + "\n")
    _self_check(directory)
    return sorted(set(w.written))


def write_reference(w: _Writer, inputs: list[dict], outputs: list[dict], cases: list, expected: list[dict] | None,
                    precision: str) -> list[dict]:
    """reference/: each case's inputs and (where known) expected outputs as .npz keyed by graph name, its mask,
    and cases.json with the comparison rule compare_outputs.py applies; returns the cases' entries."""
    cases_meta = []
    for k, case in enumerate(cases):
        entry = {"name": case.name, "inputs": f"reference/{case.name}.inputs.npz", "shapes": {}, "stored": {}}
        arrays = {}
        for spec in inputs:
            arr, stored = _np_ready(case.inputs[spec["name"]])
            arrays[spec["name"]] = arr
            entry["shapes"][spec["name"]] = list(arr.shape)
            entry["stored"][spec["name"]] = stored
        w.npz(entry["inputs"], arrays)
        if expected is not None:
            entry["outputs"] = f"reference/{case.name}.outputs.npz"
            w.npz(entry["outputs"], {n: _np_ready(v)[0] for n, v in expected[k].items()})
        entry["mask"] = None
        if case.mask is not None:
            entry["mask"] = f"reference/{case.name}.mask.npy"
            w.npy(entry["mask"], np.asarray(case.mask, dtype=bool))
        cases_meta.append(entry)
    atol, rtol = compare.default_tolerance(TOLERANCE_KEY[precision])
    w.text("reference/cases.json", json.dumps({
        "precision": precision, "atol": atol, "rtol": rtol,
        "rule": "|actual - reference| <= atol + rtol * |reference|, elementwise; integers and bools exactly; "
                "inf/NaN must match in kind; positions where the mask row is 0 are skipped",
        "inputs": inputs, "outputs": outputs, "cases": cases_meta}, indent=2) + "\n")
    return cases_meta


def _json(obj, indent: int = 0) -> str:
    """JSON with lists of scalars kept on one line (profiles and commands stay readable)."""
    pad, inner = "  " * indent, "  " * (indent + 1)
    if isinstance(obj, dict) and obj:
        items = [f"{inner}{json.dumps(str(k))}: {_json(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(obj, list) and obj and any(isinstance(v, (dict, list)) for v in obj):
        return "[\n" + ",\n".join(f"{inner}{_json(v, indent + 1)}" for v in obj) + f"\n{pad}]"
    return json.dumps(obj)


def check_bundle(directory: Path) -> list[str]:
    """Every tool command in the bundle's scripts and README, and its converter_lite config, against the
    option tables. [] when all agree."""
    directory = Path(directory)
    problems = []
    for f in sorted(directory.rglob("*")):
        if f.suffix in (".sh", ".md"):
            for argv in extract_commands(f.read_text()):
                problems += [f"{f.relative_to(directory)}: {p}" for p in check_command(argv)]
        elif f.suffix == ".cfg":
            problems += [f"{f.relative_to(directory)}: {p}" for p in check_lite_config(f.read_text())]
    return problems


def _self_check(directory: Path) -> None:
    problems = check_bundle(directory)
    if problems:
        raise InternalError("bundle: generated commands contradict the option tables: " + "; ".join(problems[:5]))


# ----------------------------------------------------------------------------------------------------------
# The route plan: every command and script text, built from the context.


class _Plan:
    def __init__(self, ctx: BundleContext, dims: Dims):
        self.ctx = ctx
        self.dims = dims
        self.name = ctx.name
        self.profiles, self.profile_notes = profiles(dims)
        self.warnings = [f"bundle: {n}" for n in self.profile_notes if "outside --shape-range" in n]
        self.atc_onnx: AtcOnnx | None = None
        self.commands: dict[str, list[list[str]]] = {}
        self.atc_precision, self.lite_precision = PRECISIONS[ctx.precision]
        from opmap.fused import fp16_primitives  # (the records say which primitives compute in fp16)

        fp16_prims = sorted(p for p in ctx.census if p in fp16_primitives())
        self.device_precision = "fp16" if (ctx.target == "ascend" and fp16_prims and ctx.precision == "fp32") \
            else ctx.precision
        self.fp16_prims = fp16_prims
        if re.fullmatch(r"Ascend910B", ctx.soc):
            self.soc_note = ("`--soc_version` must be the exact name `npu-smi info` reports, prefixed with Ascend "
                             f"(Atlas A2 parts are Ascend910B1..B4); if ATC refuses `{ctx.soc}`, recompile with "
                             "that name in `--soc`.")
        else:
            self.soc_note = "`--soc_version` must be the exact name `npu-smi info` reports, prefixed with Ascend."

    # --- route (a)
    def mindspore_script(self) -> str:
        return fill(template("infer_mindspore.py.tmpl"), NAME=self.name, INPUTS=repr(self.ctx.inputs),
                    OUTPUTS=repr([o["name"] for o in self.ctx.outputs]), PRECISION_MODE=self.atc_precision,
                    DEVICE_PRECISION=self.device_precision, JIT_CONFIG=repr(JIT_CONFIG),
                    WRITTEN_BY=self.ctx.tools.get("mindspore", "unknown"))

    # --- route (b)
    def _lite_layout(self) -> tuple[str, dict[str, dict[str, str]], dict[str, str]]:
        """(how, config sections, extra converter options)."""
        inputs, dims = self.ctx.inputs, self.dims
        sections: dict[str, dict[str, str]] = {"ascend_context": {}, "acl_build_options": {}}
        extra: dict[str, str] = {}
        dynamic_inputs = [s for s in inputs if any(dim_key(s["name"], a, d) in dims.dynamic
                                                    for a, d in enumerate(s["shape"]))]
        static_shape = atc_input_shape(inputs, dims, "profile") if not dims.dynamic else ""
        if not dims.dynamic:
            sections["ascend_context"]["input_format"] = "ND"
            if dims.names:  # symbolic dims pinned by --shape-range MIN==MAX
                extra["inputShape"] = static_shape
            how = "static"
        elif all(len(s["shape"]) == 4 and [(dim_key(s["name"], a, d) in dims.dynamic) for a, d in
                                           enumerate(s["shape"])] == [True, False, False, False]
                 for s in dynamic_inputs) and len(dims.dynamic) == 1:
            shape = ";".join(f"{s['name']}:[{item.rpartition(':')[2]}]" for s, item in
                             zip(inputs, atc_input_shape(inputs, dims, "profile").split(";")))
            per_input = ",".join(f"[{p[0]}]" for p in self.profiles)
            sections["ascend_context"].update({
                "input_format": "ND", "input_shape": shape,
                "dynamic_dims": ";".join(per_input for _ in inputs)})
            how = "ascend_context"
        else:
            sections["ascend_context"]["input_format"] = "ND"
            sections["acl_build_options"].update({
                "input_format": "ND", "input_shape": atc_input_shape(inputs, dims, "profile"),
                "ge.dynamicDims": ";".join(",".join(str(v) for v in profile_values(inputs, dims, p))
                                           for p in self.profiles)})
            how = "acl_build_options"
        sections["ascend_context"]["precision_mode"] = self.lite_precision
        return how, {k: v for k, v in sections.items() if v}, extra

    def lite_config(self) -> str:
        how, sections, _ = self._lite_layout()
        lines = [f"# MindSpore Lite converter_lite --configFile for {self.name} (generated by graphconv).",
                 "# Used on an Ascend host by lite/convert_lite.sh; keys: " + DOC["lite_ascend"]]
        if how == "acl_build_options":
            lines += ["# The model's dynamic inputs are not 4-D batch/image inputs, which is all that [ascend_context]",
                      "# dynamic_dims covers; the profiles are ND dynamic-dimension profiles in [acl_build_options]",
                      "# (input_shape with -1, ge.dynamicDims with one value per -1, input_format=ND).",
                      f"# Profiles over ({', '.join(self.dims.dynamic)}): {len(self.profiles)}; "
                      "the model runs only at these shapes."]
        elif how == "ascend_context":
            lines += [f"# Dynamic batch profiles over {self.dims.dynamic[0]}: {len(self.profiles)}."]
        for section, items in sections.items():
            lines += ["", f"[{section}]"] + [f"{k}={v}" for k, v in items.items()]
        text = "\n".join(lines) + "\n"
        problems = check_lite_config(text)
        if problems:
            raise CommandError("; ".join(problems))
        return text

    def lite_command(self) -> list[str]:
        _, _, extra = self._lite_layout()
        argv = command("converter_lite", {"fmk": "MINDIR", "modelFile": f"model/{self.name}.mindir",
                                          "outputFile": f"lite/{self.name}_ascend", "optimize": "ascend_oriented",
                                          "configFile": "lite/converter.cfg", **extra})
        self.commands["lite"] = [argv]
        return argv

    def lite_shell(self) -> str:
        return fill(template("convert_lite.sh.tmpl"), NAME=self.name, COMMAND=shell_line(self.lite_command()))

    def lite_script(self) -> str:
        return fill(template("infer_lite.py.tmpl"), NAME=self.name, INPUTS=repr(self.ctx.inputs),
                    OUTPUTS=repr([o["name"] for o in self.ctx.outputs]), DEVICE_PRECISION=self.device_precision)

    # --- route (c), ONNX
    def atc_onnx_commands(self) -> dict[str, list[str]]:
        assert self.atc_onnx is not None
        base = {"model": self.atc_onnx.path, "framework": "5", "output": f"om/{self.name}",
                "soc_version": self.ctx.soc}
        inputs, dims = self.ctx.inputs, self.dims
        out = {}
        rng = atc_input_shape(inputs, dims, "range")
        no_ranges = re.fullmatch(r"Ascend310(B\d*)?", self.ctx.soc) is not None
        if not no_ranges or not dims.dynamic:
            out["range"] = command("atc", {**base, "input_shape": rng, "input_format": "ND",
                                           "precision_mode": self.atc_precision, "log": "error"})
        if dims.dynamic and len(self.profiles) >= 2:
            out["profiles"] = command("atc", {
                **base, "output": f"om/{self.name}_profiles", "input_shape": atc_input_shape(inputs, dims, "profile"),
                "input_format": "ND", "dynamic_dims": ";".join(",".join(str(v) for v in profile_values(inputs, dims, p))
                                                               for p in self.profiles),
                "precision_mode": self.atc_precision, "log": "error"})
        self.commands["atc_onnx"] = list(out.values())
        return out

    def atc_onnx_shell(self) -> str:
        cmds = self.atc_onnx_commands()
        default = "range" if "range" in cmds else "profiles"
        branches = []
        for mode, argv in cmds.items():
            branches.append(f'  {mode})\n    {shell_line(argv)}\n    ;;')
        return fill(template("atc_onnx.sh.tmpl"), NAME=self.name, DEFAULT=default, MODES="|".join(cmds),
                    BRANCHES="\n".join(branches))

    # --- route (c), AIR
    def air_commands(self) -> list[list[str]]:
        cmds = []
        for case in self.ctx.cases:
            cmds.append(command("atc", {"model": f"air/{self.name}_{case.name}.air", "framework": "1",
                                        "output": f"om/{self.name}_air_{case.name}", "soc_version": self.ctx.soc,
                                        "precision_mode": self.atc_precision, "log": "error"}))
        self.commands["atc_air"] = cmds
        return cmds

    def atc_air_shell(self) -> str:
        return fill(template("atc_air.sh.tmpl"), NAME=self.name,
                    COMMANDS="\n".join(shell_line(c) for c in self.air_commands()))

    def air_script(self) -> str:
        return fill(template("export_air.py.tmpl"), NAME=self.name, INPUTS=repr(self.ctx.inputs),
                    CASES=repr([c.name for c in self.ctx.cases]), PRECISION_MODE=self.atc_precision)

    # --- README
    def readme(self, how: dict, mindir_info: dict, cases_meta: list[dict]) -> str:
        ctx, dims, a = self.ctx, self.dims, self.atc_onnx
        assert a is not None
        name = self.name
        tools = ctx.tools
        ms_version = tools.get("mindspore", "unknown")
        lite_how, _, _ = self._lite_layout()
        io_rows = "\n".join(f"| input | `{s['name']}` | {s['dtype']} | {s['shape']} |" for s in ctx.inputs)
        io_rows += "\n" + "\n".join(f"| output | `{s['name']}` | {s['dtype']} | {s['shape']} |" for s in ctx.outputs)
        ranges = ", ".join(f"{k}={lo}..{hi}" for k, (lo, hi) in dims.ranges.items()) or "none given"
        case_rows = "\n".join(f"| {c['name']} | " + ", ".join(f"{k}{v}" for k, v in c["shapes"].items())
                              + f" | {'yes' if c['mask'] else 'no'} |" for c in cases_meta)
        atc_cmds = self.commands.get("atc_onnx", [])
        air_cmds = self.commands.get("atc_air", [])
        lite_cmd = self.commands.get("lite", [[]])[0]
        prof = (f"{len(self.profiles)} profiles over ({', '.join(dims.dynamic)}), from "
                f"{tuple(self.profiles[0])} to {tuple(self.profiles[-1])}" if self.profiles else "none (static shapes)")
        opset_rows = "\n".join(f"  | {label} | {lo}..{hi} |" for label, _, lo, hi in CANN_OPSETS)
        dev_prec = self.device_precision
        fp16_note = (f"The MindIR holds {', '.join(self.fp16_prims)}, which graphconv computes in fp16 on Ascend "
                     "(q/k/v cast around it); the compile measured that at fp16 tolerance, so device runs of the "
                     "MindIR (routes a, b and the AIR route) are compared with `--precision fp16`.\n"
                     if dev_prec != ctx.precision else "")
        warnings = "\n".join(f"- {x}" for x in ctx.warnings) or "- none"
        notes = "\n".join(f"- {n}" for n in self.profile_notes)
        tool_lines = "\n".join(f"- {k} {v}" for k, v in sorted(tools.items()))
        producer = (f"{mindir_info.get('producer_name') or '?'} {mindir_info.get('model_version') or '?'} (the file "
                    f"records ir_version {mindir_info.get('ir_version') or '?'}, mind_ir_version "
                    f"{mindir_info.get('mind_ir_version', '?')})") if mindir_info else f"MindSpore {ms_version}"
        return fill(
            template("README.md.tmpl"), NAME=name, GC_VERSION=__version__, TARGET=ctx.target, SOC=ctx.soc,
            CANN=ctx.cann or DEFAULT_CANN, CANN_ROW=a.cann_row, PRECISION=ctx.precision, IO_ROWS=io_rows,
            RANGES=ranges, PROFILES=prof,
            PROFILE_NOTES=notes + ("\n" if notes else ""), CASE_ROWS=case_rows,
            HOW_MINDIR=how["mindir"], HOW_SOURCE=how["source"], HOW_CKPT=how["checkpoint"],
            VARIABLES=(f"- `model/{Path(ctx.variables).name}/` — the MindIR's weights (over 1 GiB); keep it next to "
                       "the .mindir.\n") if ctx.variables else "",
            ATC_ONNX_FILE=a.path, OPSET=str(a.original_opset), ATC_OPSET=str(a.opset),
            ACCEPTED=f"{a.accepted[0]}..{a.accepted[1]}", OPSET_NOTE=a.note, OPSET_ROWS=opset_rows,
            ATC_PRECISION=self.atc_precision, LITE_PRECISION=self.lite_precision, DEVICE_PRECISION=dev_prec,
            FP16_NOTE=fp16_note, ATC_CMDS="\n".join(shell_line(c) for c in atc_cmds),
            AIR_CMDS="\n".join(shell_line(c) for c in air_cmds), LITE_CMD=shell_line(lite_cmd),
            LITE_HOW={"static": "the model has no dynamic dims: no profiles",
                      "ascend_context": "`[ascend_context]` `input_shape` + `dynamic_dims` "
                                        "(dynamic batch of 4-D inputs)",
                      "acl_build_options": "`[acl_build_options]` `input_shape` (-1 per dynamic dim) + "
                                           "`ge.dynamicDims` "
                                           "(ND profiles), because `[ascend_context]` `dynamic_dims` only covers "
                                           "4-D inputs with a dynamic batch or image size"}[lite_how],
            SOC_NOTE=self.soc_note, PRODUCER=producer, WARNINGS=warnings, TOOLS=tool_lines,
            JIT_CONFIG=repr(JIT_CONFIG), CANN_ACCEPTED=", ".join(MINDSPORE_CANN.get(ms_version, ())) or
            f"(not recorded for MindSpore {ms_version}: see its installation guide)",
            ATOL=f"{compare.default_tolerance(TOLERANCE_KEY[ctx.precision])[0]:g}",
            RTOL=f"{compare.default_tolerance(TOLERANCE_KEY[ctx.precision])[1]:g}",
            SOURCES="\n".join(f"- {k}: {v}" for k, v in DOC.items()),
        )

