"""Hostile folders (issue 36): a path named inside a folder's files stays in the folder
(graphconv/frontend/contained.py), and a checkpoint is checked before it is trusted (safetensors headers,
config.json against the weights, no pickle). Each refusal: `graphconv compile|export|generate` exits 1 with
one line naming the file, the field or tensor and the problem, writes nothing, and never opens what lies
outside the folder: the file outside is a FIFO, which an open for reading would wait on until the run's
timeout (a stat would not find it a file, so the refusal would name something else)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphconv.errors import InputError
from graphconv.frontend.contained import inside
from test_errors import assert_clean_failure, relocate_external_data

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

from test_hf_export import _bert, _gpt2, _llama, _save  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _graphconv(*args) -> subprocess.CompletedProcess:
    """The CLI, with a timeout: a run that opened a FIFO would wait on it."""
    return subprocess.run([sys.executable, "-m", "graphconv", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def _refused(tmp_path: Path, args: list, *needles: str) -> None:
    """The CLI exits 1 with one line holding `needles` and leaves tmp_path as it found it (-o included)."""
    before = {p.name for p in tmp_path.iterdir()}
    assert_clean_failure(_graphconv(*args), tmp_path, before, *needles)


def _fifo(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A tiny Llama checkpoint as save_pretrained writes it (2 layers, vocab 128, hidden 64)."""
    torch.manual_seed(0)
    return _save(_llama(), tmp_path_factory.mktemp("llama") / "ckpt")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    return _save(_llama(), tmp_path_factory.mktemp("sharded") / "ckpt", max_shard_size="50KB")


# --- the rule itself ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, why", [
    ("../outside.onnx", "leaves the folder"), ("sub/../../outside.onnx", "leaves the folder"),
    ("..\\outside.onnx", "leaves the folder"), ("/etc/passwd", "is absolute"), ("C:\\x.onnx", "is absolute"),
    ("C:x.onnx", "is absolute"), ("\\\\server\\share\\x.onnx", "is absolute"), ("", "is not a relative file path"),
    (None, "is not a relative file path"), (7, "is not a relative file path"),
    ("a\0b", "is not a relative file path")])
def test_names_that_leave_the_folder_are_refused(tmp_path, name, why):
    with pytest.raises(InputError) as e:
        inside(tmp_path, name, tmp_path / "f.json", "field")
    assert str(e.value).startswith(f"{tmp_path / 'f.json'}: field {name!r} {why}")


def test_a_symlinked_file_stays_allowed_a_symlinked_directory_does_not(tmp_path):
    """A Hugging Face cache snapshot's files are symlinks to ../../blobs/<sha>: the named path is in the
    folder, so it is accepted. A directory inside that links out is a way out: refused."""
    folder, blobs = tmp_path / "snapshots" / "abc", tmp_path / "blobs"
    folder.mkdir(parents=True)
    blobs.mkdir()
    (blobs / "sha").write_bytes(b"x")
    (folder / "model.onnx").symlink_to("../../blobs/sha")
    (folder / "out").symlink_to(blobs, target_is_directory=True)
    assert inside(folder, "model.onnx", folder / "f.json", "field") == folder / "model.onnx"
    assert inside(folder, "./sub/model.onnx", folder / "f.json", "field") == folder / "sub" / "model.onnx"
    for name, directory in (("out/sha", False), ("out", True)):
        with pytest.raises(InputError, match="leaves the folder \\(through a symlinked directory\\)"):
            inside(folder, name, folder / "f.json", "field", directory=directory)


# --- paths named by a folder's files: genai_config.json, export.json, generation.json, ONNX external data ------


@pytest.mark.parametrize("name, why", [("../outside.onnx", "leaves the folder"), ("ABSOLUTE", "is absolute"),
                                       ("link/outside.onnx", "leaves the folder (through a symlinked directory)")])
def test_genai_config_naming_a_model_outside_is_refused(tmp_path, name, why):
    """It was compiled (exit 0) from the file outside."""
    outside = _fifo(tmp_path / "outside.onnx")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "link").symlink_to(tmp_path, target_is_directory=True)
    name = str(outside) if name == "ABSOLUTE" else name
    (folder / "genai_config.json").write_text(json.dumps({"model": {"decoder": {"filename": name,
                                                                                "head_size": 16}}}))
    _refused(tmp_path, ["compile", folder, "-o", tmp_path / "gen"],
             f"{folder / 'genai_config.json'}: model.decoder.filename {name!r} {why}")


def test_export_json_naming_a_graph_outside_is_refused(tmp_path):
    """transformers' exporter folder: export.json's components.<graph>.file."""
    _fifo(tmp_path / "outside.onnx")
    folder = tmp_path / "exported"
    folder.mkdir()
    (folder / "export.json").write_text(json.dumps({"export_format": "onnx", "components": {
        "prefill": {"file": "../outside.onnx"}, "decode": {"file": "decode.onnx"}}}))
    _refused(tmp_path, ["compile", folder, "-o", tmp_path / "gen"],
             f"{folder / 'export.json'}: components.prefill.file '../outside.onnx' leaves the folder")


def test_generation_json_naming_a_tokenizer_outside_is_refused_before_the_compile(tmp_path):
    """An export folder's generation.json `tokenizer`, whose files the compile copies into GEN_DIR."""
    _fifo(tmp_path / "tok" / "tokenizer.json")
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "decode.onnx").write_bytes(b"")  # (refused before any graph is read)
    (folder / "generation.json").write_text(json.dumps({
        "task": "text-generation-with-past", "graphs": {"decode": {"serves_prompt": True}}, "tokenizer": "../tok"}))
    _refused(tmp_path, ["compile", folder, "-o", tmp_path / "gen"],
             f"{folder / 'generation.json'}: tokenizer '../tok' leaves the folder")


def _gen_dir(tmp_path: Path, **step) -> Path:
    """A GEN_DIR as generate reads it, up to the files: generation.json (with `step` in both graphs' entries,
    source_dir an empty folder) and empty cpu MindIRs. Each refusal comes before MindSpore starts."""
    gen = tmp_path / "gen"
    gen.mkdir()
    (tmp_path / "export").mkdir()
    graph = {"inputs": {"input_ids": ["batch", "seq"], "attention_mask": ["batch", "seq"]},
             "outputs": {"logits": ["batch", "seq", 16]}, **step}
    (gen / "generation.json").write_text(json.dumps({
        "task": "text-generation-with-past", "vocab_size": 16, "graphs": {"prefill": graph, "decode": graph},
        "source_dir": str(tmp_path / "export")}))
    for g in ("prefill", "decode"):
        (gen / f"{g}.cpu.mindir").write_bytes(b"")
    return gen


@pytest.mark.parametrize("step, onnx_dir, message", [
    ({"file": "../outside.onnx"}, False, "graphs.prefill.file '../outside.onnx' leaves the folder"),
    ({"file": "../outside.onnx"}, True, "graphs.prefill.file '../outside.onnx' leaves the folder"),
    ({"mindir": "../outside"}, False, "graphs.prefill.mindir '../outside' leaves the folder"),
    ({}, False, "prefill.onnx, decode.onnx not in"),  # source_dir: used only where it holds the pair
])
def test_generation_json_names_stay_in_their_folders(tmp_path, step, onnx_dir, message):
    """generate --check reads the ONNX pair generation.json records (graphs.<g>.file) from --onnx-dir or
    source_dir, and the MindIRs (graphs.<g>.mindir) from GEN_DIR."""
    _fifo(tmp_path / "outside.onnx")
    _fifo(tmp_path / "outside.cpu.mindir")
    gen = _gen_dir(tmp_path, **step)
    extra = ["--onnx-dir", tmp_path / "export"] if onnx_dir else []
    _refused(tmp_path, ["generate", gen, "--input-ids", "1,2", "--device", "cpu", "--check", *extra],
             f"{gen / 'generation.json'}: {message}" if "leaves" in message else message)


def _matmul_with_external_data(folder: Path, location: str) -> Path:
    """x [n, 64] @ w [64, 64] (16 KiB: kept external at load, not read inline), w in `location`."""
    folder.mkdir(parents=True, exist_ok=True)
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 64])], [w])
    path = folder / "model.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path,
              save_as_external_data=True, location="w.data", size_threshold=0)
    return relocate_external_data(path, location)


def test_external_data_through_a_symlinked_directory_is_refused(tmp_path):
    """(`../` and absolute locations: tests/test_hostile.py and tests/test_errors.py)"""
    _fifo(tmp_path / "w.data")
    path = _matmul_with_external_data(tmp_path / "model", "link/w.data")
    (path.parent / "link").symlink_to(tmp_path, target_is_directory=True)
    _refused(tmp_path, ["compile", path, "-o", tmp_path / "m.mindir", "-q"],
             f"{path}: tensor 'w': external data location 'link/w.data' leaves the folder (through a symlinked "
             "directory)")


def test_symlinked_files_of_a_cache_snapshot_compile(tmp_path):
    """A Hugging Face cache snapshot: the model and its external data are symlinks to ../../blobs/<sha>. The
    data's named path is in the folder: accepted (onnx.checker by path refuses any symlinked data file, so the
    checker sees the weights as graph inputs), compiled and verified."""
    made = _matmul_with_external_data(tmp_path / "made", "w.data")
    snapshot, blobs = tmp_path / "snapshots" / "abc", tmp_path / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for name, sha in (("model.onnx", "sha1"), ("w.data", "sha2")):
        shutil.move(made.parent / name, blobs / sha)
        (snapshot / name).symlink_to(f"../../blobs/{sha}")
    out = tmp_path / "m.mindir"
    proc = _graphconv("compile", snapshot / "model.onnx", "-o", out, "--target", "cpu", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["status"] == "verified" and out.is_file()


# --- a checkpoint folder: its index, its safetensors headers, its config, no pickle ---------------------------


def test_safetensors_index_naming_a_shard_outside_is_refused(sharded, tmp_path):
    _fifo(tmp_path / "secret.safetensors")
    folder = tmp_path / "ckpt"
    shutil.copytree(sharded, folder)
    index = folder / "model.safetensors.index.json"
    meta = json.loads(index.read_text())
    meta["weight_map"]["model.norm.weight"] = "../secret.safetensors"
    index.write_text(json.dumps(meta))
    _refused(tmp_path, ["export", folder, "-o", tmp_path / "out", "--task", "text-generation"],
             f"{index}: weight_map['model.norm.weight'] '../secret.safetensors' leaves the folder")


def _header(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def _write(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _lie(case: str, path: Path) -> str:
    """Rewrite the .safetensors file `path` as `case` says; the refusal's words."""
    header, data = _header(path)
    tensors = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    a, b = tensors[0], tensors[-1]  # (a: the first in the data, b: the last)
    begin, end = header[b]["data_offsets"]
    if case == "offset past the end":
        header[b]["data_offsets"] = [begin + len(data), end + len(data)]
        said = f"truncated, or its header lies: tensor {b!r} ends at byte {end + len(data)}"
    elif case == "overlapping entries":
        same = next(k for k in tensors if k != a and header[k]["shape"] == header[a]["shape"])
        header[same]["data_offsets"] = header[a]["data_offsets"]
        first, second = sorted([a, same])
        said = f"tensors {first!r} and {second!r} overlap"
    elif case == "size not dtype x shape":
        header[b]["shape"] = [*header[b]["shape"], 2]
        said = f"tensor {b!r} holds {end - begin} bytes, its dtype and shape (F32 {header[b]['shape']}) take"
    elif case == "unknown dtype":
        header[b]["dtype"] = "F33"
        said = f"tensor {b!r} has an unknown dtype 'F33'"
    elif case == "negative offset":
        header[b]["data_offsets"] = [-4, end]
        said = f"tensor {b!r} has data_offsets [-4, {end}]: not [begin, end] with 0 <= begin <= end"
    elif case == "header length past the file":
        _write(path, header, data)
        raw = path.read_bytes()
        path.write_bytes(struct.pack("<Q", 1 << 62) + raw[8:])
        return f"its header length {1 << 62} is past the end of the file"
    elif case == "header not JSON":
        raw = b"{" + b"x" * 30
        path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
        return "its header is not JSON"
    elif case == "truncated shard":
        path.write_bytes(path.read_bytes()[:-100])
        return f"truncated, or its header lies: tensor {b!r} ends at byte {end}"
    _write(path, header, data)
    return said


@pytest.mark.parametrize("case", ["offset past the end", "overlapping entries", "size not dtype x shape",
                                  "unknown dtype", "negative offset", "header length past the file",
                                  "header not JSON", "truncated shard"])
def test_a_lying_safetensors_header_is_refused_before_any_tensor_is_read(llama, tmp_path, case):
    folder = tmp_path / "ckpt"
    shutil.copytree(llama, folder)
    said = _lie(case, folder / "model.safetensors")
    _refused(tmp_path, ["export", folder, "-o", tmp_path / "out", "--task", "text-generation"],
             f"{folder / 'model.safetensors'}: ", said)


@pytest.mark.parametrize("change, said", [
    ({"num_hidden_layers": 10**6}, "num_hidden_layers is 1000000, the checkpoint holds 2 layers (model.layers.*"),
    ({"vocab_size": 10**10}, "vocab_size is 10000000000, the checkpoint's model.embed_tokens.weight has 128 rows"),
    ({"num_hidden_layers": 3}, "num_hidden_layers is 3, the checkpoint holds 2 layers"),
    ({"hidden_size": 32}, "hidden_size is 32, the checkpoint's model.embed_tokens.weight has 64 columns"),
    ({"num_hidden_layers": -1}, "num_hidden_layers -1 is not a positive integer"),
    ({"vocab_size": "128"}, "vocab_size '128' is not a positive integer"),
])
def test_config_sizes_disagreeing_with_the_weights_are_refused_before_a_model_is_built(llama, tmp_path, change,
                                                                                        said):
    """An absurd config (a million layers, a vocabulary of 10**10) would have the export build that model."""
    folder = tmp_path / "ckpt"
    shutil.copytree(llama, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    start = time.perf_counter()
    _refused(tmp_path, ["export", folder, "-o", tmp_path / "out", "--task", "text-generation"],
             f"{folder / 'config.json'}: {said}")
    assert time.perf_counter() - start < 30


@pytest.mark.parametrize("model", [_llama, _gpt2, _bert])
def test_real_checkpoints_sizes_agree(tmp_path, model):
    """The check's names and keys on save_pretrained folders (Llama's embed_tokens and layers, GPT-2's wte,
    h and n_layer/n_embd, BERT's word_embeddings and layer): nothing refused."""
    from graphconv.frontend import hf_export

    torch.manual_seed(0)
    folder = _save(model(), tmp_path / "ckpt")
    raw = json.loads((folder / "config.json").read_text())
    hf_export._check_sizes(folder / "config.json", raw, hf_export._headers(hf_export._weight_files(folder)))
    layers = "n_layer" if "n_layer" in raw else "num_hidden_layers"
    with pytest.raises(InputError, match="the checkpoint holds 2 layers"):
        hf_export._check_sizes(folder / "config.json", {**raw, layers: 4},
                               hf_export._headers(hf_export._weight_files(folder)))


def test_a_layer_stack_run_in_cycles_counts_its_own_layers(tmp_path):
    """HRM (hrm_text): num_hidden_layers counts the layers applied (num_layers_per_stack x H_cycles x
    (L_cycles + 1)); the checkpoint holds num_layers_per_stack per stack. Before, the export refused the folder
    transformers itself saved."""
    import transformers

    from graphconv.frontend import hf_export

    config = transformers.HrmTextConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16,
                                        vocab_size=300, num_hidden_layers=2)
    assert (config.num_layers_per_stack, config.num_hidden_layers) == (2, 16)
    torch.manual_seed(0)
    folder = _save(transformers.HrmTextForCausalLM(config), tmp_path / "ckpt")
    raw = json.loads((folder / "config.json").read_text())
    hf_export._check_sizes(folder / "config.json", raw, hf_export._headers(hf_export._weight_files(folder)))
    with pytest.raises(InputError, match="num_hidden_layers is 16, the checkpoint holds 2 layers"):
        hf_export._check_sizes(folder / "config.json", {**raw, "num_layers_per_stack": 3},
                               hf_export._headers(hf_export._weight_files(folder)))


class _Unpickled:
    """Unpickling this makes the directory `marker`: proof that the file was unpickled."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_a_pickle_only_checkpoint_is_refused_and_never_unpickled(llama, tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    shutil.copy(llama / "config.json", folder)
    marker = tmp_path / "unpickled"
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(_Unpickled(marker)))
    _refused(tmp_path, ["export", folder, "-o", tmp_path / "out", "--task", "text-generation"],
             f"{folder}: no *.safetensors weights (pytorch_model.bin are not loaded: save with safe_serialization)")
    assert not marker.exists()


def test_symlinked_files_of_a_cache_snapshot_export(llama, tmp_path):
    """A Hugging Face cache snapshot of a checkpoint (config.json and model.safetensors symlinks to
    ../../blobs/<sha>) exports."""
    snapshot, blobs = tmp_path / "snapshots" / "abc", tmp_path / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for k, f in enumerate(sorted(llama.iterdir())):
        shutil.copy(f, blobs / f"sha{k}")
        (snapshot / f.name).symlink_to(f"../../blobs/sha{k}")
    out = tmp_path / "out"
    proc = _graphconv("export", snapshot, "-o", out, "--task", "text-generation", "-q")
    assert proc.returncode == 0, proc.stderr
    assert (out / "model.onnx").is_file()
