"""Weight files: every unreadable, corrupt or foreign file is a ValueError that names the file; no
dtype is cast silently; files are written atomically with the usual permissions."""

from __future__ import annotations

import json
import os
import stat

import numpy as np
import pytest

pytest.importorskip("safetensors")
from safetensors.numpy import save_file  # noqa: E402

from gdn2.weights import CONFIG_KEY, ModelConfig, check_names, load_numpy, save_numpy, write_atomically  # noqa: E402

CONFIG = ModelConfig(vocab_size=16, hidden_size=8, num_layers=1, num_heads=2, head_dim=4, chunk_size=4)


def small_file(path, dtype=np.float32, config=CONFIG):
    arrays = {"a.weight": np.arange(12, dtype=np.float32).reshape(3, 4).astype(dtype), "b.bias": np.ones(5, dtype)}
    if dtype == np.float32:
        save_numpy(arrays, path, config)
    else:
        save_file(arrays, str(path), metadata={"format": "gdn2", CONFIG_KEY: config.to_json()})
    return arrays


def test_round_trip(tmp_path):
    arrays = small_file(tmp_path / "m.safetensors")
    loaded, config = load_numpy(tmp_path / "m.safetensors")
    assert config == CONFIG and set(loaded) == set(arrays)
    for name in arrays:
        np.testing.assert_array_equal(loaded[name], arrays[name])


@pytest.mark.parametrize("keep", ["5 bytes", "half", "all but 3 bytes"])
def test_truncated_file_names_the_file(tmp_path, keep):
    path = tmp_path / "m.safetensors"
    small_file(path)
    data = path.read_bytes()
    cut = {"5 bytes": 5, "half": len(data) // 2, "all but 3 bytes": len(data) - 3}[keep]
    path.write_bytes(data[:cut])
    with pytest.raises(ValueError) as error:
        load_numpy(path)
    assert str(error.value).startswith(f"path: {path} is not a readable safetensors file (truncated or corrupt?)")


def test_garbage_file_names_the_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("this is not a weight file\n" * 20)
    with pytest.raises(ValueError, match=f"path: {path} is not a readable safetensors file"):
        load_numpy(path)


def test_directory_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match=f"path: expected a safetensors file, received a directory: {tmp_path}"):
        load_numpy(tmp_path)
    with pytest.raises(FileNotFoundError, match=f"path: no such file: {tmp_path / 'nope.safetensors'}"):
        load_numpy(tmp_path / "nope.safetensors")


def test_corrupt_config_names_the_file_and_the_json_error(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"a": np.zeros(2, np.float32)}, str(path), metadata={CONFIG_KEY: '{"vocab_size": 16,'})
    with pytest.raises(ValueError) as error:
        load_numpy(path)
    message = str(error.value)
    assert message.startswith(f"path: {path}: the model config (metadata '{CONFIG_KEY}') is unusable: config: expected JSON")
    assert "Expecting property name enclosed in double quotes: line 1 column 19" in message


@pytest.mark.parametrize("text, expected", [
    ('[1, 2]', "config: expected a JSON object of ModelConfig fields, received list"),
    ('{"vocab_size": 16, "hidden_sise": 8}', "received unknown ['hidden_sise']"),
    ('{"vocab_size": 0}', "vocab_size: expected an integer >= 1, received 0"),
    ('{"vocab_size": "16"}', "vocab_size: expected an integer >= 1, received '16'"),
])
def test_config_that_is_not_a_model_config(tmp_path, text, expected):
    path = tmp_path / "m.safetensors"
    save_file({"a": np.zeros(2, np.float32)}, str(path), metadata={CONFIG_KEY: text})
    with pytest.raises(ValueError) as error:
        load_numpy(path)
    assert str(error.value).startswith(f"path: {path}: the model config") and expected in str(error.value)


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_tensors_of_another_dtype_are_not_cast(tmp_path, dtype):
    path = tmp_path / "m.safetensors"
    small_file(path, dtype)
    name = np.dtype(dtype).name
    with pytest.raises(ValueError, match=rf"path: {path}: tensor a.weight has dtype {name}, expected float32"):
        load_numpy(path)
    with pytest.raises(ValueError, match=rf"arrays: expected float32 arrays \(the gdn2 weight format\), received a.weight: {name}"):
        save_numpy({"a.weight": np.zeros(3, dtype)}, tmp_path / "other.safetensors")
    with pytest.raises(ValueError, match=rf"wrong dtypes: a.weight: expected float32, received {name}"):
        check_names({"a.weight": (3,)}, {"a.weight": np.zeros(3, dtype)}, "weights")


@pytest.mark.parametrize("framework", ["torch", "mlx"])
def test_models_refuse_weights_of_another_dtype(framework, tmp_path):
    layer = pytest.importorskip(f"gdn2.{framework}.layer")
    model = layer.GDN2LanguageModel(CONFIG)
    weights = {name: a.astype(np.float64) for name, a in layer.numpy_weights(model).items()}
    with pytest.raises(ValueError, match=r"weights: weights do not match the model: wrong dtypes: .*expected float32, received float64"):
        layer.set_numpy_weights(model, weights)
    path = tmp_path / "m.safetensors"
    layer.save_weights(model, path)
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(ValueError, match=f"path: {path} is not a readable safetensors file"):
        layer.load_model(path)


def test_saved_file_has_the_permissions_of_its_siblings(tmp_path):
    path = tmp_path / "m.safetensors"
    small_file(path)
    sibling = tmp_path / "loss.csv"
    sibling.write_text("step\n")
    assert stat.S_IMODE(path.stat().st_mode) == stat.S_IMODE(sibling.stat().st_mode)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_a_failing_write_leaves_the_old_file_whole(tmp_path):
    path = tmp_path / "m.safetensors"
    small_file(path)
    before = path.read_bytes()

    def write_half_then_fail(temporary):
        with open(temporary, "wb") as handle:
            handle.write(before[: len(before) // 2])
        raise KeyboardInterrupt  # interrupted mid-write

    with pytest.raises(KeyboardInterrupt):
        write_atomically(path, write_half_then_fail)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors"]


def test_save_numpy_replaces_through_a_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "m.safetensors"
    replaced = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (replaced.append((str(a), str(b))), real(a, b))[1])
    small_file(path)
    assert len(replaced) == 1 and replaced[0][1] == str(path)
    assert os.path.dirname(replaced[0][0]) == str(tmp_path) and replaced[0][0] != str(path)
    json.loads(load_numpy(path)[1].to_json())
