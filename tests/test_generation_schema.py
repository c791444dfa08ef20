"""generation.json's schema (graphconv/generation/schema.py): one writer that stamps the version and refuses a
field the schema does not declare, and a reader that names in one line what an old folder lacks."""

from __future__ import annotations

import json

import pytest

from graphconv.errors import InputError, InternalError
from graphconv.generation import schema

STEP = {"inputs": {"input_ids": ["b", "s"], "attention_mask": ["b", "t"]}, "outputs": {"logits": ["b", "s", 8]}}


def test_the_writer_stamps_the_version_and_the_reader_reads_it_back(tmp_path):
    meta = {"task": schema.TASK, "vocab_size": 8, "graphs": {"prefill": STEP, "decode": {**STEP, "state": {
        "max_batch": 2, "max_seq_len": 16, "inputs": ["input_ids"], "outputs": ["logits"], "params": {}}}}}
    schema.write(tmp_path / schema.FILE, meta)
    assert json.loads((tmp_path / schema.FILE).read_text())["schema_version"] == schema.SCHEMA_VERSION
    assert schema.read(tmp_path) == {**meta, "schema_version": schema.SCHEMA_VERSION}


@pytest.mark.parametrize("meta, says", [
    ({"task": schema.TASK, "graphs": {}, "vocab": 8}, "fields outside the schema (vocab)"),
    ({"task": schema.TASK, "graphs": {"decode": {**STEP, "mindirs": "x"}}}, "graphs.decode.mindirs"),
    ({"task": schema.TASK, "graphs": {"decode": {**STEP, "state": {"max_rows": 2}}}}, "graphs.decode.state.max_rows"),
    ({"graphs": {}}, "task and graphs are required"),
])
def test_the_writer_refuses_what_the_schema_does_not_declare(tmp_path, meta, says):
    with pytest.raises(InternalError, match=says.replace("(", r"\(").replace(")", r"\)")):
        schema.write(tmp_path / schema.FILE, meta)
    assert not (tmp_path / schema.FILE).exists()


def test_the_reader_names_every_field_an_old_folder_lacks(tmp_path):
    (tmp_path / schema.FILE).write_text(json.dumps({"task": schema.TASK, "graphs": {
        "prefill": {"inputs": STEP["inputs"]}, "decode": {"outputs": STEP["outputs"]}}}))
    with pytest.raises(InputError) as e:
        schema.read(tmp_path)
    message = str(e.value)
    assert "lacks graphs.prefill.outputs, graphs.decode.inputs (schema version 0;" in message
    assert "\n" not in message
    assert schema.lacking({"task": schema.TASK}) == ["graphs"]
    assert schema.lacking({"graphs": {"decode": {}}}, compiled=False) == []


def test_the_reader_refuses_a_newer_version_and_another_task(tmp_path):
    (tmp_path / schema.FILE).write_text(json.dumps({"schema_version": schema.SCHEMA_VERSION + 1}))
    with pytest.raises(InputError, match="written by a newer graphconv"):
        schema.read(tmp_path)
    (tmp_path / schema.FILE).write_text(json.dumps({"task": "text-generation", "graphs": {}}))
    with pytest.raises(InputError, match="is not text-generation-with-past"):
        schema.read(tmp_path)


def test_every_producer_writes_through_the_one_writer():
    """No module but the schema writes generation.json itself (a json.dumps next to the file's name)."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "graphconv"
    writers = [p.relative_to(root).as_posix() for p in root.rglob("*.py")
               if any("generation.json" in line and "write_text" in line for line in p.read_text().splitlines())
               or "schema.FILE).write_text" in p.read_text()]
    assert writers == [], writers
