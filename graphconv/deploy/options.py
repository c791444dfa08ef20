"""The option tables of the two Ascend tools the bundle drives, ATC and converter_lite, and the linter that
reads commands and converter_lite config files back against them.

One entry per documented option, with its allowed values, constraints and the documentation it comes from:
`command()` builds argv from the tables and `check_command()` / `check_lite_config()` refuse unknown,
deprecated, duplicated, misvalued and contradictory flags, so a misspelt flag never reaches a user.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

from graphconv.deploy.profiles import MAX_PROFILES
from graphconv.dtypes import PRECISION_DTYPES
from graphconv.errors import InputError

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
# The execution context the MindIRs are written for, which the bundle's loaders set (docs/fused_ops.md): the
# default aclnn kernels. jit_config infer_boost "on" (MindFormers' and vllm-mindspore's setting) routes
# FlashAttentionScore to an internal kernel with other conventions (TH layout, a 128x128 compressed mask, a bf16
# mask value of 1.0), which graphconv's calls do not follow.
JIT_CONFIG = {"infer_boost": "off"}
# The CANN versions a MindSpore release's own environment check accepts (mindspore/run_check/_check_version.py,
# AscendEnvChecker.version; read from the installed wheel): a device host for a MindIR written by that release.
MINDSPORE_CANN = {"2.10.0": ("8.2", "8.3", "8.5", "9.0", "9.1")}

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

# precision -> (ATC --precision_mode, Lite [ascend_context] precision_mode). The bundle never lowers the
# model's own dtypes: fp32/bf16 keep them (must_keep_origin_dtype, so the fp32/bf16 tolerance applies);
# fp16 lets ATC pick fp16 where an op has both.
PRECISIONS = {
    "fp32": ("must_keep_origin_dtype", "enforce_origin"),
    "fp16": ("force_fp16", "enforce_fp16"),
    "bf16": ("must_keep_origin_dtype", "enforce_origin"),
}
# precision -> the dtype whose graphconv.verify.compare default tolerance applies (reference data, compare_outputs.py).
TOLERANCE_KEY = PRECISION_DTYPES


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


