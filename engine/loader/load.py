"""Copy named tensors into a module, and tell a model path's kind (GGUF file or HF directory)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, NamedTuple

import gguf
import torch

from engine.config import ModelArchConfig
from engine.errors import ModelLoadError, WeightsMismatchError
from engine.loader.gguf_loader import gguf_weight_types, iter_gguf_weights, open_gguf, read_gguf_arch
from engine.loader.hf_loader import iter_hf_weights, read_hf_arch
from engine.models import hf_weights_mapper

ModelFileKind = Literal["gguf", "hf"]
WeightsIterFactory = Callable[[torch.dtype], Iterator[tuple[str, torch.Tensor]]]

_MAX_NAMES_LISTED = 20  # per kind of problem; the count says how many more


class ModelFiles(NamedTuple):
    arch: ModelArchConfig
    iter_weights: WeightsIterFactory  # call with the compute dtype; each call reads the files afresh
    kind: ModelFileKind
    weight_types: dict[str, str]  # HF weight name → GGML type for GGUF files; empty for HF dirs
    # The parsed GGUF file, for its tokenizer: a second reader of SmolLM2's held 158 MB more at load.
    gguf_reader: gguf.GGUFReader | None = None


@dataclass
class _LoadProblems:
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mis_shaped: list[str] = field(default_factory=list)  # "name: expected [..], got [..]"

    def describe(self) -> str:
        parts = []
        kinds = (("missing", self.missing), ("unexpected", self.unexpected), ("mis-shaped", self.mis_shaped))
        for label, names in kinds:
            if names:
                listed = ", ".join(sorted(names)[:_MAX_NAMES_LISTED])
                more = f" (+{len(names) - _MAX_NAMES_LISTED} more)" if len(names) > _MAX_NAMES_LISTED else ""
                parts.append(f"{len(names)} {label}: {listed}{more}")
        return "; ".join(parts)


def load_weights(module: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy each (name, tensor) into the module's state_dict entry of that name, converting dtype/device.

    A name is satisfied when it, or any name sharing the same Parameter (tied embeddings: lm_head.weight
    *is* model.embed_tokens.weight), was loaded. Problems are all collected, then raised as one
    WeightsMismatchError; the module may be partly loaded then.
    """
    targets = module.state_dict()
    aliases = _tied_aliases(module)
    loaded: set[str] = set()
    problems = _LoadProblems()
    with torch.no_grad():
        for name, tensor in weights:
            target = targets.get(name)
            if target is None:
                problems.unexpected.append(name)
            elif target.shape != tensor.shape:
                problems.mis_shaped.append(f"{name}: expected {list(target.shape)}, got {list(tensor.shape)}")
                loaded.add(name)  # reported as mis-shaped, not also as missing
            else:
                target.copy_(tensor)
                loaded.add(name)
    problems.missing = [n for n in targets if n not in loaded and not (aliases.get(n, set()) & loaded)]
    if problems.missing or problems.unexpected or problems.mis_shaped:
        raise WeightsMismatchError(f"checkpoint does not match {type(module).__name__}: {problems.describe()}")


def materialize(module: torch.nn.Module, dtype: torch.dtype, keep_on_meta: Collection[str] = ()) -> None:
    """Give a module built on the meta device uninitialized CPU storage in `dtype`, in place. A
    Parameter registered under several names (tied embeddings) stays one Parameter: to_empty makes
    each module's anew. Parameters named in `keep_on_meta` (or tied to one named there) stay on the meta
    device: no storage, and loading into them does nothing (weights kept only in a packed form)."""
    aliases = _tied_aliases(module)
    module.to(dtype)
    # What module.to_empty(device="cpu") does, but through torch.empty: to_empty's empty_like on a meta
    # tensor runs a decomposition that imports sympy (+35 MB resident for the server's lifetime).
    for sub in module.modules():
        for name, param in list(sub.named_parameters(recurse=False)):
            setattr(sub, name, torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="cpu"),
                                                  requires_grad=param.requires_grad))
        for name, buffer in list(sub.named_buffers(recurse=False)):
            if buffer is not None:
                setattr(sub, name, torch.empty(buffer.shape, dtype=buffer.dtype, device="cpu"))
    for name, others in aliases.items():
        shared = module.get_parameter(name)
        for other in others:
            owner, _, attr = other.rpartition(".")
            setattr(module.get_submodule(owner), attr, shared)
    params = dict(module.named_parameters(remove_duplicate=False))
    for name in keep_on_meta:
        if name not in params:
            continue
        source = params[name]
        held = torch.nn.Parameter(torch.empty(source.shape, dtype=source.dtype, device="meta"),
                                  requires_grad=source.requires_grad)
        for tied in {name, *aliases.get(name, ())}:
            owner, _, attr = tied.rpartition(".")
            setattr(module.get_submodule(owner), attr, held)


def load_model_files(path: str | Path) -> ModelFiles:
    """Tell a GGUF file from an HF directory and read its architecture; weights are read when iterated."""
    path = Path(path)
    if path.is_file():
        reader = open_gguf(path)
        arch = read_gguf_arch(reader)
        return ModelFiles(arch, lambda dtype: iter_gguf_weights(reader, arch, dtype), "gguf", gguf_weight_types(reader),
                          reader)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path}: a directory without config.json is not a Hugging Face model")
        arch = read_hf_arch(path)
        mapper = hf_weights_mapper(arch)
        return ModelFiles(arch, lambda dtype: iter_hf_weights(path, dtype, mapper), "hf", {})
    raise ModelLoadError(f"{path}: no such file or directory")


def _tied_aliases(module: torch.nn.Module) -> dict[str, set[str]]:
    """name → the other names of the same Parameter, for every Parameter registered under several names."""
    names_by_param: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names_by_param.setdefault(id(param), []).append(name)
    return {n: set(names) - {n} for names in names_by_param.values() if len(names) > 1 for n in names}
