"""Every `graphconv compile` flag the generation-folder path accepts reaches each graph's compile, and every
other flag is refused there in one line. The CLI builds one CompileOptions; the folder's build derives each
graph's options from it, so a flag cannot be dropped on the way (it once was: --layer-streamed)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

from graphconv import cli, pipeline  # noqa: E402
from graphconv.errors import InputError  # noqa: E402


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    import torch

    from graphconv.frontend.hf_export import export_checkpoint

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("flags")
    tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1,
                                       max_position_embeddings=64)).save_pretrained(root / "ckpt")
    export_checkpoint(root / "ckpt", root / "exp", "text-generation-with-past")
    return root / "exp"


class _Stop(InputError):
    pass


def _first_graph_options(monkeypatch, capsys, args: list[str]):
    """The options of the first graph compile `graphconv compile ARGS` makes (it is stopped there)."""
    seen = []

    def record(path, options, progress=None):
        seen.append(options)
        raise _Stop("stopped after the options arrived")

    monkeypatch.setattr(pipeline, "compile_model", record)
    with pytest.raises(SystemExit) as ended:
        cli.main(["compile", *args])
    err = capsys.readouterr().err
    assert ended.value.code == 1, err
    return seen[0] if seen else None, err


def _npz(path: Path) -> Path:
    import numpy as np

    np.savez(path, input_ids=np.ones((1, 3), np.int64))
    return path


# flag(s) -> what the graph's CompileOptions must hold
REACHES = [
    (["--target", "cpu"], lambda o: o.target == "cpu"),
    (["--no-simplify"], lambda o: o.simplify is False),
    (["--no-verify"], lambda o: o.verify is False),
    (["--dim", "extra=3,4"], lambda o: o.dims["extra"] == (3, 4)),
    (["--mask-input", "attention_mask"], lambda o: o.mask_inputs == ("attention_mask",)),
    (["--precision", "fp16", "--keep-fp32", "Softmax"], lambda o: (o.precision, o.keep_fp32) == ("fp16", "Softmax")),
    (["--atol", "0.5", "--rtol", "0.25"], lambda o: (o.atol, o.rtol) == (0.5, 0.25)),
    (["--passes", "fuse-rmsnorm"], lambda o: o.passes == "fuse-rmsnorm"),
    (["--disable-pass", "fuse-rope"], lambda o: o.disable_passes == ("fuse-rope",)),
    (["--plugin", "json"], lambda o: o.plugins == ("json",)),
    (["--verify-each"], lambda o: o.verify_each is True),
    (["--layer-streamed"], lambda o: o.layer_streamed is True),
    (["--whole-network"], lambda o: o.layer_streamed is False),
    (["--soc", "Ascend910B3", "--cann", "8.0.0"], lambda o: (o.soc, o.cann) == ("Ascend910B3", "8.0.0")),
    (["--shape-range", "batch=1..4"], lambda o: o.shape_ranges["batch"] == (1, 4)),
    (["--max-batch", "3", "--max-seq-len", "40"], lambda o: o.cache_capacity == (3, 40)),
    (["--stateful-cache"], lambda o: o.cache_capacity is not None),
    (["--no-stateful-cache"], lambda o: o.cache_capacity is None),
    (["--quantize", "w4a16:32"], lambda o: o.quantize == "w4a16:32" and o.save_quantized.parent.name == "onnx"),
    (["--quantize", "w8a16"], lambda o: o.quantize == "w8a16" and o.calibration is None),
]


@pytest.mark.parametrize("flags, holds", REACHES, ids=[" ".join(f) for f, _ in REACHES])
def test_each_flag_reaches_the_graph_compile(export_dir, tmp_path, monkeypatch, capsys, flags, holds):
    options, err = _first_graph_options(monkeypatch, capsys, [str(export_dir), "-o", str(tmp_path / "gen"), *flags])
    assert options is not None, err
    assert holds(options), options
    assert not (tmp_path / "gen").exists()


def test_inputs_and_bundle_reach_the_graph_compile(export_dir, tmp_path, monkeypatch, capsys):
    npz = _npz(tmp_path / "d.npz")
    options, err = _first_graph_options(monkeypatch, capsys, [str(export_dir), "-o", str(tmp_path / "gen"),
                                                              "--inputs", f"decode={npz}",
                                                              "--bundle", str(tmp_path / "b")])
    assert options is not None, err
    assert options.inputs == (npz,) and options.bundle is not None and Path(options.bundle).name == "decode"


@pytest.mark.parametrize("flags, says", [
    (["--emit-source", "SRC"], "--emit-source"),
    (["--quantize", "w8a8", "--calibration", "C.npz"], "--quantize w8a8 takes one .onnx graph"),
    (["--save-fused", "F.onnx"], "--save-fused"),
])
def test_a_flag_the_folder_does_not_take_is_one_line(export_dir, tmp_path, monkeypatch, capsys, flags, says):
    flags = [str(tmp_path / f) if f.isupper() or f.endswith(".onnx") else f for f in flags]
    options, err = _first_graph_options(monkeypatch, capsys, [str(export_dir), "-o", str(tmp_path / "gen"), *flags])
    assert options is None and says in err and err.strip().count("\n") == 0, err
