"""The quantized checkpoint fixtures (tests/fixtures/quant), and edited copies of them for the
bad-input tests."""

import json
import shutil

from safetensors.numpy import load_file, save_file
from testpaths import FIXTURES

QUANT = FIXTURES / "quant"


def edited_copy(tmp_path, name, edit_config=None, edit_tensors=None):
    """A copy of fixture `name` under tmp_path (a new directory each call), its
    quantization_config and tensors passed through the edits."""
    target = tmp_path / f"{name}-{len(list(tmp_path.iterdir()))}"
    shutil.copytree(QUANT / name, target)
    if edit_config:
        config = json.loads((target / "config.json").read_text())
        edit_config(config["quantization_config"])
        (target / "config.json").write_text(json.dumps(config))
    if edit_tensors:
        tensors = load_file(target / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, target / "model.safetensors")
    return target
