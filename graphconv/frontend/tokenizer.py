"""The tokenizer a generation folder carries, for `graphconv generate --prompt`: the checkpoint's tokenizer
files, copied by the export into EXPORT_DIR/tokenizer/ and by the compile into GEN_DIR/tokenizer/ (an
onnxruntime-genai builder folder keeps them at its top), loaded with transformers' AutoTokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path

from graphconv.errors import InputError, first_line

# What AutoTokenizer.save_pretrained writes, for the tokenizer kinds transformers has
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
         "merges.txt", "vocab.txt", "added_tokens.json", "chat_template.jinja")


def copy(source: Path, target: Path) -> bool:
    """The tokenizer files of folder `source` into the new folder `target`; False where there are none."""
    found = [source / f for f in FILES if (source / f).is_file()]
    if not found:
        return False
    target.mkdir()
    for f in found:
        shutil.copyfile(f, target / f.name)
    return True


def load(gen_dir: Path, generation: dict):
    """The folder's tokenizer (transformers' AutoTokenizer), or a one-line error saying why there is none."""
    if not generation.get("tokenizer") or not (gen_dir / generation["tokenizer"]).is_dir():
        raise InputError(f"{gen_dir}: no tokenizer (the checkpoint folder had no tokenizer files when exported); "
                         "give token ids with --input-ids")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise InputError("--prompt needs transformers: pip install -e '.[torch]'") from None
    try:
        return AutoTokenizer.from_pretrained(str(gen_dir / generation["tokenizer"]), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers' own refusal, reported in one line
        first = first_line(e)
        raise InputError(f"{gen_dir / generation['tokenizer']}: transformers cannot load the tokenizer "
                         f"({first[:200]})") from None
