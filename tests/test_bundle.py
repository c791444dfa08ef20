"""The Ascend deploy bundle (graphconv.deploy): files, golden content, every generated command against the
option tables, the CANN/opset table, the standalone compare script, and the MindSpore script on CPU.

Golden files live in tests/golden/bundle/ with tool versions normalised; regenerate them after an intended
change with GRAPHCONV_UPDATE_GOLDEN=1 and review the diff.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

import graphconv
from graphconv import deploy
from graphconv.verify import compare, reference
from graphconv.errors import InputError, InternalError
from graphconv.onnx_domains import default_opset

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "examples" / "tiny_llama.onnx"
GOLDEN = ROOT / "tests" / "golden" / "bundle"
UPDATE = bool(os.environ.get("GRAPHCONV_UPDATE_GOLDEN"))
RANGES = {"batch": (1, 8), "seq": (1, 2048)}

EXPECTED_FILES = [
    "README.md", "manifest.json", "compare_outputs.py",
    "model/tiny_llama.mindir", "source/network.py", "source/network.ckpt", "onnx/tiny_llama.onnx",
    "reference/cases.json", "reference/case0.inputs.npz", "reference/case0.outputs.npz", "reference/case0.mask.npy",
    "reference/case1.inputs.npz", "reference/case1.outputs.npz", "reference/case1.mask.npy",
    "mindspore/infer_mindspore.py",
    "lite/converter.cfg", "lite/convert_lite.sh", "lite/infer_lite.py",
    "atc/atc_onnx.sh", "atc/export_air.py", "atc/atc_air.sh",
]
ASCEND_ONLY = ["mindspore/infer_mindspore.py", "lite/convert_lite.sh", "lite/infer_lite.py", "atc/atc_onnx.sh",
               "atc/export_air.py", "atc/atc_air.sh"]
GOLDEN_FILES = [f for f in EXPECTED_FILES if f.endswith((".md", ".json", ".py", ".sh", ".cfg"))
                and not f.startswith("source/")]
# Run a bundle script with everything but numpy made unimportable: the device host has no graphconv.
NUMPY_ONLY = ("import runpy, sys\n"
              "for m in ('graphconv', 'onnx', 'onnxruntime', 'mindspore', 'onnx_ir', 'onnxscript', 'torch'):\n"
              "    sys.modules[m] = None\n"
              "sys.argv = sys.argv[1:]\n"
              "runpy.run_path(sys.argv[0], run_name='__main__')\n")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The tiny Llama compiled for ascend with a bundle (one compile for the module)."""
    d = tmp_path_factory.mktemp("bundle-ascend")
    report = graphconv.compile(MODEL, d / "tiny_llama.mindir", bundle=d / "bundle", shape_ranges=RANGES)
    return d / "bundle", report, d


@pytest.fixture(scope="module")
def built_cpu(tmp_path_factory):
    """--target cpu, no --shape-range: a bundle whose MindIR runs on this host."""
    d = tmp_path_factory.mktemp("bundle-cpu")
    report = graphconv.compile(MODEL, d / "tiny_llama.mindir", target="cpu", bundle=d / "bundle")
    return d / "bundle", report


def _normalise(text: str, tools: dict) -> str:
    for name, version in tools.items():
        text = re.sub(rf"(?i)\b{re.escape(name)} {re.escape(version)}\b", f"{name} <version>", text)
    return text.replace(f"graphconv {graphconv.__version__}", "graphconv <version>")


def _normalised_file(path: Path, tools: dict) -> str:
    if path.name == "manifest.json":
        data = json.loads(path.read_text())
        data["tools"] = {k: "<version>" for k in data["tools"]}
        data["graphconv"] = "<version>"
        data["census"] = "<the compile's census, tested with the compile>"  # moves with every fusion pass
        data["mindir"] = {k: ("<version>" if k == "model_version" else v) for k, v in data["mindir"].items()}
        return deploy._json(data) + "\n"
    return _normalise(path.read_text(), tools)


def _load_compare_module(path: Path):
    spec = importlib.util.spec_from_file_location("bundle_compare_outputs", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look up the module of a class (the script has Comparison)
    spec.loader.exec_module(module)
    return module


# --- files ------------------------------------------------------------------------------------------------

def test_bundle_has_every_file_and_reports_them(built):
    directory, report, out_dir = built
    assert report.status == "verified"
    written = report.validation["bundle_files"]
    for rel in EXPECTED_FILES:
        assert (directory / rel).is_file(), rel
        assert rel in written, rel
    on_disk = sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())
    assert on_disk == sorted(written)
    assert report.artifacts["bundle"] == str(directory)
    for rel in ASCEND_ONLY + ["compare_outputs.py"]:
        assert os.access(directory / rel, os.X_OK), rel
    # The MindIR is a hard link of the compiled file (same filesystem here).
    assert (directory / "model/tiny_llama.mindir").stat().st_ino == (out_dir / "tiny_llama.mindir").stat().st_ino


def test_reference_data_is_keyed_by_graph_names(built):
    directory, report, _ = built
    meta = json.loads((directory / "reference/cases.json").read_text())
    assert meta["precision"] == "fp32" and (meta["atol"], meta["rtol"]) == (1e-4, 1e-4)
    for case in meta["cases"]:
        with np.load(directory / case["inputs"]) as z:
            assert sorted(z.files) == ["attention_mask", "input_ids"]
            assert z["input_ids"].dtype == np.int64
        with np.load(directory / case["outputs"]) as z:
            assert z.files == ["output"]
            assert z["output"].shape[:2] == tuple(case["shapes"]["input_ids"])
        mask = np.load(directory / case["mask"])
        assert mask.dtype == bool and not mask.all()


def test_nothing_in_the_bundle_needs_graphconv_or_absolute_paths(built):
    directory, _, out_dir = built
    for f in directory.rglob("*"):
        if f.suffix in (".py", ".sh", ".md", ".json", ".cfg"):
            text = f.read_text()
            assert not re.search(r"^\s*(import|from) graphconv", text, re.M), f
            assert str(out_dir) not in text and "/tmp/" not in text, f


def test_ascend_only_scripts_say_so(built):
    directory, _, _ = built
    for rel in ASCEND_ONLY:
        head = "\n".join((directory / rel).read_text().splitlines()[:12])
        assert "ASCEND HOST ONLY" in head, rel
    readme = (directory / "README.md").read_text()
    assert readme.count("Ascend host only") >= 3


def test_golden_files(built):
    directory, report, _ = built
    tools = report.provenance["tools"]
    mismatched = []
    for rel in GOLDEN_FILES:
        got = _normalised_file(directory / rel, tools)
        golden = GOLDEN / rel
        if UPDATE:
            golden.parent.mkdir(parents=True, exist_ok=True)
            golden.write_text(got)
            continue
        assert golden.is_file(), f"missing golden {golden} (run with GRAPHCONV_UPDATE_GOLDEN=1)"
        if golden.read_text() != got:
            mismatched.append(rel)
    assert not mismatched, f"bundle files differ from tests/golden/bundle: {mismatched}"


# --- the three routes for the tiny Llama ----------------------------------------------------------------

def test_all_three_routes_for_the_tiny_llama(built):
    directory, _, _ = built
    manifest = json.loads((directory / "manifest.json").read_text())
    cmds = manifest["commands"]
    (lite,) = cmds["lite"]
    assert lite[:2] == ["converter_lite", "--fmk=MINDIR"]
    assert "--optimize=ascend_oriented" in lite and "--modelFile=model/tiny_llama.mindir" in lite
    rng, prof = cmds["atc_onnx"]
    assert "--framework=5" in rng and "--soc_version=Ascend910B" in rng
    assert "--input_shape=input_ids:1~8,1~2048;attention_mask:1~8,1~2048" in rng
    assert "--precision_mode=must_keep_origin_dtype" in rng
    assert "--input_shape=input_ids:-1,-1;attention_mask:-1,-1" in prof
    dyn = next(t for t in prof if t.startswith("--dynamic_dims=")).split("=", 1)[1].split(";")
    assert 2 <= len(dyn) <= 100
    assert "3,5,3,5" in dyn and "5,11,5,11" in dyn  # the reference cases run on the profile model
    assert all(len(p.split(",")) == 4 for p in dyn)
    assert [c[3] for c in cmds["atc_air"]] == ["--output=om/tiny_llama_air_case0", "--output=om/tiny_llama_air_case1"]
    assert all("--framework=1" in c and not any(t.startswith(("--input_shape", "--dynamic_dims")) for t in c)
               for c in cmds["atc_air"])
    cfg = deploy.parse_lite_config((directory / "lite/converter.cfg").read_text())
    assert cfg["ascend_context"]["precision_mode"] == "enforce_origin"
    assert cfg["acl_build_options"]["input_shape"] == "input_ids:-1,-1;attention_mask:-1,-1"
    assert cfg["acl_build_options"]["ge.dynamicDims"].split(";") == dyn
    ms_script = (directory / "mindspore/infer_mindspore.py").read_text()
    assert "cell.set_inputs(" in ms_script and "shape=[d if isinstance(d, int) else None" in ms_script


# --- every generated command against the option tables -------------------------------------------------

def test_every_generated_command_agrees_with_the_option_tables(built):
    directory, _, _ = built
    assert deploy.check_bundle(directory) == []
    manifest = json.loads((directory / "manifest.json").read_text())
    from_scripts = []
    for rel in ("lite/convert_lite.sh", "atc/atc_onnx.sh", "atc/atc_air.sh"):
        found = deploy.extract_commands((directory / rel).read_text())
        assert found, rel
        for argv in found:
            assert deploy.check_command(argv) == [], argv
        from_scripts += found
    from_manifest = [c for group in manifest["commands"].values() for c in group]
    assert sorted(map(tuple, from_scripts)) == sorted(map(tuple, from_manifest))
    # The README shows the same commands, and they parse back too.
    readme_cmds = deploy.extract_commands((directory / "README.md").read_text())
    assert sorted(map(tuple, readme_cmds)) == sorted(map(tuple, from_manifest))
    assert deploy.check_lite_config((directory / "lite/converter.cfg").read_text()) == []


def test_a_misspelt_flag_is_rejected_by_the_same_checker(built, tmp_path):
    directory, _, _ = built
    script = (directory / "atc/atc_onnx.sh").read_text()
    argv = deploy.extract_commands(script)[0]
    bad = [t.replace("--soc_version=", "--soc_verison=") for t in argv]
    problems = deploy.check_command(bad)
    assert any("unknown option --soc_verison" in p and "did you mean --soc_version" in p for p in problems)
    assert any("--soc_version is required" in p for p in problems)
    # The same checker, run over a bundle holding the misspelt script, fails it.
    copy = tmp_path / "b"
    shutil.copytree(directory, copy)
    (copy / "atc/atc_onnx.sh").write_text(script.replace("--soc_version=", "--soc_verison=", 1))
    assert any("soc_verison" in p for p in deploy.check_bundle(copy))
    lite = deploy.extract_commands((directory / "lite/convert_lite.sh").read_text())[0]
    assert any("unknown option --optimise" in p for p in
               deploy.check_command([t.replace("--optimize=", "--optimise=") for t in lite]))
    cfg = (directory / "lite/converter.cfg").read_text()
    assert any("unknown key ge.dynamicDim " in p + " " for p in
               deploy.check_lite_config(cfg.replace("ge.dynamicDims=", "ge.dynamicDim=")))
    assert any("unknown section [ascend_contxt]" in p for p in
               deploy.check_lite_config(cfg.replace("[ascend_context]", "[ascend_contxt]")))
    with pytest.raises(deploy.CommandError, match="unknown option --soc_verison"):
        deploy.command("atc", {"model": "m.onnx", "framework": "5", "output": "om/m", "soc_verison": "Ascend910B"})


ATC_OK = ["atc", "--model=onnx/m.onnx", "--framework=5", "--output=om/m", "--soc_version=Ascend910B1"]


@pytest.mark.parametrize("extra,expect", [
    (["--input_shape=x:-1,-1", "--input_format=ND", "--dynamic_dims=1,2;3,4", "--dynamic_batch_size=1,2"],
     "contradict each other"),
    (["--input_shape=x:1~8,-1", "--input_format=ND", "--dynamic_dims=1;2"], "contradict each other"),
    (["--input_shape=x:-1,-1", "--input_format=ND", "--dynamic_dims=1;2"], "has 1 values for 2 -1 dims"),
    (["--input_shape=x:-1", "--input_format=NCHW", "--dynamic_dims=1;2"], "--input_format=ND"),
    (["--input_shape=x:-1", "--dynamic_dims=1;2"], "--dynamic_dims needs --input_format"),
    (["--input_shape_range=x:[1~8]"], "deprecated"),
    (["--precision_mode=fp32"], "is not one of"),
    (["--precision_mode=force_fp16", "--precision_mode_v2=fp16"], "contradict each other"),
    (["--log=error", "--log=info"], "given twice"),
    (["--input_shape=x:8~1"], "empty or not positive"),
    (["--weight=w.caffemodel"], "only applies with --framework=0"),
    (["stray"], "stray argument"),
])
def test_contradictory_or_malformed_atc_flags_are_refused(extra, expect):
    assert deploy.check_command(ATC_OK) == []
    problems = deploy.check_command(ATC_OK + extra)
    assert any(expect in p for p in problems), problems


def test_atc_framework_specific_rules():
    air = ["atc", "--model=air/m.air", "--framework=1", "--output=om/m", "--soc_version=Ascend910B1"]
    assert deploy.check_command(air) == []
    assert any("not honoured with --framework=1" in p for p in deploy.check_command(air + ["--input_shape=x:1,2"]))
    assert any("not honoured with --framework=1" in p
               for p in deploy.check_command(air + ["--input_shape=x:-1", "--input_format=ND", "--dynamic_dims=1;2"]))
    mindir = ["atc", "--model=model/m.mindir", "--framework=5", "--output=om/m", "--soc_version=Ascend910B1"]
    assert any("does not read MindIR" in p for p in deploy.check_command(mindir))
    assert any("reads .air files" in p for p in deploy.check_command(
        ["atc", "--model=m.onnx", "--framework=1", "--output=om/m", "--soc_version=Ascend910B1"]))
    assert any("without the .om suffix" in p for p in deploy.check_command(
        ["atc", "--model=m.onnx", "--framework=5", "--output=om/m.om", "--soc_version=Ascend910B1"]))
    # Atlas 200I/500 A2 (Ascend310B): no shape ranges, profiles only.
    small = ["atc", "--model=m.onnx", "--framework=5", "--output=om/m", "--soc_version=Ascend310B1"]
    assert any("does not support shape ranges" in p for p in deploy.check_command(small + ["--input_shape=x:1~8"]))
    assert deploy.check_command(small + ["--input_shape=x:-1", "--input_format=ND", "--dynamic_dims=1;2"]) == []
    # ATC takes soc-version for soc_version.
    assert deploy.check_command(["atc", "--model=m.onnx", "--framework=5", "--output=om/m", "--soc-version=Ascend910B1"]) == []


def test_converter_lite_rules():
    ok = ["converter_lite", "--fmk=MINDIR", "--modelFile=m.mindir", "--outputFile=out", "--optimize=ascend_oriented"]
    assert deploy.check_command(ok) == []
    assert any("is not one of" in p for p in deploy.check_command(ok[:-1] + ["--optimize=ascend"]))
    assert any("without the suffix" in p for p in deploy.check_command(
        ["converter_lite", "--fmk=MINDIR", "--modelFile=m.mindir", "--outputFile=out.mindir"]))
    assert any("deprecated" in p for p in deploy.check_command(ok + ["--device=Ascend310"]))
    assert any("reads .mindir files" in p for p in deploy.check_command(
        ["converter_lite", "--fmk=MINDIR", "--modelFile=m.onnx", "--outputFile=out"]))
    assert any("--fmk is required" in p for p in deploy.check_command(
        ["converter_lite", "--modelFile=m.mindir", "--outputFile=out"]))


def test_ascend_context_dynamic_dims_only_for_4d_batch_or_image_inputs():
    # What the wording suggests for the Llama ([ascend_context] dynamic_dims on its 2-D inputs) is
    # refused: converter_lite turns those into dynamic batch/image sizes of 4-D inputs only.
    llama = ("[ascend_context]\ninput_shape=input_ids:[-1,-1];attention_mask:[-1,-1]\n"
             "dynamic_dims=[1,1],[8,2048];[1,1],[8,2048]\n")
    assert any("4-D inputs" in p for p in deploy.check_lite_config(llama))
    batch = "[ascend_context]\ninput_shape=x:[-1,3,224,224]\ndynamic_dims=[1],[2],[4]\n"
    assert deploy.check_lite_config(batch) == []
    assert any("needs input_shape" in p for p in deploy.check_lite_config("[ascend_context]\ndynamic_dims=[1],[2]\n"))
    both = ("[ascend_context]\ninput_shape=x:[-1,3,224,224]\ndynamic_dims=[1],[2]\n"
            "[acl_build_options]\ninput_format=ND\ninput_shape=x:-1,3,224,224\nge.dynamicDims=1;2\n")
    problems = deploy.check_lite_config(both)
    assert any("input_shape in both" in p for p in problems) and any("contradict" in p for p in problems)
    assert any("one key=value" in p for p in deploy.check_lite_config("[ascend_context]\nprecision_mode=a=b\n"))
    nd_bad = "[acl_build_options]\ninput_format=NCHW\ninput_shape=x:-1,-1\nge.dynamicDims=1,2;3,4\n"
    assert any("input_format=ND" in p for p in deploy.check_lite_config(nd_bad))


def _fake_ctx(tmp_path, inputs, cases, **kw) -> deploy.BundleContext:
    return deploy.BundleContext(
        name="m", mindir=tmp_path / "m.mindir", variables=None, onnx_model=onnx.ModelProto(), source=tmp_path / "n.py",
        checkpoint=tmp_path / "n.ckpt", inputs=inputs, outputs=[{"name": "y", "dtype": "float32", "shape": []}],
        cases=cases, expected=None, **kw)


def test_4d_dynamic_batch_model_uses_ascend_context(tmp_path):
    inputs = [{"name": "x", "dtype": "float32", "shape": ["N", 3, 224, 224]}]
    cases = [reference.ReferenceCase(f"case{i}", {"x": np.zeros((n, 3, 224, 224), np.float32)}) for i, n in enumerate((3, 5))]
    ctx = _fake_ctx(tmp_path, inputs, cases, shape_ranges={"N": (1, 16)})
    plan = deploy._Plan(ctx, deploy.collect_dims(inputs, cases, ctx.shape_ranges))
    cfg = plan.lite_config()
    parsed = deploy.parse_lite_config(cfg)
    assert parsed["ascend_context"]["input_shape"] == "x:[-1,3,224,224]"
    assert parsed["ascend_context"]["dynamic_dims"] == "[1],[2],[3],[4],[5],[8],[16]"
    assert "acl_build_options" not in parsed


def test_ascend310b_soc_gets_profiles_only(tmp_path):
    inputs = [{"name": "ids", "dtype": "int64", "shape": ["batch", "seq"]}]
    cases = [reference.ReferenceCase(f"case{i}", {"ids": np.zeros(s, np.int64)}) for i, s in enumerate([(3, 5), (5, 11)])]
    ctx = _fake_ctx(tmp_path, inputs, cases, soc="Ascend310B1", shape_ranges={"batch": (1, 4), "seq": (1, 64)})
    plan = deploy._Plan(ctx, deploy.collect_dims(inputs, cases, ctx.shape_ranges))
    plan.atc_onnx = deploy.AtcOnnx("onnx/m.onnx", 18, 18, "9.0.0-beta1", (11, 18))
    cmds = plan.atc_onnx_commands()
    assert list(cmds) == ["profiles"]
    assert "default: profiles" in plan.atc_onnx_shell()


# --- shapes and profiles -------------------------------------------------------------------------------

def _dims(ranges, ref=((3, 5), (5, 11))):
    inputs = [{"name": "ids", "dtype": "int64", "shape": ["batch", "seq"]},
              {"name": "mask", "dtype": "int64", "shape": ["batch", "seq"]}]
    cases = [reference.ReferenceCase(f"case{i}", {"ids": np.zeros(s, np.int64), "mask": np.ones(s, np.int64)})
             for i, s in enumerate(ref)]
    return inputs, deploy.collect_dims(inputs, cases, ranges)


def test_profiles_cover_the_ranges_and_the_reference_cases():
    inputs, dims = _dims({"batch": (1, 64), "seq": (1, 65536)})
    profs, notes = deploy.profiles(dims)
    assert len(profs) <= deploy.MAX_PROFILES and notes == []
    assert (3, 5) in profs and (5, 11) in profs
    assert (1, 1) in profs and (64, 65536) in profs
    assert all(1 <= b <= 64 and 1 <= s <= 65536 for b, s in profs)
    assert deploy.profile_values(inputs, dims, (3, 5)) == [3, 5, 3, 5]
    assert deploy.atc_input_shape(inputs, dims, "range") == "ids:1~64,1~65536;mask:1~64,1~65536"
    assert deploy.atc_input_shape(inputs, dims, "profile") == "ids:-1,-1;mask:-1,-1"


def test_profiles_without_ranges_use_the_reference_sizes_and_say_so():
    inputs, dims = _dims({})
    profs, notes = deploy.profiles(dims)
    assert profs == [(3, 5), (3, 11), (5, 5), (5, 11)]
    assert len(notes) == 2 and "no --shape-range" in notes[0]
    assert deploy.atc_input_shape(inputs, dims, "range") == "ids:-1,-1;mask:-1,-1"


def test_pinned_dims_are_static_and_bad_ranges_are_refused():
    inputs, dims = _dims({"batch": (4, 4), "seq": (128, 128)})
    assert dims.dynamic == [] and deploy.profiles(dims) == ([], [])
    assert deploy.atc_input_shape(inputs, dims, "range") == "ids:4,128;mask:4,128"
    inputs, dims = _dims({"batch": (1, 2)})
    profs, notes = deploy.profiles(dims)
    assert any("outside --shape-range" in n for n in notes)
    assert all(b <= 2 for b, _ in profs)
    with pytest.raises(InputError, match="not symbolic dims"):
        _dims({"sequence": (1, 8)})
    with pytest.raises(InputError, match="1 <= MIN <= MAX"):
        _dims({"seq": (0, 8)})
    deploy.check_options(inputs, {"batch": (1, 8)}, "8.0.0")
    with pytest.raises(InputError, match="not symbolic dims"):
        deploy.check_options(inputs, {"sequence": (1, 8)}, None)
    with pytest.raises(InputError, match="knows the ONNX opsets"):
        deploy.check_options(inputs, {}, "8.5.0")


# --- CANN / opset ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("cann,row,lo,hi", [
    ("5.1.RC2", "5.x-7.0", 11, 11), ("6.3.RC1", "5.x-7.0", 11, 11), ("7.0.0", "5.x-7.0", 11, 11),
    ("8.0.0", "8.0.0", 11, 15), ("9.0.0-beta1", "9.0.0-beta1", 11, 18), (None, "9.0.0-beta1", 11, 18),
])
def test_cann_opset_table(cann, row, lo, hi):
    assert deploy.cann_opset_range(cann) == (row, lo, hi)


@pytest.mark.parametrize("cann", ["7.1.0", "10.0.0", "latest"])
def test_unknown_cann_versions_are_refused(cann):
    with pytest.raises(InputError, match="knows the ONNX opsets"):
        deploy.cann_opset_range(cann)


@pytest.fixture(scope="module")
def llama_onnx():
    model = onnx.load(str(MODEL))
    return model, reference.make_cases(model)


def test_opset_clamped_for_cann_8(llama_onnx):
    model, cases = llama_onnx
    converted, facts, warnings = deploy.clamp_opset(model, "8.0.0", cases)
    assert warnings == [] and facts.converted and facts.opset == 15 and facts.original_opset == 18
    assert default_opset(converted) == 15
    onnx.checker.check_model(converted, full_check=True)
    assert default_opset(model) == 18  # the original is untouched


def test_opset_kept_with_a_warning_when_conversion_fails(llama_onnx):
    model, cases = llama_onnx
    converted, facts, warnings = deploy.clamp_opset(model, "7.0.0", cases)
    assert converted is None and not facts.converted and facts.opset == 18
    assert len(warnings) == 1 and "opset 18" in warnings[0] and "11..11" in warnings[0] and "failed" in warnings[0]


def test_opset_within_range_is_not_touched(llama_onnx):
    model, cases = llama_onnx
    assert deploy.clamp_opset(model, None, cases)[::2] == (None, [])


def _rebundle(built, tmp_path, **overrides):
    """write_bundle again from the compiled bundle's own files (no recompile)."""
    directory, report, _ = built
    model = onnx.load(str(directory / "onnx/tiny_llama.onnx"))
    cases = []
    meta = json.loads((directory / "reference/cases.json").read_text())
    expected = []
    for c in meta["cases"]:
        with np.load(directory / c["inputs"]) as z:
            inputs = {k: z[k] for k in z.files}
        cases.append(reference.ReferenceCase(c["name"], inputs, np.load(directory / c["mask"])))
        with np.load(directory / c["outputs"]) as z:
            expected.append({k: z[k] for k in z.files})
    fields = dict(name="tiny_llama", mindir=directory / "model/tiny_llama.mindir", variables=None, onnx_model=model,
                  source=directory / "source/network.py", checkpoint=directory / "source/network.ckpt",
                  inputs=report.model["inputs"], outputs=report.model["outputs"], cases=cases, expected=expected,
                  precision="fp32", target="ascend", soc="Ascend910B", cann=None, shape_ranges=RANGES,
                  census=report.census, tools=report.provenance["tools"])
    fields.update(overrides)
    ctx = deploy.BundleContext(**fields)
    out = tmp_path / "parent" / "bundle"
    out.mkdir(parents=True)
    written = deploy.write_bundle(out, ctx)
    return out, ctx, written


def test_bundle_for_cann_8_ships_the_converted_onnx(built, tmp_path):
    out, ctx, written = _rebundle(built, tmp_path, cann="8.0.0")
    assert "onnx/tiny_llama.opset15.onnx" in written and ctx.warnings == []
    assert default_opset(onnx.load(str(out / "onnx/tiny_llama.opset15.onnx"))) == 15
    for argv in json.loads((out / "manifest.json").read_text())["commands"]["atc_onnx"]:
        assert "--model=onnx/tiny_llama.opset15.onnx" in argv
    assert "converted from opset 18 to 15" in (out / "README.md").read_text()
    assert deploy.check_bundle(out) == []


def test_bundle_for_cann_7_warns_and_keeps_opset_18(built, tmp_path):
    out, ctx, written = _rebundle(built, tmp_path, cann="7.0.0")
    assert not any("opset11" in f for f in written)
    assert len(ctx.warnings) == 1 and "CANN 5.x-7.0 ATC accepts 11..11" in ctx.warnings[0]
    readme = (out / "README.md").read_text()
    assert ctx.warnings[0] in readme
    assert json.loads((out / "manifest.json").read_text())["warnings"] == ctx.warnings


def test_bundle_never_writes_outside_its_directory(built, tmp_path):
    out, _, written = _rebundle(built, tmp_path)
    assert [p.name for p in out.parent.iterdir()] == ["bundle"]
    assert all(not Path(f).is_absolute() and ".." not in Path(f).parts for f in written)
    writer = deploy._Writer(out)
    with pytest.raises(InternalError, match="outside"):
        writer.path("../escape.txt")
    with pytest.raises(InputError, match="not empty"):
        deploy.write_bundle(out, deploy.BundleContext(**{**_rebundle_fields(built), "cann": None}))


def _rebundle_fields(built):
    directory, report, _ = built
    return dict(name="x", mindir=directory / "model/tiny_llama.mindir", variables=None, onnx_model=onnx.ModelProto(),
                source=directory / "source/network.py", checkpoint=directory / "source/network.ckpt",
                inputs=report.model["inputs"], outputs=report.model["outputs"], cases=[], expected=None)


# --- the compare script ---------------------------------------------------------------------------------

def _arrays():
    rng = np.random.default_rng(0)
    b = rng.standard_normal((3, 4, 5)).astype(np.float32)
    valid = np.array([[False, True, True, True]] * 3)
    far = b.copy()
    far[0, 0] += 1.0  # only at a masked position
    nan = b.copy()
    nan[1, 1, 1] = np.nan
    ints = np.arange(12).reshape(3, 4)
    return [
        (b + 1e-6, b, None), (b + 1e-2, b, None), (b * 1.5, b, None), (far, b, None), (far, b, valid),
        (nan, b, None), (nan, nan, None), (np.where(b > 0, np.inf, b), np.where(b > 0, np.inf, b), None),
        (np.where(b > 0, -np.inf, b), np.where(b > 0, np.inf, b), None), (ints, ints, None), (ints + (ints == 5), ints, None),
        (ints > 4, ints > 4, None), (b[:2], b, None), (b.astype(np.float16), b, None),
    ]


def test_the_bundles_compare_rule_agrees_with_graphconv_compare(built):
    directory, _, _ = built
    script = _load_compare_module(directory / "compare_outputs.py")
    text = (directory / "compare_outputs.py").read_text()
    for helper in (compare.compare, compare._cosine, compare.Comparison, compare.default_tolerance):
        assert inspect.getsource(helper) in text, helper  # graphconv's own source, not a hand copy
    for precision, key in (("fp32", "float32"), ("fp16", "float16"), ("bf16", "bfloat16")):
        assert script.TOLERANCE[precision] == compare.default_tolerance(key)
    assert script.SUSPICIOUS_FACTOR == compare.SUSPICIOUS_FACTOR
    for atol, rtol in ((1e-4, 1e-4), (1e-2, 1e-2)):
        for actual, expected, valid in _arrays():
            ours = compare.compare(actual, expected, atol, rtol, valid).as_dict()
            theirs = script.compare(actual, expected, atol, rtol, valid).as_dict()
            assert set(theirs) == set(ours)
            for k, v in ours.items():
                if isinstance(v, float):
                    assert theirs[k] == pytest.approx(v, nan_ok=True), (k, actual.dtype)
                else:
                    assert theirs[k] == v, (k, theirs[k], v)


def _run_compare(directory: Path, *args):
    return subprocess.run([sys.executable, "-c", NUMPY_ONLY, str(directory / "compare_outputs.py"), *map(str, args)],
                          capture_output=True, text=True, cwd=directory.parent)


def test_compare_script_passes_reference_and_fails_perturbed_outputs(built, tmp_path):
    directory, _, _ = built
    meta = json.loads((directory / "reference/cases.json").read_text())
    good, bad, padded = tmp_path / "good", tmp_path / "bad", tmp_path / "padded"
    for d in (good, bad, padded):
        d.mkdir()
    for c in meta["cases"]:
        with np.load(directory / c["outputs"]) as z:
            out = z["output"]
        mask = np.load(directory / c["mask"])
        np.savez(good / f"{c['name']}.npz", output=out)
        np.savez(bad / f"{c['name']}.npz", output=out + 1e-3 * (1 + np.abs(out)))
        np.savez(padded / f"{c['name']}.npz", output=np.where(mask[..., None], out, out + 10.0))  # only padded rows
    ok = _run_compare(directory, good)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "passed" in ok.stdout
    fail = _run_compare(directory, bad)
    assert fail.returncode == 1 and "FAIL" in fail.stdout
    assert _run_compare(directory, padded).returncode == 0  # masked positions are not compared
    assert _run_compare(directory, bad, "--precision", "fp16").returncode == 0  # 1e-3 relative is within fp16
    one = _run_compare(directory, bad / "case0.npz", "--json")
    assert one.returncode == 1 and json.loads(one.stdout)["results"][0]["case"] == "case0"
    assert _run_compare(directory, tmp_path / "nowhere").returncode == 2


# --- route (a) on this host -----------------------------------------------------------------------------

def test_mindspore_script_loads_the_ascend_mindir_on_cpu(built):
    directory, _, _ = built
    proc = subprocess.run([sys.executable, str(directory / "mindspore/infer_mindspore.py"), "--device", "CPU",
                           "--load-only"], capture_output=True, text=True, cwd=directory.parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "loaded tiny_llama.mindir on CPU" in proc.stdout
    # the context the MindIR is written for, set by the loader itself (and said in the README)
    assert "'infer_boost': 'off'" in proc.stdout
    assert "jit_config={'infer_boost': 'off'}" in (directory / "README.md").read_text()


def test_the_cann_versions_the_bundle_states_are_the_installed_mindspores():
    """README's CANN list is MindSpore's own environment check's, for the MindSpore that writes the MindIR."""
    import mindspore
    from mindspore.run_check._check_version import AscendEnvChecker

    from graphconv.deploy.options import MINDSPORE_CANN

    assert list(MINDSPORE_CANN[mindspore.__version__]) == AscendEnvChecker(None).version


def test_cpu_bundle_runs_route_a_and_passes_its_own_comparison(built_cpu, tmp_path):
    directory, report = built_cpu
    assert report.status == "verified"
    assert deploy.check_bundle(directory) == []
    readme = (directory / "README.md").read_text()
    assert "no --shape-range" in readme  # profiles fall back to the reference sizes, and say so
    proc = subprocess.run([sys.executable, str(directory / "mindspore/infer_mindspore.py"), "--device", "CPU",
                           "--out", str(tmp_path / "run")], capture_output=True, text=True, cwd=directory.parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cmp = _run_compare(directory, tmp_path / "run")
    assert cmp.returncode == 0, cmp.stdout + cmp.stderr


@pytest.mark.parametrize("layer_streamed", [False, True])
def test_streamed_cpu_bundle_runs_route_a(tmp_path, monkeypatch, layer_streamed):
    """A bundle of a model whose weights are streamed into the MindIR (past export_task.STREAM_MIN_BYTES, lowered so
    the tiny Llama qualifies; its checkpoint copied from the MindIR's data file): the split MindIR and its
    _variables folder are in the bundle, route A loads and runs it on CPU, and it passes its own comparison."""
    from graphconv.compiler import export_task

    monkeypatch.setattr(export_task, "STREAM_MIN_BYTES", 0)
    d = tmp_path / "ext"
    d.mkdir()
    onnx.save(onnx.load(MODEL), d / "tiny_llama.onnx", save_as_external_data=True, location="tiny_llama.onnx.data",
              size_threshold=1024)
    report = graphconv.compile(d / "tiny_llama.onnx", tmp_path / "tiny_llama.mindir", target="cpu",
                               bundle=tmp_path / "bundle", layer_streamed=layer_streamed)
    assert report.status == "verified"
    assert next(s for s in report.stages if s.name == "emit").detail["streamed"] is True
    directory = tmp_path / "bundle"
    assert deploy.check_bundle(directory) == []
    assert (directory / "source" / "network.ckpt").stat().st_size > 100_000
    proc = subprocess.run([sys.executable, str(directory / "mindspore/infer_mindspore.py"), "--device", "CPU",
                           "--out", str(tmp_path / "run")], capture_output=True, text=True, cwd=directory.parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cmp = _run_compare(directory, tmp_path / "run")
    assert cmp.returncode == 0, cmp.stdout + cmp.stderr
