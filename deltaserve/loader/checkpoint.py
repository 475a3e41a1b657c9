"""Reading safetensors checkpoints: one file or shards with model.safetensors.index.json, memory-mapped, lazily."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

INDEX_FILE = "model.safetensors.index.json"
# the header dtypes a weight may have: floats (copy_ would cast integers and bools into plausible-looking weights),
# and float8_e4m3fn, which loader/fp8.py accepts only beside its block scales
WEIGHT_DTYPES = ("F16", "BF16", "F32", "F64", "F8_E4M3")
_REFETCH = "re-download the checkpoint or re-convert it with float weights"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the tensor, the file and the shapes."""


class Checkpoint:
    """The tensors of a model folder, by name; a tensor is read (memory-mapped) only when asked for."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.file_of, files, self.indexed = _index(self.folder)  # tensor name -> file name
        self._handles: dict[str, object] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        for file in files:
            handle = self._open(file)
            for name in handle.keys():
                self._check_file(name, file)
                self.file_of[name] = file
                tensor = handle.get_slice(name)
                self._shapes[name] = tuple(tensor.get_shape())
                if tensor.get_dtype() not in WEIGHT_DTYPES:
                    raise CheckpointError(f"tensor {name} in {self.folder / file} is {tensor.get_dtype()}; weights "
                                          "must be F16, BF16, F32 or F64 (or F8_E4M3 with block scales): the file is "
                                          f"damaged or was converted wrongly; {_REFETCH}")
        missing = [n for n, f in self.file_of.items() if n not in self._shapes]
        if missing:
            raise CheckpointError(f"tensor {missing[0]} is listed in {INDEX_FILE} under "
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

    def check_finite(self, names: list[str], param: str, dtype: torch.dtype) -> None:
        """Raise for the first of names (the tensors parameter `param` was filled from, found not finite) that holds
        NaN or Inf; none does: their values overflow dtype."""
        for name in names:
            if not all_finite(self.read(name)):
                raise CheckpointError(f"tensor {name} in {self.folder / self.file_of[name]} holds NaN or Inf values "
                                      f"(flipped bits: every token would come out as id 0); {_REFETCH}")
        raise CheckpointError(f"tensor {names[0]} in {self.folder / self.file_of[names[0]]} (for parameter {param}) "
                              f"has values beyond the range of {dtype}; run in a wider dtype or re-convert the "
                              "checkpoint")

    def _check_file(self, name: str, file: str) -> None:
        """A tensor is in one file only: the one the index names, or (without an index) the first that has it."""
        other = self.file_of.get(name, file)
        if other == file:
            return
        if self.indexed:
            raise CheckpointError(f"tensor {name} is in {file} but the index says {other}; "
                                  f"re-download the checkpoint or fix {INDEX_FILE}")
        raise CheckpointError(f"tensor {name} is in both {other} and {file} in {self.folder} (no {INDEX_FILE} says "
                              "which to use); remove the stray file")

    def _open(self, file: str):
        path = self.folder / file
        if path.is_symlink() and not path.exists():
            raise CheckpointError(f"checkpoint file {path} is a broken symlink (to {os.readlink(path)}); "
                                  "re-download the checkpoint or fix the link")
        if path.exists() and not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is not a regular file; remove it or put the weights there")
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing; {INDEX_FILE} lists it")
        try:
            handle = safe_open(str(path), framework="pt")
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{path} is not a readable safetensors file ({e}); re-download it") from e
        self._handles[file] = handle
        return handle


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or Inf. aminmax (which propagates NaN) reads the tensor once, without the bool temporary of
    isfinite(t).all() (on the CPU, 20 times slower). float8_e4m3fn has no Inf; its NaNs are the bytes S1111111."""
    if tensor.numel() == 0:
        return True
    if tensor.dtype == torch.float8_e4m3fn:
        return bool((tensor.view(torch.uint8) & 0x7F).amax() != 0x7F)
    low, high = torch.stack(torch.aminmax(tensor)).tolist()  # one copy to the host (a GPU's: one sync)
    return math.isfinite(low) and math.isfinite(high)


def _index(folder: Path) -> tuple[dict[str, str], list[str], bool]:
    """(tensor name -> file from model.safetensors.index.json, or {} without one; the files to open; whether the
    folder has an index)."""
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path} is not a valid index (needs a JSON object with 'weight_map'): "
                                  f"{e}; re-download it") from e
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index_path}: 'weight_map' must map tensor names to file names")
        outside = next((f for f in weight_map.values() if not _inside(f)), None)
        if outside is not None:
            raise CheckpointError(f"{index_path}: 'weight_map' names the file {outside!r}, outside the model folder; "
                                  "it must name files in the folder (model-00001-of-00002.safetensors); fix the index")
        return dict(weight_map), sorted(set(weight_map.values())), True
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {folder}; pass a model folder with weights, "
                              "or --load-format dummy for random weights")
    return {}, files, False


def _inside(file: str) -> bool:
    """Whether a weight_map file name stays in the folder, by its spelling alone (the file itself may be a link out
    of it, as in the Hugging Face cache, whose snapshots link to blobs)."""
    normal = os.path.normpath(file)
    return bool(file) and not os.path.isabs(file) and normal != ".." and not normal.startswith(".." + os.sep)
