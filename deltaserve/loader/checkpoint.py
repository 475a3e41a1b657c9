"""Reading safetensors checkpoints: one file or shards with model.safetensors.index.json, memory-mapped, lazily."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the tensor, the file and the shapes."""


class Checkpoint:
    """The tensors of a model folder, by name; a tensor is read (memory-mapped) only when asked for."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.file_of, files = _index(self.folder)  # tensor name -> file name
        self._handles: dict[str, object] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        for file in files:
            handle = self._open(file)
            for name in handle.keys():
                if self.file_of.get(name, file) != file:
                    raise CheckpointError(f"tensor {name} is in {file} but the index says {self.file_of[name]}; "
                                          "re-download the checkpoint or fix model.safetensors.index.json")
                self.file_of[name] = file
                self._shapes[name] = tuple(handle.get_slice(name).get_shape())
        missing = [n for n, f in self.file_of.items() if n not in self._shapes]
        if missing:
            raise CheckpointError(f"tensor {missing[0]} is listed in model.safetensors.index.json under "
                                  f"{self.file_of[missing[0]]} but that file does not contain it "
                                  f"({len(missing)} such tensors); re-download the checkpoint")

    def names(self) -> set[str]:
        return set(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def read(self, name: str) -> torch.Tensor:
        file = self.file_of[name]
        try:
            return self._handles[file].get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(f"cannot read tensor {name} from {self.folder / file}: {e}; "
                                  "the file is corrupt or truncated, re-download it") from e

    def _open(self, file: str):
        path = self.folder / file
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing; model.safetensors.index.json lists it")
        try:
            handle = safe_open(str(path), framework="pt")
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{path} is not a readable safetensors file ({e}); re-download it") from e
        self._handles[file] = handle
        return handle


def _index(folder: Path) -> tuple[dict[str, str], list[str]]:
    """(tensor name -> file from model.safetensors.index.json, or {} without one; the files to open)."""
    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path} is not a valid index (needs a JSON object with 'weight_map'): "
                                  f"{e}; re-download it") from e
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index_path}: 'weight_map' must map tensor names to file names")
        return dict(weight_map), sorted(set(weight_map.values()))
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {folder}; pass a model folder with weights, "
                              "or --load-format dummy for random weights")
    return {}, files
