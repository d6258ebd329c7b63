"""A model's identity (evaluation/identity.py): the same files give the same digests in any
directory; a changed expert CRC, adapter or heads file changes the part it belongs to."""

from __future__ import annotations

import json
import shutil

from edge0_eval.engine.options import EngineOptions
from edge0_eval.evaluation.identity import model_identity


def test_identity_follows_the_files_not_the_directory(edge0_qwen, tiny_qwen, tmp_path):
    student = tmp_path / "a" / "student"
    shutil.copytree(edge0_qwen, student)
    (student / "lora.safetensors").write_bytes(b"adapter v1")
    reactive = EngineOptions(mode="reactive")
    first = model_identity(str(student), reactive)
    assert (
        first["lora"] is not None
        and first["prerouter"] is None
        and first["hedge"] is None
    )
    assert model_identity(str(student), EngineOptions(no_lora=True))["lora"] is None

    elsewhere = tmp_path / "b" / "student"  # another machine, another path
    shutil.copytree(student, elsewhere)
    assert model_identity(str(elsewhere), reactive) == first

    (elsewhere / "lora.safetensors").write_bytes(b"adapter v2")
    changed = model_identity(str(elsewhere), reactive)
    assert changed["lora"] != first["lora"] and changed["weights"] == first["weights"]

    index = json.loads((elsewhere / "experts.index.json").read_text())
    index["crc32"][0][0] ^= 1  # one expert bundle's checksum
    (elsewhere / "experts.index.json").write_text(json.dumps(index))
    assert model_identity(str(elsewhere), reactive)["weights"] != first["weights"]

    heads = tmp_path / "heads.safetensors"
    heads.write_bytes(b"heads")
    prerouted = EngineOptions(mode="prerouted", prerouter_path=str(heads))
    assert model_identity(str(student), prerouted)["prerouter"] is not None

    teacher = model_identity(str(tiny_qwen))
    assert set(teacher) == {"weights"} and teacher["weights"] != first["weights"]
