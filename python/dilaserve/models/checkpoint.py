"""Reading and writing HF-format checkpoint directories.

A directory holds `config.json` and either `model.safetensors` or shards listed by
`model.safetensors.index.json`, under the tensor names of the model's own family (LLaDA
or Dream), so released checkpoints load unmodified. Every inconsistency is reported as a
`CheckpointError` naming the file at fault, before any tensor data is read.

A tensor-parallel rank reads only its slices: split tensors are read through safetensors'
slice view of the memory map, so no rank ever holds a full copy of a split weight.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import Family, ModelConfig, check_token_ids
from .dream import DREAM
from .errors import CheckpointError
from .llada import LLADA
from .llada2 import LLADA2
from .model import DiffusionLM
from .parallel import Collective, Shard, check_degree, fused_segments, split_dim
from .sdar import SDAR
from .stop_tokens import read_stop_token_ids

FAMILIES: dict[str, Family] = {family.name: family for family in (LLADA, DREAM, LLADA2, SDAR)}
CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported model dtype {dtype}; use float32, bfloat16 or float16")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown model dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def read_json(path: Path) -> Any:
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc


def read_config(directory: str | Path) -> tuple[Family, ModelConfig]:
    """The family and parsed configuration of the checkpoint in `directory`."""
    source = Path(directory) / CONFIG_FILE
    raw = read_json(source)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{source}: expected a JSON object")
    for family in FAMILIES.values():
        if family.matches(raw):
            config = family.parse(raw, source)
            check_token_ids(config, source)
            stops = read_stop_token_ids(Path(directory), config)
            return family, dataclasses.replace(config, stop_token_ids=stops)
    raise CheckpointError(
        f"{source}: unknown model family (model_type={raw.get('model_type')!r}, "
        f"architectures={raw.get('architectures')!r}); supported: {sorted(FAMILIES)}"
    )


def weight_files(directory: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> the safetensors file said to hold it."""
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no 'weight_map' object")
        files = {name: directory / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise CheckpointError(f"{shard}: shard named in {index.name} not found")
        return files
    single = directory / SINGLE_FILE
    if not single.is_file():
        raise CheckpointError(
            f"{single}: no weights found (neither {SINGLE_FILE} nor {INDEX_FILE})"
        )
    with _open(single) as handle:
        return {name: single for name in handle.keys()}  # noqa: SIM118 (not a dict)


def _open(path: Path) -> Any:
    try:
        return safe_open(path, framework="pt", device="cpu")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: unreadable safetensors file ({exc})") from exc


def load_model(
    path: str | Path,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    *,
    group: Collective | None = None,
) -> DiffusionLM:
    """Builds the model of the checkpoint directory `path` in `dtype` on `device`, in eval
    mode and without gradients; with a tensor-parallel `group`, this rank's shard of it
    (`UnsupportedDegreeError` if the model does not split that many ways)."""
    directory = Path(path)
    target = resolve_dtype(dtype)
    family, config = read_config(directory)
    shard = Shard.of(group)
    check_degree(config, shard.world_size, directory / CONFIG_FILE)
    with torch.device("meta"):
        model = DiffusionLM(config, group)
    expected = {
        family.checkpoint_name(name): _Expected(
            name, tuple(t.shape), shard, fused_segments(name, config)
        )
        for name, t in model.state_dict().items()
    }
    files = weight_files(directory)
    missing = sorted(set(expected) - set(files))
    if missing:
        source = directory / (INDEX_FILE if (directory / INDEX_FILE).is_file() else SINGLE_FILE)
        raise CheckpointError(f"{source}: missing tensors {_names(missing)}")
    unexpected = sorted(set(files) - set(expected))
    if unexpected:
        raise CheckpointError(
            f"{files[unexpected[0]]}: unexpected tensors {_names(unexpected)} for {family.name}"
        )
    state = dict(_read_tensors(files, expected, torch.device(device), target))
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def _names(names: list[str], shown: int = 5) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(repr(n) for n in names[:shown]) + more


class _Expected:
    """One tensor this process loads: our name, the shape of its part, and the slice of the
    checkpoint tensor that is that part."""

    def __init__(
        self,
        name: str,
        local_shape: tuple[int, ...],
        shard: Shard,
        segments: tuple[int, ...] | None = None,
    ) -> None:
        self.name = name
        self.dim = split_dim(name) if shard.world_size > 1 else None
        full = list(local_shape)
        if self.dim is not None:
            full[self.dim] *= shard.world_size
        self.shape = tuple(full)
        # (start, stop) per part along `dim`: the rank's share of each segment of a fused
        # tensor, else its one contiguous range.
        self.ranges: list[tuple[int, int]] = []
        if self.dim is not None:
            at = 0
            for size in segments or (full[self.dim],):
                start, stop = shard.range(size)
                self.ranges.append((at + start, at + stop))
                at += size

    def read(self, handle: Any, checkpoint_name: str) -> torch.Tensor:
        if not self.ranges:
            return handle.get_tensor(checkpoint_name)
        view = handle.get_slice(checkpoint_name)
        parts = [view[a:b] if self.dim == 0 else view[:, a:b] for a, b in self.ranges]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)


def _read_tensors(
    files: dict[str, Path],
    expected: dict[str, _Expected],
    device: torch.device,
    dtype: torch.dtype,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(our name, tensor) for every expected tensor, shapes checked before data is read."""
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    with ExitStack() as stack:
        # Read through CPU memory maps, whatever the target device: the copy to the
        # device happens tensor by tensor, fused with the dtype conversion.
        handles = {file: stack.enter_context(_open(file)) for file in by_file}
        for file, names in by_file.items():
            present = set(handles[file].keys())
            for name in names:
                if name not in present:
                    raise CheckpointError(f"{file}: missing tensor {name!r}")
                shape = tuple(handles[file].get_slice(name).get_shape())
                if shape != expected[name].shape:
                    raise CheckpointError(
                        f"{file}: tensor {name!r} has shape {list(shape)}, "
                        f"expected {list(expected[name].shape)}"
                    )
        for file, names in by_file.items():
            for name in names:
                tensor = expected[name].read(handles[file], name)
                yield expected[name].name, tensor.to(device=device, dtype=dtype)


def save_checkpoint(
    model: DiffusionLM, path: str | Path, *, max_shard_bytes: int | None = None
) -> list[Path]:
    """Writes `config.json` and the weights (in the model's dtype, under the family's
    tensor names) to directory `path`; more than `max_shard_bytes` of weights go to
    numbered shards plus an index. Returns the weight files written."""
    if model.group is not None:
        raise ValueError("a tensor-parallel shard cannot be saved as a checkpoint")
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    family = FAMILIES[model.config.family]
    tensors = {
        family.checkpoint_name(name): t.detach().to("cpu").contiguous()
        for name, t in model.state_dict().items()
    }
    (directory / CONFIG_FILE).write_text(json.dumps(model.config.raw, indent=2) + "\n")
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(tensors, directory / SINGLE_FILE, metadata={"format": "pt"})
        return [directory / SINGLE_FILE]
    shards = _split(tensors, max_shard_bytes)
    paths = [
        directory / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        for i in range(len(shards))
    ]
    weight_map = {}
    for shard, shard_path in zip(shards, paths, strict=True):
        save_file(shard, shard_path, metadata={"format": "pt"})
        weight_map.update({name: shard_path.name for name in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return paths


def _split(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive groups of at most `max_bytes` (a larger tensor gets a shard of its own)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and used + size > max_bytes:
            shards.append({})
            used = 0
        shards[-1][name] = tensor
        used += size
    return shards
