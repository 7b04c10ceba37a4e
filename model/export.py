"""Export a trained checkpoint to a Hugging Face model directory (``save_pretrained`` + tokenizer files).

ZeRO shards are consolidated with DeepSpeed's own ``zero_to_fp32`` into one FP32 state dict; the model is
rebuilt from the spec stored in the checkpoint, so the export needs nothing but the checkpoint directory.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from common.atomic import atomic_path
from common.errors import UserError
from model.build import build_model
from model.registry import spec_from_dict


def _save_tokenizer(family: str, tokenizer_path: Path, out: Path, lowercase: bool) -> None:
    if family == "bert":
        from transformers import BertTokenizerFast

        tok = BertTokenizerFast(vocab_file=str(tokenizer_path), do_lower_case=lowercase)
    else:
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast(
            tokenizer_file=str(tokenizer_path), eos_token="<|endoftext|>", bos_token="<|endoftext|>"
        )
    tok.save_pretrained(str(out))


def export_checkpoint(
    checkpoint: str | Path,
    out: str | Path,
    *,
    tag: str | None = None,
    tokenizer: str | Path | None = None,
    overwrite: bool = False,
) -> Path:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from training import checkpoint as ckpt

    ckpt_dir, out = Path(checkpoint), Path(out)
    if not ckpt_dir.is_dir():
        raise UserError(f"checkpoint directory {ckpt_dir} does not exist")
    if tag is None:
        ckpt_dir, tag = ckpt.resolve(ckpt_dir, "checkpoint")
    elif not (ckpt_dir / tag / ckpt.COMPLETE).exists():
        raise UserError(f"{ckpt_dir / tag} is not a complete checkpoint")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise UserError(f"output directory {out} is not empty (use --overwrite)")
    client = ckpt.read_client_state(ckpt_dir, tag)
    spec = spec_from_dict({k: v for k, v in client["model_spec"].items() if k != "padded_vocab"})
    tokenizer = Path(tokenizer or client["config"]["data"].get("vocab") or "")
    if not tokenizer.is_file():
        raise UserError(
            f"tokenizer file {tokenizer or '(none recorded)'} not found; pass --tokenizer vocab.txt|tokenizer.json"
        )

    state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
    model = build_model(spec)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Tied weights (BERT's decoder = word embeddings) may be stored once; everything else must match.
    missing = [k for k in missing if not k.endswith("predictions.decoder.weight")]
    if missing or unexpected:
        raise UserError(
            f"{ckpt_dir / tag}: state dict does not fit {spec.name} (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    hf = model.hf
    if spec.family == "bert" and spec.pre_layernorm:
        hf.config._attn_implementation = "eager"  # the exported MegatronBert uses transformers' own attention
    lowercase = bool(client.get("data_attrs", {}).get("lowercase", True))
    if out.exists() and overwrite:
        shutil.rmtree(out)
    with atomic_path(out) as tmp:
        hf.save_pretrained(str(tmp))
        _save_tokenizer(spec.family, tokenizer, tmp, lowercase)
    return out
