"""Export a trained checkpoint to a Hugging Face model directory (``save_pretrained`` + tokenizer files).

The FP32 master weights are consolidated into one state dict: ZeRO-1/2/3 shards with DeepSpeed's own
``zero_to_fp32``; the partitions of DeepSpeed's BF16 optimizer (what bf16 with ZeRO stage 1 runs) by their
``param_slice_mappings``, which ``zero_to_fp32`` does not read. The model is rebuilt from the spec stored
in the checkpoint, and the tokenizer is written from the very file the run trained with (checked against
the hash the checkpoint recorded), so ``AutoTokenizer`` on the export gives the ids the shards hold.
``python -m training export CKPT --out DIR``.

A family from outside the package (``model.families`` at training time) is registered from the modules the
caller names (``--families``), never from those the checkpoint's config lists: importing a module is running its
code, and a checkpoint may come from anyone. The refusal names them, so the user decides.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from common.atomic import atomic_path
from common.errors import UserError
from data.tokenizer import vocab_sha256
from model.build import build_model, tied_names
from model.registry import FAMILIES, ModelSpec, family_of, load_families, spec_from_dict
from training.checkpoint import storage as ckpt
from training.checkpoint.safeload import refusing, restricted


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _make_readable(root: Path) -> None:
    """Files 0666 and directories 0777 less the umask (``save_pretrained`` writes its weights 0600)."""
    mask = _umask()
    os.chmod(root, 0o777 & ~mask)
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            os.chmod(os.path.join(dirpath, d), 0o777 & ~mask)
        for f in filenames:
            os.chmod(os.path.join(dirpath, f), 0o666 & ~mask)


def _fragments_state(files: list[Path], shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Parameters from the FP32 partitions of DeepSpeed's BF16 optimizer, rank files given in rank order."""
    pieces: dict[str, list[torch.Tensor]] = {}
    for f in files:
        osd = torch.load(f, map_location="cpu", weights_only=True)["optimizer_state_dict"]
        for flat, mapping in zip(osd["single_partition_of_fp32_groups"], osd["param_slice_mappings"]):
            for name, fragment in mapping.items():  # a parameter split across ranks has one fragment per rank
                pieces.setdefault(name, []).append(flat.narrow(0, fragment.start, fragment.numel))
    state = {}
    for name, shape in shapes.items():
        whole = torch.cat(pieces.get(name, []))
        if whole.numel() != shape.numel():
            raise UserError(
                f"{files[0].parent}: optimizer partitions hold {whole.numel()} of {name}'s "
                f"{shape.numel()} values (are all ranks' files there?)"
            )
        state[name] = whole.view(shape).clone()
    return state


def consolidated_state(ckpt_dir: Path, tag: str) -> dict[str, torch.Tensor]:
    """The checkpoint's FP32 weights (master weights where the run kept them), whole, on the CPU; every load
    weights-only (``training.checkpoint.safeload``), DeepSpeed's included, also when called as a library."""
    with restricted():
        return _consolidated_state(ckpt_dir, tag)


def _consolidated_state(ckpt_dir: Path, tag: str) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # deferred: seconds

    folder = ckpt_dir / tag
    rank_of = {
        f: int(m.group(1))
        for f in folder.glob("*optim_states.pt")
        if (m := re.search(r"_zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$", f.name))
    }
    files = sorted(rank_of, key=rank_of.__getitem__)
    first = {}
    if files:
        first = torch.load(files[0], map_location="cpu", weights_only=True)["optimizer_state_dict"]
    if "zero_stage" in first:
        return get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
    model_states = torch.load(folder / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=True)
    if "param_slice_mappings" in first:
        shapes = {k: v for group in model_states["param_shapes"] for k, v in group.items()}
        state = _fragments_state(files, shapes)
        buffers = set(model_states.get("buffer_names") or ())
        state.update({k: v.float() for k, v in model_states["module"].items() if k in buffers})
        return state
    module = model_states["module"]  # no partitioned optimizer: the module itself holds the weights
    low = sorted(k for k, v in module.items() if v.is_floating_point() and v.dtype != torch.float32)
    if low:
        raise UserError(f"{folder}: {module[low[0]].dtype} weights ({low[0]}, ...) and no FP32 master copy")
    return dict(module)


def _training_tokenizer(client: dict, given: str | Path | None, what: str) -> Path:
    """The tokenizer file to export: ``given`` or the run's ``data.vocab``; it must hash as the run's did."""
    recorded = client["config"]["data"].get("vocab")
    path = Path(given or recorded or "")
    if not path.is_file():
        source = "--tokenizer" if given else f"data.vocab recorded in the checkpoint ({recorded or 'none'})"
        raise UserError(f"tokenizer file {path} ({source}) not found; pass --tokenizer {what}")
    expected = client.get("vocab_sha256")
    if expected and vocab_sha256(path) != expected:
        raise UserError(
            f"tokenizer file {path} is not the one the checkpoint was trained with "
            f"(sha256 {vocab_sha256(path)[:12]}..., the run's {expected[:12]}...)"
        )
    return path


def _stored_spec(client: dict, where: Path) -> ModelSpec:
    """The checkpoint's model spec; a family not registered here is refused, naming the modules its run
    loaded it from (``model.families`` in the stored config) and the flag that registers them."""
    stored = client["model_spec"]
    name = stored.get("family")
    if name not in FAMILIES:
        listed = list((client.get("config") or {}).get("model", {}).get("families") or [])
        modules = " ".join(map(str, listed)) or "MODULE"
        run_had = f"model.families={listed}" if listed else "no model.families"
        raise UserError(
            f"{where}: model family {name!r} is not registered (the run's config lists {run_had}); "
            f"pass --families {modules} to import the module(s) that define it"
        )
    return spec_from_dict(stored)


def export_checkpoint(
    checkpoint: str | Path,
    out: str | Path,
    *,
    tag: str | None = None,
    tokenizer: str | Path | None = None,
    overwrite: bool = False,
    families: Sequence[str] = (),
) -> Path:
    """Write ``out``: the model (``save_pretrained``) and the run's tokenizer, files readable (0644).
    ``families``: modules defining the checkpoint's family when it is not built in, registered first
    (``model.registry.load_families``, as ``model.families`` is at training time)."""
    ckpt_dir, out = Path(checkpoint), Path(out)
    if not ckpt_dir.is_dir():
        raise UserError(f"checkpoint directory {ckpt_dir} does not exist")
    if tag is None:
        ckpt_dir, tag = ckpt.resolve(ckpt_dir, "checkpoint")
    elif not (ckpt_dir / tag / ckpt.COMPLETE).exists():
        raise UserError(f"{ckpt_dir / tag} is not a complete checkpoint")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise UserError(f"output directory {out} is not empty (use --overwrite)")
    load_families(families)
    client = ckpt.read_client_state(ckpt_dir, tag)
    spec = _stored_spec(client, ckpt_dir / tag)
    family = family_of(spec)
    if family.save_tokenizer is None or family.transformers_model is None:
        raise UserError(f"{ckpt_dir / tag}: model family {family.name!r} has no Hugging Face export")
    tokenizer = _training_tokenizer(client, tokenizer, family.format.tokenizer_kind)

    with refusing(ckpt_dir / tag):
        state = consolidated_state(ckpt_dir, tag)
    # transformers' own eager attention for every family (MegatronBert has no other): which attention a model
    # runs is not saved, so the exported files are the same either way
    model = build_model(spec, attention="eager")
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Tied weights (BERT's decoder = word embeddings) may be stored once; everything else must match.
    missing = sorted(set(missing) - set(tied_names(model)))
    if missing or unexpected:
        raise UserError(
            f"{ckpt_dir / tag}: state dict does not fit {spec.name} "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    hf: Any = family.transformers_model(model)
    with atomic_path(out) as tmp:
        tmp.mkdir()
        special_ids = family.save_tokenizer(tokenizer, tmp, spec, client.get("data_attrs", {}))
        for key, value in special_ids.items():
            setattr(hf.config, key, value)
            if getattr(hf, "generation_config", None) is not None:
                setattr(hf.generation_config, key, value)
        hf.save_pretrained(str(tmp))
        _make_readable(tmp)
        if out.is_dir():  # only once the new export is complete (--overwrite, or an empty directory)
            shutil.rmtree(out)
        elif out.exists():
            out.unlink()
    return out
