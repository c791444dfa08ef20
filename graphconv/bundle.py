"""The Ascend deploy bundle (`graphconv compile --bundle DIR`): everything needed to take a compiled model to an
Ascend host, by three routes, and to check the device's numbers there.

    model/      the MindIR (and its `_variables/` folder), hard-linked when possible
    source/     the generated MindSpore network.py and network.ckpt
    onnx/       the simplified ONNX, and a copy at the opset the chosen CANN's ATC accepts when that differs
    reference/  reference inputs and outputs (.npz keyed by graph input / output name), cases.json
    compare_outputs.py    numpy-only comparison of a device run with the reference (graphconv's rule)
    mindspore/  route (a): mindspore.load + nn.GraphCell                       [Ascend host]
    lite/       route (b): converter_lite config and script, Lite inference    [Ascend host]
    atc/        route (c): ATC from the ONNX (--framework=5), and from AIR     [Ascend host]
    README.md, manifest.json

Every tool command written into the bundle is built by `command()` from the option tables below (one entry
per documented option, with its allowed values, constraints and the documentation it comes from) and is
checked again by `check_command()` after writing, so a misspelt or contradictory flag never reaches a user;
the converter_lite config file is checked the same way by `check_lite_config()`. Nothing in the bundle
imports graphconv.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
from pathlib import Path

import numpy as np
import onnx

from graphconv.verify import compare, reference
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


# ----------------------------------------------------------------------------------------------------------
# Documentation the tables rely on (cited per option below, and listed in the bundle README).

DOC = {
    "atc_flags": "https://gitcode.com/wys222111/ge/blob/develop/api/atc/atc_flags.cc",
    "atc_options": "https://www.hiascend.com/document/detail/en/canncommercial/800/devaids/atc/atctool_0040.html",
    "atc_input_shape": "https://www.hiascend.com/document/detail/en/canncommercial/800/devaids/atc/atlasatcparam_16_0016.html",
    "atc_dynamic_dims": "https://www.hiascend.com/document/detail/en/canncommercial/800/devaids/atc/atlasatcparam_16_0020.html",
    "atc_precision_mode": "https://www.hiascend.com/document/detail/zh/canncommercial/800/devaids/devtools/atc/atlasatcparam_16_0068.html",
    "lite_converter": "https://www.mindspore.cn/lite/cloud_docs/en/r2.10.0/mindir/converter_tool.html",
    "lite_ascend": "https://www.mindspore.cn/lite/docs/en/master/mindir/converter_tool_ascend.html",
    "lite_config_parser": "https://github.com/mindspore-ai/mindspore-lite/blob/master/mindspore-lite/tools/converter/config_parser/config_file_parser.cc",
    "lite_context": "https://www.mindspore.cn/lite/api/en/master/mindspore_lite/mindspore_lite.Context.html",
    "lite_model": "https://www.mindspore.cn/lite/api/en/r2.7.1/mindspore_lite/mindspore_lite.Model.html",
    "ms_export": "https://www.mindspore.cn/docs/zh-CN/master/api_python/mindspore/mindspore.export.html",
    "ms_precision_mode": "https://www.mindspore.cn/docs/zh-CN/master/api_python/device_context/mindspore.device_context.ascend.op_precision.precision_mode.html",
}

# ----------------------------------------------------------------------------------------------------------
# CANN version -> ONNX opsets its ATC accepts (the documented ranges quoted in the bundle issue; graphconv
# could not re-find one page stating them all, so the bundle README says where they come from).
# (label, predicate on (major, minor), lowest opset, highest opset), oldest first; the last row is the default.

CANN_OPSETS: list[tuple[str, object, int, int]] = [
    ("5.x-7.0", lambda mm: mm[0] in (5, 6) or mm == (7, 0), 11, 11),
    ("8.0.0", lambda mm: mm == (8, 0), 11, 15),
    ("9.0.0-beta1", lambda mm: mm == (9, 0), 11, 18),
]
DEFAULT_CANN = "9.0.0-beta1"


def check_options(inputs: list[dict], shape_ranges: dict, cann: str | None, precision: str = "fp32") -> None:
    """Raise InputError for bundle options that write_bundle would refuse (call it before a long compile)."""
    cann_opset_range(cann)
    collect_dims(inputs, [], shape_ranges)
    if precision not in PRECISIONS:
        raise InputError(f"bundle: unknown precision {precision!r} (choose from {', '.join(PRECISIONS)})")


def cann_opset_range(cann: str | None) -> tuple[str, int, int]:
    """(table row, lowest, highest) ONNX opset that `atc --framework=5` of this CANN version accepts."""
    version = cann or DEFAULT_CANN
    m = re.match(r"^(\d+)\.(\d+)", version.strip())
    if m:
        mm = (int(m.group(1)), int(m.group(2)))
        for label, matches, lo, hi in CANN_OPSETS:
            if matches(mm):
                return label, lo, hi
    known = ", ".join(label for label, *_ in CANN_OPSETS)
    raise InputError(f"--cann {version!r}: graphconv knows the ONNX opsets of CANN {known} only")


# ----------------------------------------------------------------------------------------------------------
# The option tables. Each tool: its required options and, per option, the allowed values (or a pattern) and
# the constraints the documentation states. `command()` builds argv from them and `check_command()` reads
# argv back against them; both refuse unknown, deprecated, duplicated, misvalued and contradictory flags.


@dataclasses.dataclass(frozen=True)
class Opt:
    values: tuple[str, ...] = ()  # the allowed values, exactly
    pattern: str = ""  # or: a regex the value must match in full
    requires: tuple[str, ...] = ()  # options that must be given with this one
    excludes: tuple[str, ...] = ()  # options that must not be given with this one
    only_when: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (option, values): valid only if it has one
    not_when: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (option, values): invalid if it has one
    deprecated: str = ""  # refused, with this advice
    source: str = ""  # DOC key
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str
    required: tuple[str, ...]
    options: dict[str, Opt]
    source: str


_SHAPE_ITEM = r"[^:;\s]+:(-?\d+|\d+~\d+)?(,(-?\d+|\d+~\d+))*"
_PATH = r"[^\s\"'$`\\]+"
ATC_PRECISION_MODES = ("force_fp32", "cube_fp16in_fp32out", "force_fp16", "allow_fp32_to_fp16",
                       "must_keep_origin_dtype", "allow_mix_precision", "allow_mix_precision_fp16",
                       "allow_mix_precision_bf16", "allow_fp32_to_bf16")

ATC = Tool("atc", ("model", "framework", "output", "soc_version"), {
    "model": Opt(pattern=_PATH, source="atc_options"),
    "weight": Opt(pattern=_PATH, only_when=(("framework", ("0",)),), source="atc_flags",
                  note="Caffe weights; required for --framework=0"),
    "framework": Opt(values=("0", "1", "3", "5"), source="atc_flags",
                     note="0 Caffe, 1 MindSpore (AIR), 3 TensorFlow, 5 ONNX; ATC does not read MindIR"),
    "output": Opt(pattern=_PATH, source="atc_options", note="without the .om suffix"),
    "soc_version": Opt(pattern=r"Ascend[0-9A-Za-z_]+", source="atc_options",
                       note="the exact name npu-smi info reports, prefixed with Ascend"),
    "input_shape": Opt(pattern=f"{_SHAPE_ITEM}(;{_SHAPE_ITEM})*", not_when=(("framework", ("1",)),),
                       source="atc_input_shape",
                       note="a dim may be a range a~b or -1 (shape range); -1 with --dynamic_* gives profiles; "
                            "not honoured for AIR (--framework=1)"),
    "input_format": Opt(values=("NCHW", "NHWC", "ND"), source="atc_dynamic_dims"),
    "dynamic_dims": Opt(pattern=r"\d+(,\d+)*(;\d+(,\d+)*)+", requires=("input_shape", "input_format"),
                        excludes=("dynamic_batch_size", "dynamic_image_size", "input_shape_range", "insert_op_conf"),
                        not_when=(("framework", ("1",)),), source="atc_dynamic_dims",
                        note="2..100 profiles, one value per -1 of --input_shape; the .air model does not "
                             "support dynamic shape profiles"),
    "dynamic_batch_size": Opt(pattern=r"\d+(,\d+)+", requires=("input_shape",),
                              excludes=("dynamic_image_size", "dynamic_dims", "input_shape_range"),
                              source="atc_flags"),
    "dynamic_image_size": Opt(pattern=r"\d+,\d+(;\d+,\d+)+", requires=("input_shape",),
                              excludes=("dynamic_batch_size", "dynamic_dims", "input_shape_range"),
                              source="atc_flags"),
    "input_shape_range": Opt(deprecated="deprecated in ATC; give ranges in --input_shape (a~b)", source="atc_flags"),
    "precision_mode": Opt(values=ATC_PRECISION_MODES, excludes=("precision_mode_v2",), source="atc_precision_mode",
                          note="default force_fp16; bf16 modes only on Atlas A2/A3"),
    "precision_mode_v2": Opt(values=("fp16", "origin", "cube_fp16in_fp32out", "mixed_float16", "mixed_bfloat16",
                                     "cube_hif8", "mixed_hif8"), excludes=("precision_mode",), source="atc_flags"),
    "op_select_implmode": Opt(values=("high_precision", "high_performance", "high_precision_for_all",
                                      "high_performance_for_all"), source="atc_flags"),
    "output_type": Opt(values=("FP32", "FP16", "INT8", "INT16", "UINT16", "UINT8", "INT32", "INT64", "UINT32",
                               "UINT64", "DOUBLE"), source="atc_flags"),
    "insert_op_conf": Opt(pattern=_PATH, source="atc_flags"),
    "out_nodes": Opt(pattern=r"[^\s;]+:\d+(;[^\s;]+:\d+)*", source="atc_flags"),
    "log": Opt(values=("debug", "info", "warning", "error", "null"), source="atc_flags"),
}, "atc_options")

CONVERTER_LITE = Tool("converter_lite", ("fmk", "modelFile", "outputFile"), {
    "fmk": Opt(values=("MINDIR", "CAFFE", "TFLITE", "TF", "ONNX"), source="lite_converter"),
    "modelFile": Opt(pattern=_PATH, source="lite_converter"),
    "outputFile": Opt(pattern=_PATH, source="lite_converter", note="without the suffix; .mindir is added"),
    "weightFile": Opt(pattern=_PATH, only_when=(("fmk", ("CAFFE",)),), source="lite_converter"),
    "configFile": Opt(pattern=_PATH, source="lite_converter"),
    "inputShape": Opt(pattern=f"{_SHAPE_ITEM}(;{_SHAPE_ITEM})*;?", source="lite_converter",
                      note="fixes the input shapes: the converted model probably loses its dynamic shapes"),
    "saveType": Opt(values=("MINDIR", "MINDIR_LITE"), source="lite_converter",
                    note="cloud-side inference only runs models converted with MINDIR"),
    "optimize": Opt(values=("none", "general", "ascend_oriented"), source="lite_converter"),
    "decryptKey": Opt(pattern=r"[0-9a-fA-F]+", only_when=(("fmk", ("MINDIR",)),), source="lite_converter"),
    "decryptMode": Opt(values=("AES-GCM", "AES-CBC"), requires=("decryptKey",), source="lite_converter"),
    "encryptKey": Opt(pattern=r"[0-9a-fA-F]+", source="lite_converter"),
    "encryption": Opt(values=("true", "false"), source="lite_converter"),
    "infer": Opt(values=("true", "false"), source="lite_converter"),
    "inputDataFormat": Opt(values=("NHWC", "NCHW"), source="lite_converter"),
    "fp16": Opt(values=("on", "off"), source="lite_converter", note="not supported at the moment"),
    "device": Opt(deprecated="to be deprecated; use --optimize=ascend_oriented", source="lite_converter"),
}, "lite_converter")

TOOLS = {t.name: t for t in (ATC, CONVERTER_LITE)}

# converter_lite --configFile sections and keys graphconv writes (the file format: "[section]" lines,
# key=value, '#' comments in column 0, blanks and quotes removed -- lite_config_parser).
LITE_PRECISION_MODES = ("enforce_fp32", "preferred_fp32", "enforce_fp16", "enforce_origin", "preferred_optimal")
LITE_CONFIG: dict[str, dict[str, Opt]] = {
    "ascend_context": {
        "input_format": Opt(values=("NCHW", "NHWC", "ND"), source="lite_ascend"),
        "input_shape": Opt(pattern=r"[^:;\s]+:\[-?\d+(,-?\d+)*\](;[^:;\s]+:\[-?\d+(,-?\d+)*\])*", source="lite_ascend",
                           note="only works for dynamic batch; static shapes go to --inputShape"),
        "dynamic_dims": Opt(pattern=r"\[\d+(,\d+)*\](,\[\d+(,\d+)*\])*(;\[\d+(,\d+)*\](,\[\d+(,\d+)*\])*)*",
                            requires=("input_shape",), source="lite_ascend",
                            note="dynamic batch or dynamic image size of 4-D inputs only (lite_config_parser)"),
        "precision_mode": Opt(values=LITE_PRECISION_MODES, source="lite_ascend",
                              note="enforce_fp32=force_fp32, preferred_fp32=allow_fp32_to_fp16, enforce_fp16="
                                   "force_fp16, enforce_origin=must_keep_origin_dtype, preferred_optimal="
                                   "allow_mix_precision (lite_context)"),
        "op_select_impl_mode": Opt(values=("high_performance", "high_precision"), source="lite_ascend"),
        "output_type": Opt(values=("FP16", "FP32", "UINT8"), source="lite_ascend"),
    },
    "acl_build_options": {
        "input_format": Opt(values=("NCHW", "NHWC", "ND"), source="lite_ascend"),
        "input_shape": Opt(pattern=f"{_SHAPE_ITEM}(;{_SHAPE_ITEM})*", source="lite_ascend"),
        "ge.dynamicDims": Opt(pattern=r"\d+(,\d+)*(;\d+(,\d+)*)+", requires=("input_shape", "input_format"),
                              excludes=("ge.dynamicBatchSize", "ge.dynamicImageSize"), source="lite_ascend",
                              note="ND dynamic dimension profiles; input_format must be ND"),
        "ge.dynamicBatchSize": Opt(pattern=r"\d+(,\d+)+", requires=("input_shape",), source="lite_ascend"),
        "ge.exec.precision_mode": Opt(values=("force_fp32", "force_fp16", "allow_fp32_to_fp16",
                                              "must_keep_origin_dtype", "allow_mix_precision"), source="lite_ascend"),
        "log": Opt(values=("debug", "info", "warning", "error"), source="lite_ascend"),
    },
}

MAX_PROFILES = 100  # ATC --dynamic_dims: (1, 100]; Lite dynamic_dims: up to 100

# precision -> (ATC --precision_mode, Lite [ascend_context] precision_mode). The bundle never lowers the
# model's own dtypes: fp32/bf16 keep them (must_keep_origin_dtype, so the fp32/bf16 tolerance applies);
# fp16 lets ATC pick fp16 where an op has both.
PRECISIONS = {
    "fp32": ("must_keep_origin_dtype", "enforce_origin"),
    "fp16": ("force_fp16", "enforce_fp16"),
    "bf16": ("must_keep_origin_dtype", "enforce_origin"),
}
_TOLERANCE_KEY = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


class CommandError(InputError):
    """A tool command or config that contradicts the documented options."""


def _opt_name(token: str) -> tuple[str, str | None]:
    body = token[2:] if token.startswith("--") else token[1:]
    name, eq, value = body.partition("=")
    return name, (value if eq else None)


def check_command(argv: list[str]) -> list[str]:
    """Problems of one tool command (argv as a shell would pass it); [] when it agrees with the tables."""
    if not argv:
        return ["empty command"]
    tool = TOOLS.get(Path(argv[0]).name)
    if tool is None:
        return [f"unknown tool {argv[0]!r} (known: {', '.join(TOOLS)})"]
    problems: list[str] = []
    given: dict[str, str] = {}
    for token in argv[1:]:
        if not token.startswith("-"):
            problems.append(f"{tool.name}: stray argument {token!r} (options are --name=value)")
            continue
        name, value = _opt_name(token)
        if tool is ATC:
            name = name.replace("-", "_")  # ATC accepts soc-version for soc_version
        opt = tool.options.get(name)
        if opt is None:
            close = [k for k in tool.options if _similar(k, name)]
            hint = f" (did you mean --{close[0]}?)" if close else ""
            problems.append(f"{tool.name}: unknown option --{name}{hint}")
            continue
        if opt.deprecated:
            problems.append(f"{tool.name}: --{name} is deprecated: {opt.deprecated}")
            continue
        if name in given:
            problems.append(f"{tool.name}: --{name} given twice")
            continue
        if value is None or value == "":
            problems.append(f"{tool.name}: --{name} needs a value (--{name}=VALUE)")
            continue
        if opt.values and value not in opt.values:
            problems.append(f"{tool.name}: --{name}={value} is not one of {', '.join(opt.values)}")
        elif opt.pattern and not re.fullmatch(opt.pattern, value):
            problems.append(f"{tool.name}: --{name}={value!r} is malformed")
        given[name] = value
    problems += _check_relations(tool.name, tool.options, given, "--")
    for req in tool.required:
        if req not in given:
            problems.append(f"{tool.name}: --{req} is required")
    if tool is ATC:
        problems += _check_atc(given)
    else:
        problems += _check_converter(given)
    return problems


def _similar(a: str, b: str) -> bool:
    a, b = a.lower(), b.lower()
    return a != b and (sorted(a) == sorted(b) or (len(a) == len(b) and sum(x != y for x, y in zip(a, b)) <= 2))


def _check_relations(tool: str, options: dict[str, Opt], given: dict[str, str], prefix: str) -> list[str]:
    problems, pairs = [], set()
    for name in given:
        opt = options[name]
        for req in opt.requires:
            if req not in given:
                problems.append(f"{tool}: {prefix}{name} needs {prefix}{req}")
        for ex in opt.excludes:
            if ex in given and frozenset((name, ex)) not in pairs:  # report each pair once
                pairs.add(frozenset((name, ex)))
                problems.append(f"{tool}: {prefix}{name} and {prefix}{ex} contradict each other")
        for other, values in opt.only_when:
            if given.get(other) not in values:
                problems.append(f"{tool}: {prefix}{name} only applies with {prefix}{other}={'|'.join(values)}")
        for other, values in opt.not_when:
            if given.get(other) in values:
                problems.append(f"{tool}: {prefix}{name} is not honoured with {prefix}{other}={given[other]}")
    return problems


def _parse_shapes(text: str) -> list[tuple[str, list[str]]]:
    out = []
    for item in text.split(";"):
        name, _, dims = item.rpartition(":")
        out.append((name, [d for d in dims.split(",") if d != ""]))
    return out


def _check_atc(given: dict[str, str]) -> list[str]:
    problems = []
    fw, model = given.get("framework"), given.get("model", "")
    suffix = {"0": ".prototxt", "1": ".air", "3": ".pb", "5": ".onnx"}.get(fw or "")
    if suffix and not model.endswith(suffix):
        problems.append(f"atc: --framework={fw} reads {suffix} files, not {model!r}")
    if model.endswith(".mindir"):
        problems.append("atc: ATC does not read MindIR (use converter_lite, or export AIR for --framework=1)")
    if fw == "0" and "weight" not in given:
        problems.append("atc: --framework=0 needs --weight")
    if given.get("output", "").endswith(".om"):
        problems.append("atc: --output is given without the .om suffix")
    shape_ok = re.fullmatch(ATC.options["input_shape"].pattern, given.get("input_shape", "")) is not None
    shapes = _parse_shapes(given["input_shape"]) if shape_ok else []
    for _, dims in shapes:
        for d in dims:
            if "~" in d:
                lo, hi = (int(x) for x in d.split("~"))
                if not 0 < lo <= hi:
                    problems.append(f"atc: --input_shape range {d} is empty or not positive")
    minus_ones = sum(d == "-1" for _, dims in shapes for d in dims)
    dyn = [k for k in ("dynamic_dims", "dynamic_batch_size", "dynamic_image_size") if k in given]
    if dyn and any("~" in d for _, dims in shapes for d in dims):
        problems.append(f"atc: --{dyn[0]} profiles and --input_shape ranges (a~b) contradict each other")
    if "dynamic_dims" in given:
        profiles = [p.split(",") for p in given["dynamic_dims"].split(";")]
        if not 1 < len(profiles) <= MAX_PROFILES:
            problems.append(f"atc: --dynamic_dims has {len(profiles)} profiles (2..{MAX_PROFILES} allowed)")
        for p in profiles:
            if len(p) != minus_ones:
                problems.append(f"atc: --dynamic_dims profile {','.join(p)} has {len(p)} values for "
                                f"{minus_ones} -1 dims of --input_shape")
                break
        if given.get("input_format") != "ND":
            problems.append("atc: --dynamic_dims sets ND profiles: --input_format=ND")
    soc = given.get("soc_version", "")
    if re.fullmatch(r"Ascend310(B\d*)?", soc):  # Atlas 200/300/500 and 200I/500 A2: no shape ranges
        if any("~" in d for _, dims in shapes for d in dims) or (minus_ones and not dyn):
            problems.append(f"atc: {soc} does not support shape ranges; use -1 with --dynamic_dims profiles")
    return problems


def _check_converter(given: dict[str, str]) -> list[str]:
    problems = []
    fmk, model = given.get("fmk"), given.get("modelFile", "")
    suffixes = {"MINDIR": ".mindir", "ONNX": ".onnx", "TFLITE": ".tflite", "TF": ".pb", "CAFFE": ".prototxt"}
    suffix = suffixes.get(fmk or "")
    if suffix and not model.endswith(suffix):
        problems.append(f"converter_lite: --fmk={fmk} reads {suffix} files, not {model!r}")
    if given.get("outputFile", "").endswith(".mindir"):
        problems.append("converter_lite: --outputFile is given without the suffix (.mindir is added)")
    if fmk == "CAFFE" and "weightFile" not in given:
        problems.append("converter_lite: --fmk=CAFFE needs --weightFile")
    return problems


def parse_lite_config(text: str) -> dict[str, dict[str, str]]:
    """The converter_lite config as converter_lite reads it: '#' in column 0 starts a comment, blanks and
    quotes are removed, "[section]" opens a section, every other line is exactly one key=value."""
    sections: dict[str, dict[str, str]] = {}
    section = "DEFAULT"
    for n, raw in enumerate(text.splitlines(), 1):
        if not raw or raw[0] == "#":
            continue
        line = "".join(ch for ch in raw if not ch.isspace() and ch not in "\"'")
        if not line:
            continue
        if line[0] == "[":
            section = line[1:-1]
            sections.setdefault(section, {})
            continue
        parts = line.split("=")
        if len(parts) != 2:
            raise CommandError(f"converter_lite config line {n}: expected one key=value, got {raw!r}")
        sections.setdefault(section, {})[parts[0]] = parts[1]
    return sections


def check_lite_config(text: str) -> list[str]:
    """Problems of a converter_lite --configFile written by graphconv; [] when it agrees with the tables."""
    try:
        sections = parse_lite_config(text)
    except CommandError as e:
        return [str(e)]
    problems = []
    for section, items in sections.items():
        table = LITE_CONFIG.get(section)
        if table is None:
            problems.append(f"converter_lite config: unknown section [{section}]")
            continue
        for key, value in items.items():
            opt = table.get(key)
            if opt is None:
                close = [k for k in table if _similar(k, key)]
                problems.append(f"converter_lite config: unknown key {key} in [{section}]"
                                + (f" (did you mean {close[0]}?)" if close else ""))
                continue
            if opt.values and value not in opt.values:
                problems.append(f"converter_lite config: [{section}] {key}={value} is not one of "
                                f"{', '.join(opt.values)}")
            elif opt.pattern and not re.fullmatch(opt.pattern, value):
                problems.append(f"converter_lite config: [{section}] {key}={value!r} is malformed")
        known = {k: v for k, v in items.items() if k in table}
        problems += _check_relations(f"converter_lite config [{section}]", table, known, "")
    ctx_ = sections.get("ascend_context", {})
    acl = sections.get("acl_build_options", {})
    if "input_shape" in ctx_ and "input_shape" in acl:
        problems.append("converter_lite config: input_shape in both [ascend_context] and [acl_build_options]")
    if "dynamic_dims" in ctx_ and "ge.dynamicDims" in acl:
        problems.append("converter_lite config: [ascend_context] dynamic_dims and [acl_build_options] "
                        "ge.dynamicDims contradict each other")
    table = LITE_CONFIG["ascend_context"]
    if "dynamic_dims" in ctx_ and re.fullmatch(table["input_shape"].pattern, ctx_.get("input_shape", "")):
        problems += _check_ascend_context_dims(ctx_["input_shape"], ctx_["dynamic_dims"])
    if "ge.dynamicDims" in acl and re.fullmatch(LITE_CONFIG["acl_build_options"]["input_shape"].pattern,
                                                 acl.get("input_shape", "")):
        if acl.get("input_format") != "ND":
            problems.append("converter_lite config: ge.dynamicDims needs input_format=ND in [acl_build_options]")
        minus_ones = sum(d == "-1" for _, dims in _parse_shapes(acl["input_shape"]) for d in dims)
        profiles = [p.split(",") for p in acl["ge.dynamicDims"].split(";")]
        if not 1 < len(profiles) <= MAX_PROFILES:
            problems.append(f"converter_lite config: ge.dynamicDims has {len(profiles)} profiles (2..{MAX_PROFILES})")
        if any(len(p) != minus_ones for p in profiles):
            problems.append(f"converter_lite config: every ge.dynamicDims profile needs {minus_ones} values "
                            "(one per -1 of input_shape)")
    return problems


def _check_ascend_context_dims(input_shape: str, dynamic_dims: str) -> list[str]:
    """[ascend_context] dynamic_dims: per input (';'), profiles '[..],[..]' that must be the same for every
    dynamic input; only 4-D inputs with a dynamic batch (dim 0 alone) or a dynamic image size (two of dims
    1-3) are supported (lite_config_parser: DynBatchOrDynImage)."""
    problems = []
    shapes = [(n, [int(x) for x in d.strip("[]").split(",")]) for n, d in
              (item.rpartition(":")[::2] for item in input_shape.split(";"))]
    per_input = dynamic_dims.split(";")
    if len(per_input) != len(shapes):
        problems.append(f"converter_lite config: dynamic_dims has {len(per_input)} entries for {len(shapes)} inputs")
    dynamic = [(n, s) for n, s in shapes if -1 in s]
    if len({per_input[i] for i, (n, s) in enumerate(shapes) if -1 in s and i < len(per_input)}) > 1:
        problems.append("converter_lite config: dynamic_dims must be the same for every dynamic input")
    for name, shape in dynamic:
        batch = len(shape) == 4 and shape[0] == -1 and shape.count(-1) == 1
        image = len(shape) == 4 and shape[0] != -1 and shape.count(-1) == 2
        if not (batch or image):
            problems.append(f"converter_lite config: [ascend_context] dynamic_dims supports 4-D inputs with a "
                            f"dynamic batch or image size only; {name} is {shape}")
    if per_input:
        profiles = re.findall(r"\[([^\]]*)\]", per_input[0])
        if len(profiles) > MAX_PROFILES:
            problems.append(f"converter_lite config: dynamic_dims has {len(profiles)} profiles "
                            f"(at most {MAX_PROFILES})")
    return problems


def command(tool: str, options: dict[str, object]) -> list[str]:
    """argv for `tool` with --name=value per option, refused (CommandError) unless it passes check_command."""
    argv = [tool] + [f"--{k}={v}" for k, v in options.items()]
    problems = check_command(argv)
    if problems:
        raise CommandError("; ".join(problems))
    return argv


def shell_line(argv: list[str]) -> str:
    """One shell command line; values with shell-special characters are double-quoted like the docs do."""
    out = []
    for token in argv:
        name, eq, value = token.partition("=")
        if eq and re.search(r"[;~\s*?|&<>()]", value):
            if re.search(r"[\"$`\\]", value):
                raise CommandError(f"cannot quote {token!r} safely")
            token = f'{name}="{value}"'
        elif not eq and token != shlex.quote(token):
            raise CommandError(f"cannot write {token!r} as a plain shell word")
        out.append(token)
    return " ".join(out)


def extract_commands(text: str) -> list[list[str]]:
    """Every tool command in a shell script or a README (a line, after continuations are joined, whose first
    word is a tool in TOOLS), split as the shell splits it."""
    found = []
    joined = re.sub(r"\\\n", " ", text)
    for line in joined.splitlines():
        line = line.strip()
        if line.startswith("$ "):
            line = line[2:]
        first = line.split(" ", 1)[0] if line else ""
        if Path(first).name in TOOLS:
            found.append(shlex.split(line, comments=True))
    return found


# ----------------------------------------------------------------------------------------------------------
# Shapes and dynamic profiles.


@dataclasses.dataclass
class Dims:
    """The model's symbolic dims in order of first appearance, their user ranges and reference sizes."""

    names: list[str]
    ranges: dict[str, tuple[int, int]]
    ref_sizes: dict[str, list[int]]  # sizes the reference cases use, in case order
    ref_tuples: list[tuple[int, ...]]  # one per case, a size per name

    def fixed(self, name: str) -> int | None:
        r = self.ranges.get(name)
        return r[0] if r and r[0] == r[1] else None

    @property
    def dynamic(self) -> list[str]:
        return [n for n in self.names if self.fixed(n) is None]


def _dim_key(input_name: str, axis: int, d) -> str | None:
    if isinstance(d, int):
        return None
    return d if d else f"{input_name}:{axis}"  # unnamed dynamic dims: the name graphconv.verify.reference uses


def collect_dims(inputs: list[dict], cases: list, ranges: dict) -> Dims:
    names: list[str] = []
    for spec in inputs:
        for axis, d in enumerate(spec["shape"]):
            key = _dim_key(spec["name"], axis, d)
            if key is not None and key not in names:
                names.append(key)
    unknown = sorted(set(ranges) - set(names))
    if unknown:
        raise InputError(f"--shape-range names {unknown} are not symbolic dims of the model "
                         f"(it has {names or 'none'})")
    for name, (lo, hi) in ranges.items():
        if not 1 <= lo <= hi:
            raise InputError(f"--shape-range {name}={lo}..{hi}: expected 1 <= MIN <= MAX")
    ref_sizes: dict[str, list[int]] = {n: [] for n in names}
    ref_tuples = []
    for case in cases:
        sizes: dict[str, int] = {}
        for spec in inputs:
            arr = case.inputs.get(spec["name"])
            if arr is None:
                continue
            for axis, d in enumerate(spec["shape"]):
                key = _dim_key(spec["name"], axis, d)
                if key is not None and axis < arr.ndim:
                    sizes.setdefault(key, int(arr.shape[axis]))
        for n in names:
            if n in sizes:
                ref_sizes[n].append(sizes[n])
        if all(n in sizes for n in names):
            ref_tuples.append(tuple(sizes[n] for n in names))
    return Dims(names, {k: (int(v[0]), int(v[1])) for k, v in ranges.items()}, ref_sizes, ref_tuples)


def _candidates(lo: int, hi: int) -> list[int]:
    vals = {lo, hi}
    p = 1
    while p <= hi:
        if p >= lo:
            vals.add(p)
        p *= 2
    return sorted(vals)


def profiles(dims: Dims, limit: int = MAX_PROFILES) -> tuple[list[tuple[int, ...]], list[str]]:
    """Dynamic-dimension profiles over dims.dynamic: a grid of powers of two inside each user range (ends
    included), thinned until it fits `limit`, plus the reference case sizes (so the bundle's reference inputs
    run on a profile-based model). Dims without a range contribute their reference sizes only. Returns the
    sorted profiles and notes for the README."""
    notes = []
    dyn = dims.dynamic
    if not dyn:
        return [], notes
    index = {n: i for i, n in enumerate(dims.names)}
    refs = []
    for t in dims.ref_tuples:
        sub = tuple(t[index[n]] for n in dyn)
        outside = [n for n, v in zip(dyn, sub) if n in dims.ranges and not dims.ranges[n][0] <= v <= dims.ranges[n][1]]
        if outside:
            notes.append(f"reference sizes {dict(zip(dyn, sub))} lie outside --shape-range for {', '.join(outside)}; "
                         "that case cannot run on the profile-based models")
        elif sub not in refs:
            refs.append(sub)
    axes = []
    for n in dyn:
        if n in dims.ranges:
            axes.append(_candidates(*dims.ranges[n]))
        else:
            axes.append(sorted(set(dims.ref_sizes.get(n, []))) or [1])
            notes.append(f"dim {n!r} has no --shape-range: its profiles use the reference sizes "
                         f"{axes[-1]} only")
    budget = max(limit - len(refs), 1)

    def size(ax):
        total = 1
        for a in ax:
            total *= len(a)
        return total

    while size(axes) > budget:
        k = max(range(len(axes)), key=lambda i: len(axes[i]))
        if len(axes[k]) <= 2:
            break
        axes[k] = axes[k][:1] + axes[k][1:-1][1::2] + axes[k][-1:]
    grid = [()]
    for a in axes:
        grid = [g + (v,) for g in grid for v in a]
    out = sorted(set(grid) | set(refs))
    if len(out) > limit:  # only when the reference tuples alone exceed it
        out = sorted(set(refs))[:limit]
    return out, notes


def atc_input_shape(inputs: list[dict], dims: Dims, mode: str) -> str:
    """--input_shape: mode "range" gives a~b for ranged dims and -1 for unranged ones; mode "profile" gives
    -1 for every dynamic dim (values come from --dynamic_dims)."""
    items = []
    for spec in inputs:
        out = []
        for axis, d in enumerate(spec["shape"]):
            key = _dim_key(spec["name"], axis, d)
            if key is None:
                out.append(str(d))
            elif dims.fixed(key) is not None:
                out.append(str(dims.fixed(key)))
            elif mode == "range" and key in dims.ranges:
                lo, hi = dims.ranges[key]
                out.append(f"{lo}~{hi}")
            else:
                out.append("-1")
        items.append(f"{spec['name']}:{','.join(out)}")
    return ";".join(items)


def profile_values(inputs: list[dict], dims: Dims, profile: tuple[int, ...]) -> list[int]:
    """The values of one profile in the order of the -1 dims of the profile-mode --input_shape."""
    value = dict(zip(dims.dynamic, profile))
    out = []
    for spec in inputs:
        for axis, d in enumerate(spec["shape"]):
            key = _dim_key(spec["name"], axis, d)
            if key is not None and dims.fixed(key) is None:
                out.append(value[key])
    return out


# ----------------------------------------------------------------------------------------------------------
# The ONNX at the opset ATC accepts.


@dataclasses.dataclass
class AtcOnnx:
    path: str  # relative to the bundle
    opset: int
    original_opset: int
    cann_row: str
    accepted: tuple[int, int]
    converted: bool = False
    note: str = ""  # what happened, for the README


def _default_opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def _repair_reduce_attrs(model: onnx.ModelProto, target: int) -> None:
    """onnx.version_converter leaves `noop_with_empty_axes` (new in opset 18) on Reduce* nodes it moves
    below 18; with its default value 0 the attribute means nothing, so drop it there."""
    if target >= 18:
        return
    for node in model.graph.node:
        if node.op_type.startswith("Reduce"):
            for a in list(node.attribute):
                if a.name == "noop_with_empty_axes" and a.i == 0:
                    node.attribute.remove(a)


def clamp_opset(model: onnx.ModelProto, cann: str | None, cases: list, precision: str = "fp32"
                ) -> tuple[onnx.ModelProto | None, AtcOnnx, list[str]]:
    """The model at an opset the CANN version's ATC accepts: unchanged when it already is; otherwise
    onnx.version_converter to the highest accepted opset, checked with onnx.checker and against the
    original with onnxruntime on the reference inputs. Returns (converted model or None, facts, warnings)."""
    row, lo, hi = cann_opset_range(cann)
    opset = _default_opset(model)
    facts = AtcOnnx("", opset, opset, row, (lo, hi))
    if lo <= opset <= hi:
        facts.note = f"opset {opset} is within {lo}..{hi}: ATC reads the simplified ONNX as it is"
        return None, facts, []
    if opset < lo:
        msg = (f"the model's opset {opset} is below {lo}, the lowest CANN {row} accepts; "
               "onnx.version_converter is not used to raise opsets here")
        facts.note = msg
        return None, facts, [msg]
    target = hi
    try:
        from onnx import version_converter

        converted = version_converter.convert_version(model, target)
        _repair_reduce_attrs(converted, target)
        onnx.checker.check_model(converted, full_check=True)
        _compare_with_ort(model, converted, cases, precision)
    except Exception as e:  # noqa: BLE001 - any failure keeps the original opset, with a warning
        reason = str(e).strip().splitlines()[0][:240] if str(e).strip() else type(e).__name__
        msg = (f"the model needs ONNX opset {opset} but CANN {row} ATC accepts {lo}..{hi}; converting to opset "
               f"{target} failed ({type(e).__name__}: {reason}); the ONNX route keeps opset {opset} and may be "
               "refused by ATC")
        facts.note = msg
        return None, facts, [msg]
    facts.opset, facts.converted = target, True
    facts.note = (f"converted from opset {opset} to {target} with onnx.version_converter; onnx.checker passed "
                  f"and onnxruntime gives the same outputs as opset {opset} on the reference inputs")
    return converted, facts, []


def _compare_with_ort(original: onnx.ModelProto, converted: onnx.ModelProto, cases: list, precision: str) -> None:
    import onnxruntime as ort

    if not cases:
        raise InternalError("no reference inputs to compare the converted model on")
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    runs = []
    for m in (original, converted):
        sess = ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        names = [o.name for o in sess.get_outputs()]
        runs.append([dict(zip(names, sess.run(names, c.inputs))) for c in cases])
    atol, rtol = compare.default_tolerance(_TOLERANCE_KEY.get(precision, "float32"))
    for case, ref, got in zip(cases, *runs):
        for name, r in ref.items():
            c = compare.compare(got[name], r, atol, rtol, case.valid_positions(r))
            if not c.ok:
                raise InternalError(f"output {name!r} at {case.shape_text()} changed: {c.reason}")


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
    cases_meta = []
    for k, case in enumerate(ctx.cases):
        entry = {"name": case.name, "inputs": f"reference/{case.name}.inputs.npz", "shapes": {}, "stored": {}}
        arrays = {}
        for spec in ctx.inputs:
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
    atol, rtol = compare.default_tolerance(_TOLERANCE_KEY[ctx.precision])
    w.text("reference/cases.json", json.dumps({
        "precision": ctx.precision, "atol": atol, "rtol": rtol,
        "rule": "|actual - reference| <= atol + rtol * |reference|, elementwise; integers and bools exactly; "
                "inf/NaN must match in kind; positions where the mask row is 0 are skipped",
        "inputs": ctx.inputs, "outputs": ctx.outputs, "cases": cases_meta}, indent=2) + "\n")

    # scripts and configs
    w.text("compare_outputs.py", COMPARE_SCRIPT, executable=True)
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


def _fill(template: str, **values: str) -> str:
    for k, v in values.items():
        template = template.replace(f"@@{k}@@", v)
    leftover = re.findall(r"@@\w+@@", template)
    if leftover:
        raise InternalError(f"bundle template placeholders left: {leftover}")
    return template


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
        return _fill(MINDSPORE_SCRIPT, NAME=self.name, INPUTS=repr(self.ctx.inputs),
                     OUTPUTS=repr([o["name"] for o in self.ctx.outputs]), PRECISION_MODE=self.atc_precision,
                     DEVICE_PRECISION=self.device_precision)

    # --- route (b)
    def _lite_layout(self) -> tuple[str, dict[str, dict[str, str]], dict[str, str]]:
        """(how, config sections, extra converter options)."""
        inputs, dims = self.ctx.inputs, self.dims
        sections: dict[str, dict[str, str]] = {"ascend_context": {}, "acl_build_options": {}}
        extra: dict[str, str] = {}
        dynamic_inputs = [s for s in inputs if any(_dim_key(s["name"], a, d) in dims.dynamic
                                                    for a, d in enumerate(s["shape"]))]
        static_shape = atc_input_shape(inputs, dims, "profile") if not dims.dynamic else ""
        if not dims.dynamic:
            sections["ascend_context"]["input_format"] = "ND"
            if dims.names:  # symbolic dims pinned by --shape-range MIN==MAX
                extra["inputShape"] = static_shape
            how = "static"
        elif all(len(s["shape"]) == 4 and [(_dim_key(s["name"], a, d) in dims.dynamic) for a, d in
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
                      f"# Profiles over ({', '.join(self.dims.dynamic)}): {len(self.profiles)}; the model runs only at these shapes."]
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
        return _fill(LITE_SHELL, NAME=self.name, COMMAND=shell_line(self.lite_command()))

    def lite_script(self) -> str:
        return _fill(LITE_SCRIPT, NAME=self.name, INPUTS=repr(self.ctx.inputs), OUTPUTS=repr(
            [o["name"] for o in self.ctx.outputs]), DEVICE_PRECISION=self.device_precision)

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
        return _fill(ATC_ONNX_SHELL, NAME=self.name, DEFAULT=default, MODES="|".join(cmds),
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
        return _fill(ATC_AIR_SHELL, NAME=self.name,
                     COMMANDS="\n".join(shell_line(c) for c in self.air_commands()))

    def air_script(self) -> str:
        return _fill(AIR_SCRIPT, NAME=self.name, INPUTS=repr(self.ctx.inputs),
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
        return _fill(
            README, NAME=name, GC_VERSION=__version__, TARGET=ctx.target, SOC=ctx.soc, CANN=ctx.cann or DEFAULT_CANN,
            CANN_ROW=a.cann_row, PRECISION=ctx.precision, IO_ROWS=io_rows, RANGES=ranges, PROFILES=prof,
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
                      "ascend_context": "`[ascend_context]` `input_shape` + `dynamic_dims` (dynamic batch of 4-D inputs)",
                      "acl_build_options": "`[acl_build_options]` `input_shape` (-1 per dynamic dim) + `ge.dynamicDims` "
                                           "(ND profiles), because `[ascend_context]` `dynamic_dims` only covers "
                                           "4-D inputs with a dynamic batch or image size"}[lite_how],
            SOC_NOTE=self.soc_note, PRODUCER=producer, WARNINGS=warnings, TOOLS=tool_lines,
            ATOL=f"{compare.default_tolerance(_TOLERANCE_KEY[ctx.precision])[0]:g}",
            RTOL=f"{compare.default_tolerance(_TOLERANCE_KEY[ctx.precision])[1]:g}",
            SOURCES="\n".join(f"- {k}: {v}" for k, v in DOC.items()),
        )


# ----------------------------------------------------------------------------------------------------------
# Templates. Placeholders are @@NAME@@; everything else is literal.

COMPARE_SCRIPT = r'''#!/usr/bin/env python3
"""Compare a device run with this bundle's reference outputs. Runs anywhere: needs numpy only.

    python compare_outputs.py RUN_DIR                 # RUN_DIR/<case>.npz for every case in reference/cases.json
    python compare_outputs.py RUN.npz --case case0    # one case
    options: --precision fp32|fp16|bf16 (tolerance; default: the bundle's), --atol X --rtol X, --json

A run file is an .npz keyed by output name (what mindspore/infer_mindspore.py and lite/infer_lite.py write).
The rule is graphconv's: elementwise |actual - reference| <= atol + rtol * |reference|; integers and bools
must match exactly; inf/NaN must match in kind; positions whose attention-mask entry is 0 (the left-padded
row of the reference inputs) are skipped. Exit code 0 when every output of every case passes, 1 when one
fails, 2 when files are missing or unreadable.
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
TOLERANCE = {"fp32": (1e-4, 1e-4), "fp16": (1e-2, 1e-2), "bf16": (3e-2, 3e-2)}
SUSPICIOUS_FACTOR = 100.0


def _cosine(a, b):
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if na == 0.0 and nb == 0.0:
        return 1.0
    if na == 0.0 or nb == 0.0:
        return 0.0
    return float(np.dot(a, b) / (na * nb))


def compare(actual, expected, atol=1e-4, rtol=1e-4, valid=None):
    """The comparison of one output; a dict with ok, suspicious, max_abs, mean_abs, cosine, compared, reason."""
    actual = np.asarray(actual)
    expected = np.asarray(expected)

    def result(ok, suspicious, mx, mean, cos, n, reason=""):
        return {"ok": ok, "suspicious": suspicious, "max_abs": mx, "mean_abs": mean, "cosine": cos,
                "compared": n, "reason": reason}

    if actual.shape != expected.shape:
        return result(False, False, float("inf"), float("inf"), 0.0, 0,
                      f"shape {list(actual.shape)} != reference {list(expected.shape)}")
    if valid is not None:
        keep = np.broadcast_to(valid.reshape(valid.shape + (1,) * (expected.ndim - valid.ndim)), expected.shape)
        actual, expected = actual[keep], expected[keep]
    actual, expected = actual.ravel(), expected.ravel()
    n = int(expected.size)
    if expected.dtype.kind in "biuU" or actual.dtype.kind in "biuU":
        equal = actual == expected
        diff = np.abs(actual.astype(np.float64) - expected.astype(np.float64)) if n else np.zeros(0)
        ok = bool(np.all(equal))
        return result(ok, False, float(diff.max()) if n else 0.0, float(diff.mean()) if n else 0.0,
                      _cosine(actual.astype(np.float64), expected.astype(np.float64)), n,
                      "" if ok else f"{int((~equal).sum())} of {n} elements differ (exact match required)")
    a = actual.astype(np.float64)
    b = expected.astype(np.float64)
    kind_ok = (np.isnan(a) == np.isnan(b)) & (np.isposinf(a) == np.isposinf(b)) & (np.isneginf(a) == np.isneginf(b))
    both = np.isfinite(b) & np.isfinite(a)
    diff = np.abs(a[both] - b[both])
    bound = atol + rtol * np.abs(b[both])
    mx = float(diff.max()) if diff.size else 0.0
    mean = float(diff.mean()) if diff.size else 0.0
    cos = _cosine(np.where(both, a, 0.0), np.where(both, b, 0.0))
    bad_kind = int((~kind_ok).sum())
    if bad_kind:
        return result(False, False, mx, mean, cos, n, f"{bad_kind} of {n} elements differ in inf/NaN kind from the reference")
    within = diff <= bound
    if bool(np.all(within)):
        return result(True, False, mx, mean, cos, n)
    return result(False, bool(np.all(diff <= SUSPICIOUS_FACTOR * bound)), mx, mean, cos, n,
                  f"{int((~within).sum())} of {n} elements exceed atol={atol:g} + rtol={rtol:g}*|ref|")


def main(argv=None):
    p = argparse.ArgumentParser(description="Compare a device run with the bundle's reference outputs.")
    p.add_argument("run", type=Path, help="a directory of <case>.npz, or one .npz with --case")
    p.add_argument("--case", help="the reference case RUN (a file) belongs to")
    p.add_argument("--precision", choices=sorted(TOLERANCE), help="tolerance preset (default: the bundle's)")
    p.add_argument("--atol", type=float)
    p.add_argument("--rtol", type=float)
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    args = p.parse_args(argv)
    meta = json.loads((HERE / "reference" / "cases.json").read_text())
    precision = args.precision or meta["precision"]
    atol, rtol = TOLERANCE[precision]
    atol = args.atol if args.atol is not None else atol
    rtol = args.rtol if args.rtol is not None else rtol
    cases = {c["name"]: c for c in meta["cases"] if c.get("outputs")}
    if not cases:
        print("this bundle has no reference outputs", file=sys.stderr)
        return 2
    if args.run.is_dir():
        todo = [(name, args.run / f"{name}.npz") for name in cases]
    elif args.case:
        if args.case not in cases:
            print(f"unknown case {args.case!r} (cases: {', '.join(cases)})", file=sys.stderr)
            return 2
        todo = [(args.case, args.run)]
    else:
        stem = args.run.stem
        if stem not in cases:
            print(f"say which case {args.run} is (--case NAME; cases: {', '.join(cases)})", file=sys.stderr)
            return 2
        todo = [(stem, args.run)]
    results, failed, missing = [], False, False
    for name, path in todo:
        case = cases[name]
        if not path.is_file():
            print(f"missing run file {path} for case {name}", file=sys.stderr)
            missing = True
            continue
        with np.load(HERE / case["outputs"]) as ref, np.load(path) as got:
            mask = np.load(HERE / case["mask"]) if case.get("mask") else None
            for out in meta["outputs"]:
                o = out["name"]
                if o not in got.files:
                    r = {"ok": False, "reason": f"output {o!r} missing from {path.name}"}
                else:
                    expected = ref[o]
                    valid = mask if (mask is not None and expected.ndim >= mask.ndim
                                     and expected.shape[:mask.ndim] == mask.shape) else None
                    r = compare(got[o], expected, atol, rtol, valid)
                r.update(case=name, output=o)
                results.append(r)
                failed |= not r["ok"]
    if args.json:
        print(json.dumps({"precision": precision, "atol": atol, "rtol": rtol, "results": results}, indent=2))
    else:
        for r in results:
            status = "ok" if r["ok"] else ("SUSPICIOUS" if r.get("suspicious") else "FAIL")
            detail = f"max abs {r['max_abs']:.3g}, cosine {r['cosine']:.6f}" if "max_abs" in r else ""
            print(f"{r['case']:>10} {r['output']:<24} {status:<10} {detail} {r['reason']}".rstrip())
        print(f"{'FAILED' if failed or missing else 'passed'} (atol={atol:g}, rtol={rtol:g}, precision {precision})")
    if missing:
        return 2
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
'''

MINDSPORE_SCRIPT = r'''#!/usr/bin/env python3
"""Route (a): run @@NAME@@.mindir with MindSpore (mindspore.load + nn.GraphCell) on the reference inputs and
write one .npz per case (keyed by output name) for compare_outputs.py.

ASCEND HOST ONLY by default (MindSpore with the Ascend backend and CANN installed). `--device CPU` runs it
on a CPU only for bundles compiled with --target cpu; an ascend MindIR holds fused primitives (RmsNorm,
FlashAttentionScore...) without CPU kernels. `--load-only` stops after loading (works on any MindSpore).

    python mindspore/infer_mindspore.py [--device Ascend] [--device-id 0] [--out outputs/mindspore]
    python compare_outputs.py outputs/mindspore --precision @@DEVICE_PRECISION@@
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

BUNDLE = Path(__file__).resolve().parents[1]
MINDIR = BUNDLE / "model" / "@@NAME@@.mindir"
INPUTS = @@INPUTS@@
OUTPUTS = @@OUTPUTS@@
PRECISION_MODE = "@@PRECISION_MODE@@"  # Ascend operator precision: keep the model's dtypes
MS_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16", "float64": "float64",
             "int64": "int64", "int32": "int32", "int16": "int16", "int8": "int8", "uint8": "uint8", "bool": "bool_"}


def check_case(name, arrays):
    for spec in INPUTS:
        arr = arrays[spec["name"]]
        if arr.ndim != len(spec["shape"]):
            sys.exit(f"{name}: {spec['name']} has rank {arr.ndim}, the model wants {len(spec['shape'])}")
        for axis, d in enumerate(spec["shape"]):
            if isinstance(d, int) and arr.shape[axis] != d:
                sys.exit(f"{name}: {spec['name']} dim {axis} is {arr.shape[axis]}, the model wants {d}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="Ascend", choices=["Ascend", "CPU"])
    p.add_argument("--device-id", type=int, default=0)
    p.add_argument("--out", type=Path, default=BUNDLE / "outputs" / "mindspore")
    p.add_argument("--load-only", action="store_true", help="load the MindIR and build the GraphCell, run nothing")
    args = p.parse_args(argv)

    import mindspore as ms
    from mindspore import Tensor, nn

    try:
        ms.set_device(args.device, args.device_id)
    except AttributeError:  # MindSpore before set_device
        ms.set_context(device_target=args.device, device_id=args.device_id)
    ms.set_context(mode=ms.GRAPH_MODE)
    if args.device == "Ascend":
        try:
            from mindspore.device_context.ascend.op_precision import precision_mode
            precision_mode(PRECISION_MODE)
        except ImportError:
            ms.set_context(ascend_config={"precision_mode": PRECISION_MODE})
    # MindIRs with weights over 1 GiB keep them in model/@@NAME@@_variables/: it must stay beside the .mindir.
    graph = ms.load(str(MINDIR))
    cell = nn.GraphCell(graph)
    # Declare the dynamic dims before the first call: without these placeholders a GraphCell keeps some shapes
    # of its first call and fails at the next shape (found by graphconv with MindSpore 2.10).
    dtype = {s["name"]: getattr(ms, MS_DTYPES[s["dtype"]]) for s in INPUTS}
    cell.set_inputs(*[Tensor(shape=[d if isinstance(d, int) else None for d in s["shape"]], dtype=dtype[s["name"]])
                      for s in INPUTS])
    print(f"loaded {MINDIR.name} on {args.device}")
    if args.load_only:
        return 0
    meta = json.loads((BUNDLE / "reference" / "cases.json").read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    for case in meta["cases"]:
        with np.load(BUNDLE / case["inputs"]) as data:
            arrays = {s["name"]: data[s["name"]] for s in INPUTS}
        check_case(case["name"], arrays)
        outs = cell(*[Tensor(arrays[s["name"]], dtype=dtype[s["name"]]) for s in INPUTS])
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        result = {}
        for name, t in zip(OUTPUTS, outs):
            if t.dtype == ms.bfloat16:
                t = t.astype(ms.float32)
            result[name] = t.asnumpy()
        np.savez(args.out / f"{case['name']}.npz", **result)
        print(f"{case['name']}: wrote {args.out / (case['name'] + '.npz')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''

LITE_SHELL = r'''#!/usr/bin/env bash
# ASCEND HOST ONLY: route (b), MindSpore Lite. Converts model/@@NAME@@.mindir for Ascend with converter_lite
# (MindSpore Lite cloud-side package; add tools/converter/lib to LD_LIBRARY_PATH) and lite/converter.cfg.
# Writes lite/@@NAME@@_ascend.mindir; then run: python lite/infer_lite.py
set -euo pipefail
cd "$(dirname "$0")/.."
command -v converter_lite >/dev/null || { echo "converter_lite not found: install the MindSpore Lite cloud-side package on the Ascend host and put tools/converter/converter on PATH" >&2; exit 1; }
@@COMMAND@@
'''

LITE_SCRIPT = r'''#!/usr/bin/env python3
"""Route (b): run lite/@@NAME@@_ascend.mindir (from lite/convert_lite.sh) with MindSpore Lite on the
reference inputs and write one .npz per case (keyed by output name) for compare_outputs.py.

ASCEND HOST ONLY (mindspore_lite wheel of the cloud-side package, CANN installed). With dynamic profiles
the model runs only at profile shapes; the reference case shapes are among the profiles.

    python lite/infer_lite.py [--device-id 0] [--out outputs/lite]
    python compare_outputs.py outputs/lite --precision @@DEVICE_PRECISION@@
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

BUNDLE = Path(__file__).resolve().parents[1]
MODEL = BUNDLE / "lite" / "@@NAME@@_ascend.mindir"
INPUTS = @@INPUTS@@
OUTPUTS = @@OUTPUTS@@


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device-id", type=int, default=0)
    p.add_argument("--out", type=Path, default=BUNDLE / "outputs" / "lite")
    args = p.parse_args(argv)
    if not MODEL.is_file():
        sys.exit(f"{MODEL} is missing: run lite/convert_lite.sh first")

    import mindspore_lite as mslite

    context = mslite.Context()
    context.target = ["ascend"]
    context.ascend.device_id = args.device_id
    model = mslite.Model()
    model.build_from_file(str(MODEL), mslite.ModelType.MINDIR, context)
    meta = json.loads((BUNDLE / "reference" / "cases.json").read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    for case in meta["cases"]:
        with np.load(BUNDLE / case["inputs"]) as data:
            arrays = [data[s["name"]] for s in INPUTS]
        inputs = model.get_inputs()
        model.resize(inputs, [list(a.shape) for a in arrays])
        for tensor, arr in zip(inputs, arrays):
            tensor.set_data_from_numpy(np.ascontiguousarray(arr))
        outputs = model.predict(inputs)
        np.savez(args.out / f"{case['name']}.npz", **{n: t.get_data_to_numpy() for n, t in zip(OUTPUTS, outputs)})
        print(f"{case['name']}: wrote {args.out / (case['name'] + '.npz')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''

ATC_ONNX_SHELL = r'''#!/usr/bin/env bash
# ASCEND HOST ONLY (CANN toolkit with atc; source set_env.sh first): route (c), ONNX -> .om with
# `atc --framework=5`. Mode "range" builds one dynamic-shape model over the --shape-range ranges (-1 where no
# range was given); mode "profiles" builds one model per --dynamic_dims profile (it runs only at those shapes).
#   bash atc/atc_onnx.sh [@@MODES@@]     (default: @@DEFAULT@@)    -> om/@@NAME@@*.om
set -euo pipefail
cd "$(dirname "$0")/.."
command -v atc >/dev/null || { echo "atc not found: run on a host with the CANN toolkit (source .../set_env.sh)" >&2; exit 1; }
mkdir -p om
case "${1:-@@DEFAULT@@}" in
@@BRANCHES@@
  *)
    echo "usage: $0 [@@MODES@@]" >&2
    exit 2
    ;;
esac
'''

ATC_AIR_SHELL = r'''#!/usr/bin/env bash
# ASCEND HOST ONLY (CANN toolkit with atc): route (c), AIR -> .om with `atc --framework=1`. First export the
# AIR files on an Ascend host with MindSpore: python atc/export_air.py  (one static-shape AIR per reference
# case: --input_shape and --dynamic_dims are not honoured with --framework=1).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v atc >/dev/null || { echo "atc not found: run on a host with the CANN toolkit (source .../set_env.sh)" >&2; exit 1; }
ls air/*.air >/dev/null 2>&1 || { echo "no air/*.air: run python atc/export_air.py on an Ascend host first" >&2; exit 1; }
mkdir -p om
@@COMMANDS@@
'''

AIR_SCRIPT = r'''#!/usr/bin/env python3
"""Route (c), AIR: export the compiled network (source/network.py + source/network.ckpt) to AIR, one file per
reference case at that case's static shapes, for atc/atc_air.sh (`atc --framework=1`).

ASCEND HOST ONLY: mindspore.export(file_format="AIR") works only with the Ascend backend; MindSpore documents
AIR as deprecated (to be removed) and limits each tensor of an AIR file to 2 GB.

    python atc/export_air.py [--device-id 0] [--case case0 ...]
"""
import argparse
import importlib.util
import sys
from pathlib import Path

import numpy as np

BUNDLE = Path(__file__).resolve().parents[1]
INPUTS = @@INPUTS@@
CASES = @@CASES@@
PRECISION_MODE = "@@PRECISION_MODE@@"


def load_network():
    spec = importlib.util.spec_from_file_location("network", BUNDLE / "source" / "network.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["network"] = module
    spec.loader.exec_module(module)
    return module.Network


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device-id", type=int, default=0)
    p.add_argument("--case", action="append", choices=CASES, help="export only this case (repeatable)")
    args = p.parse_args(argv)

    import mindspore as ms
    from mindspore import Tensor

    try:
        ms.set_device("Ascend", args.device_id)
    except AttributeError:
        ms.set_context(device_target="Ascend", device_id=args.device_id)
    ms.set_context(mode=ms.GRAPH_MODE)
    net = load_network()()  # parameters as zeros, then the checkpoint
    missing, _ = ms.load_param_into_net(net, ms.load_checkpoint(str(BUNDLE / "source" / "network.ckpt")))
    if missing:
        sys.exit(f"parameters missing from network.ckpt: {missing[:5]}")
    net.set_train(False)
    out_dir = BUNDLE / "air"
    out_dir.mkdir(exist_ok=True)
    for case in args.case or CASES:
        with np.load(BUNDLE / "reference" / f"{case}.inputs.npz") as data:
            arrays = [data[s["name"]] for s in INPUTS]
        ms.export(net, *[Tensor(a) for a in arrays], file_name=str(out_dir / f"@@NAME@@_{case}"), file_format="AIR")
        print(f"wrote {out_dir / ('@@NAME@@_' + case + '.air')} at shapes {[list(a.shape) for a in arrays]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''

README = r'''# Deploy bundle: @@NAME@@

Generated by graphconv @@GC_VERSION@@ (`graphconv compile --bundle`), target `@@TARGET@@`, SoC `@@SOC@@`,
CANN @@CANN@@, precision @@PRECISION@@. Nothing here needs graphconv: the scripts need numpy, and MindSpore,
MindSpore Lite or the CANN toolkit for the route they serve.

**Where things run.** `compare_outputs.py` runs anywhere (numpy only). Everything under `mindspore/`,
`lite/` and `atc/` is **Ascend host only** (each script says so in its first lines), except
`mindspore/infer_mindspore.py --load-only`, and `--device CPU` for bundles compiled with `--target cpu`.

## Model

| | name | dtype | shape |
|---|---|---|---|
@@IO_ROWS@@

Shape ranges (`--shape-range`): @@RANGES@@. Dynamic profiles (routes b and c-profiles): @@PROFILES@@.
@@PROFILE_NOTES@@
## Files

- `model/@@NAME@@.mindir` — the MindIR (@@HOW_MINDIR@@ of the compiled file).
@@VARIABLES@@- `source/network.py`, `source/network.ckpt` — the generated MindSpore network and its weights
  (@@HOW_SOURCE@@, @@HOW_CKPT@@); `Network()` then `mindspore.load_param_into_net`.
- `onnx/@@NAME@@.onnx` — the simplified ONNX (opset @@OPSET@@) the MindIR was compiled from; `@@ATC_ONNX_FILE@@` is
  the file the ATC route reads (opset @@ATC_OPSET@@).
- `reference/<case>.inputs.npz` (keyed by graph input name), `reference/<case>.outputs.npz` (keyed by output
  name), `reference/<case>.mask.npy` (valid positions), `reference/cases.json`.
- `compare_outputs.py`, `manifest.json` (every command, the profiles, tool versions).

Reference cases:

| case | input shapes | masked row |
|---|---|---|
@@CASE_ROWS@@

## Check a device run

Each route's run writes `<case>.npz` files keyed by output name; compare them with the reference outputs:

| route | runs | compare |
|---|---|---|
| (a) MindSpore | the MindIR | `python compare_outputs.py outputs/mindspore --precision @@DEVICE_PRECISION@@` |
| (b) MindSpore Lite | the MindIR, converted | `python compare_outputs.py outputs/lite --precision @@DEVICE_PRECISION@@` |
| (c) ATC, ONNX | the simplified ONNX | `python compare_outputs.py OM_RUN_DIR --precision @@PRECISION@@` |
| (c) ATC, AIR | the generated network | `python compare_outputs.py OM_RUN_DIR --precision @@DEVICE_PRECISION@@` |

Rule (graphconv's): elementwise |actual − reference| ≤ atol + rtol·|reference| with fp32 1e-4/1e-4, fp16
1e-2/1e-2, bf16 3e-2/3e-2 (this bundle: @@PRECISION@@, atol @@ATOL@@, rtol @@RTOL@@); integers and bools
exactly; inf/NaN must match in kind; positions where the attention mask is 0 are skipped (outputs there are
undefined on Ascend). Exit code 0 pass, 1 fail, 2 missing files.
@@FP16_NOTE@@
## Route (a): MindSpore on Ascend — Ascend host only

```
python mindspore/infer_mindspore.py --device Ascend --device-id 0
python compare_outputs.py outputs/mindspore --precision @@DEVICE_PRECISION@@
```

`mindspore.load` + `nn.GraphCell`, with `GraphCell.set_inputs(...)` given dynamic placeholders
(`Tensor(shape=[None, ...], dtype)`) before the first call: without them a GraphCell keeps some shapes of its
first call and fails at a second shape. The script sets the Ascend operator precision mode
`@@ATC_PRECISION@@` (MindSpore's default differs per product: allow_fp32_to_fp16 on Atlas training series,
must_keep_origin_dtype on Atlas A2).

Which MindSpore versions load this MindIR: it was exported by @@PRODUCER@@.
graphconv's verify stage loads MindIRs with that same MindSpore on CPU (the compile report's
`validation.status` says whether it ran for this one). Other versions are not established: MindSpore
publishes no MindIR compatibility matrix that graphconv could find, and the fused primitives the MindIR
calls must exist in the loading version. Run `--load-only` with your version first.

## Route (b): MindSpore Lite — Ascend host only

```
@@LITE_CMD@@
```

(`bash lite/convert_lite.sh` runs it from the bundle root; then `python lite/infer_lite.py` and
`python compare_outputs.py outputs/lite --precision @@DEVICE_PRECISION@@`.) `--optimize=ascend_oriented`: the
converted model runs on the Ascend backend only. `lite/converter.cfg` sets `precision_mode=@@LITE_PRECISION@@`
in `[ascend_context]` and the dynamic profiles as @@LITE_HOW@@. The converter documentation notes it cannot
run with CANN packages below 7.5.

## Route (c): an .om through ATC — Ascend host only

ATC does not read MindIR. Two inputs are possible: the ONNX (`--framework=5`) and MindSpore AIR
(`--framework=1`), which has to be exported on an Ascend host.

### ONNX (`bash atc/atc_onnx.sh [range|profiles]`)

```
@@ATC_CMDS@@
```

- Opset: the model is opset @@OPSET@@; CANN @@CANN@@ (row @@CANN_ROW@@) accepts @@ACCEPTED@@. @@OPSET_NOTE@@.
  The table graphconv applies (from the bundle issue's documented ranges; `--cann` picks the row, default
  the newest):

  | CANN | ONNX opsets ATC accepts |
  |---|---|
@@OPSET_ROWS@@
- `--input_shape` gives each dynamic dim its `--shape-range` as `min~max` (dynamic shape; -1 = any size
  where no range was given); shape ranges are not available on Atlas 200/300/500 and 200I/500 A2
  (Ascend310, Ascend310B), where only the profiles mode applies. `--dynamic_dims` profiles (2..100) need
  `--input_format=ND` and exclude `--dynamic_batch_size`, `--dynamic_image_size` and shape ranges.
- `--precision_mode=@@ATC_PRECISION@@` (from precision @@PRECISION@@; ATC's default is force_fp16).
  must_keep_origin_dtype fails where an operator has no implementation in the model's dtype.
- @@SOC_NOTE@@
- ATC's general restrictions list FP32/FP16/UINT8 as ONNX input data types; models with int64 inputs
  (token ids) are converted in practice, but graphconv has not verified that for this model.
- Running the .om (pyACL, ais_bench...) is not scripted here; save its outputs as `<case>.npz` keyed by output
  name and use `compare_outputs.py`.

### AIR (`python atc/export_air.py`, then `bash atc/atc_air.sh`)

```
@@AIR_CMDS@@
```

- `mindspore.export(..., file_format="AIR")` runs only on an Ascend host, and MindSpore documents AIR as
  deprecated (to be removed); one tensor may not exceed 2 GB.
- `--input_shape` and `--dynamic_dims` are not honoured with `--framework=1` (the .air model does not support
  dynamic shape profiles), so each reference case is exported at its own static shapes and converted to its
  own .om.

## Warnings

@@WARNINGS@@

## Uncertain (not verified by graphconv; no Ascend device was available)

- Whether converter_lite applies `[acl_build_options]` `ge.dynamicDims` to this model, and whether the
  profile-based .om and Lite models run the LLM-shaped graph as intended.
- The CANN→ONNX-opset table above, for CANN versions other than its rows' exact versions.
- `--soc_version` spelling for your part (see above), and int64 inputs through ATC.
- MindSpore versions other than the exporting one loading this MindIR.

## Provenance

@@TOOLS@@

Option tables and the documentation they follow (also in `graphconv/bundle.py`):

@@SOURCES@@
'''
