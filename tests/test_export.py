"""``python -m training export``: real DeepSpeed checkpoints -> Hugging Face directories that reproduce a run.

The tokenizer an export writes must give the ids the shards were made with (the ``data`` layer's tokenizer on
the same file); the weights must be the checkpoint's; the files must be readable by others (0644).
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest
import torch

from tests.conftest import FP32, SHARED_DATA, data_bert, expect_error, run_python, start_ranks

pytestmark = pytest.mark.slow

ACCENTED = "The Café in Zürich, opened in 1887 by Émile Brontë, serves 北京 dumplings; naïve résumé!"


def _export(*args: str, umask: int | None = 0o022) -> subprocess.CompletedProcess:
    return run_python(["-m", "training", "export", *args], umask=umask)


def _sample_sentences(text_dir: Path, n: int = 3) -> list[str]:
    """Real sentences from the enwiki sample: plain ASCII lines of at least 12 words."""
    out = []
    for shard in sorted(text_dir.glob("*.txt")):
        for line in shard.read_text(encoding="utf-8").splitlines():
            if line.isascii() and len(line.split()) >= 12:
                out.append(line)
                if len(out) == n:
                    return out
    raise AssertionError(f"no sentences in {text_dir}")


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]}


def _assert_readable(out: Path) -> None:
    modes = _modes(out)
    assert modes["."] == 0o755, oct(modes["."])
    files = {k: v for k, v in modes.items() if k != "."}
    assert "model.safetensors" in files
    assert all(m == 0o644 for m in files.values()), {k: oct(v) for k, v in files.items()}


def _assert_weights_are_the_checkpoints(ckpt_dir: Path, hf_model: torch.nn.Module) -> None:
    """Exported FP32 weights round to the bf16 weights the run's module held, and are not themselves bf16."""
    tag = (ckpt_dir / "latest").read_text().strip()
    module = torch.load(ckpt_dir / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    exported = hf_model.state_dict()
    finer = 0
    for key, value in module["module"].items():
        name = key.removeprefix("hf.")
        assert value.dtype == torch.bfloat16 and exported[name].dtype == torch.float32, name
        assert torch.equal(exported[name].to(torch.bfloat16), value), name
        finer += not torch.equal(exported[name], value.float())
    assert len(module["module"]) > 10 and finer > len(module["module"]) // 2  # FP32 masters, not bf16 copies


def _assert_family_hash_key(shards: Path, family: str, tokenizer: Path) -> None:
    """The hash attribute of the family's shard format (its record) holds the hash of the tokenizer file the run
    used."""
    import h5py

    from data.h5format import sha256_file
    from model.registry import FAMILIES

    with h5py.File(sorted(shards.glob("*.h5"))[0], "r") as f:
        assert f.attrs[FAMILIES[family].format.hash_key] == sha256_file(tokenizer)


def _train(run_dir: Path, ranks: int, *overrides: str) -> Path:
    res = start_ranks(
        [
            "train.py",
            "--config",
            "smoke",
            f"run.dir={run_dir}",
            "train.steps=2",
            "train.eval_every=0",
            "checkpoint.every=0",
            "logging.every=1",
            "deepspeed.precision=bf16",
            *overrides,
        ],
        ranks,
        timeout=400,
    )
    assert res.returncode == 0, res.stdout[-8000:] + res.stderr[-3000:]
    return run_dir / "checkpoints"


# ------------------------------------------------------------------------------------------------ BERT


@pytest.fixture(scope="module")
def bert_vocab(request) -> Path:
    """The real bert-base-uncased vocab.txt when ../shared has it, else the WordPiece vocab of the sample."""
    real = SHARED_DATA / "bert-base-uncased-vocab.txt"
    return real if real.exists() else Path(request.getfixturevalue("wiki_vocab"))


@pytest.fixture(scope="module")
def bert_run(tmp_path_factory, wiki_text_dir, bert_vocab) -> dict[str, Path]:
    """bert-debug trained 2 steps on 2 ranks (ZeRO-2) on shards of the sample made with ``bert_vocab``."""
    root = tmp_path_factory.mktemp("bertexport")
    shards = root / "shards"
    res = run_python(
        data_bert(
            wiki_text_dir,
            bert_vocab,
            shards,
            "--seq-len",
            "128",
            "--max-pred",
            "20",
            "--dupe-factor",
            "1",
            "--no-progress",
        )
    )
    assert res.returncode == 0, res.stderr[-3000:]
    ckpt = _train(
        root / "run",
        2,
        f"data.train={shards}",
        f"data.eval={shards}",
        f"data.vocab={bert_vocab}",
        "train.global_batch=8",
        "train.micro_batch=2",
        "deepspeed.zero_stage=2",
    )
    return {"checkpoints": ckpt, "vocab": bert_vocab, "root": root, "shards": shards}


def test_bert_export_reproduces_training_tokenizer_and_weights(bert_run, wiki_text_dir):
    from transformers import AutoModelForPreTraining, AutoTokenizer

    from data.tokenizer import bert_tokenizer

    out = bert_run["root"] / "hf"
    res = _export(str(bert_run["checkpoints"]), "--out", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    _assert_readable(out)
    _assert_family_hash_key(bert_run["shards"], "bert", bert_run["vocab"])

    vocab = bert_run["vocab"].read_text(encoding="utf-8").splitlines()
    assert (out / "vocab.txt").read_bytes() == bert_run["vocab"].read_bytes()
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == len(vocab)
    specials = (tok.pad_token_id, tok.unk_token_id, tok.cls_token_id, tok.sep_token_id, tok.mask_token_id)
    assert specials == tuple(vocab.index(t) for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"))
    assert specials == (0, 100, 101, 102, 103)  # bert-base's layout, which data.vocab keeps
    training = bert_tokenizer(bert_run["vocab"], lowercase=True)  # what data.bert wrote the shards with
    for sentence in [*_sample_sentences(wiki_text_dir), ACCENTED]:
        expected = training.encode(sentence, add_special_tokens=False).ids
        assert tok(sentence)["input_ids"] == [101, *expected, 102], sentence
    plain = _sample_sentences(wiki_text_dir)[0]
    assert tok.unk_token_id not in tok(plain)["input_ids"]  # words are found, not [UNK]
    assert tok(plain.upper())["input_ids"] == tok(plain)["input_ids"]  # uncased

    model = AutoModelForPreTraining.from_pretrained(out).eval()
    assert type(model).__name__ == "BertForPreTraining"
    _assert_weights_are_the_checkpoints(bert_run["checkpoints"], model)
    enc = tok(plain.replace(plain.split()[3], "[MASK]", 1), return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc).prediction_logits
    assert logits.shape[-1] == model.config.vocab_size >= len(vocab) and torch.isfinite(logits).all()


def test_export_refusals_and_overwrite(bert_run, tmp_path):
    from common.errors import UserError
    from training.checkpoint.export import export_checkpoint

    ckpt, out = bert_run["checkpoints"], tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("someone's file\n")
    busy = _export(str(ckpt), "--out", str(out))
    assert busy.returncode == 2 and "Traceback" not in busy.stderr
    last = busy.stderr.strip().splitlines()[-1]
    assert last == f"error: output directory {out} is not empty (use --overwrite)"

    other = tmp_path / "vocab.txt"
    other.write_text(bert_run["vocab"].read_text(encoding="utf-8") + "zzzextra\n", encoding="utf-8")
    with pytest.raises(UserError, match=f"tokenizer file {other} is not the one the checkpoint was trained"):
        export_checkpoint(ckpt, tmp_path / "w", tokenizer=other)
    with pytest.raises(UserError, match=r"missing.txt \(--tokenizer\) not found; pass --tokenizer vocab.txt"):
        export_checkpoint(ckpt, tmp_path / "w", tokenizer=tmp_path / "missing.txt")
    with pytest.raises(UserError, match=f"checkpoint directory {tmp_path / 'nothing'} does not exist"):
        export_checkpoint(tmp_path / "nothing", tmp_path / "w")
    with pytest.raises(UserError, match="step00000099 is not a complete checkpoint"):
        export_checkpoint(ckpt, tmp_path / "w", tag="step00000099")
    assert not (tmp_path / "w").exists()

    mask = os.umask(0o077)
    try:
        export_checkpoint(ckpt, out, overwrite=True)
    finally:
        os.umask(mask)
    assert not (out / "notes.txt").exists() and (out / "model.safetensors").is_file()
    assert set(_modes(out).values()) == {0o600, 0o700}  # the umask is respected


# --------------------------------------------------------------------------------------------- GPT-NeoX


@pytest.fixture(scope="module")
def gpt_shards(tmp_path_factory, wiki_text_dir) -> dict[str, Path]:
    """A byte-level BPE trained on the sample, and seq-128 GPT shards made with it."""
    root = tmp_path_factory.mktemp("gptshards")
    tok, shards = root / "tokenizer.json", root / "shards"
    for cmd in (
        ["vocab", str(wiki_text_dir), "--out", str(tok), "--size", "4000", "--kind", "bpe"],
        [
            "gpt",
            "--text",
            str(wiki_text_dir),
            "--tokenizer",
            str(tok),
            "--out",
            str(shards),
            "--seq-len",
            "128",
            "--no-progress",
        ],
    ):
        res = run_python(["-m", "data", *cmd])
        assert res.returncode == 0, res.stderr[-3000:]
    return {"tokenizer": tok, "shards": shards}


@pytest.fixture(scope="module")
def neox_run(tmp_path_factory, gpt_shards) -> dict[str, Path]:
    """neox-debug trained 2 steps on 2 ranks with ZeRO-1 in bf16 (DeepSpeed's BF16 optimizer, whose partitions
    ``zero_to_fp32`` cannot read), with a byte-level BPE trained on the sample."""
    root = tmp_path_factory.mktemp("neoxexport")
    tok, shards = gpt_shards["tokenizer"], gpt_shards["shards"]
    ckpt = _train(
        root / "run",
        2,
        "model.name=neox-debug",
        f"data.train={shards}",
        f"data.eval={shards}",
        f"data.vocab={tok}",
        "optimizer.name=adamw",
        "deepspeed.zero_stage=1",
        "train.global_batch=4",
        "train.micro_batch=2",
    )
    return {"checkpoints": ckpt, "tokenizer": tok, "root": root, "shards": shards}


def test_neox_export_reproduces_training_tokenizer_and_weights(neox_run, wiki_text_dir):
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = neox_run["root"] / "hf"
    res = _export(str(neox_run["checkpoints"]), "--out", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    _assert_readable(out)
    _assert_family_hash_key(neox_run["shards"], "neox", neox_run["tokenizer"])

    training = Tokenizer.from_file(str(neox_run["tokenizer"]))  # what data.gpt wrote the shards with
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == training.get_vocab_size()
    assert tok.eos_token == tok.bos_token == "<|endoftext|>" and tok.eos_token_id == 0
    assert tok.pad_token_id == training.token_to_id("<|padding|>") == 1
    for sentence in [*_sample_sentences(wiki_text_dir), ACCENTED]:
        assert tok(sentence)["input_ids"] == training.encode(sentence).ids, sentence
        assert tok.decode(tok(sentence)["input_ids"]) == sentence

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == "GPTNeoXForCausalLM"
    assert model.config.eos_token_id == model.config.bos_token_id == 0
    _assert_weights_are_the_checkpoints(neox_run["checkpoints"], model)
    enc = tok(_sample_sentences(wiki_text_dir)[0], return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc).logits
    assert logits.shape[:2] == enc["input_ids"].shape and torch.isfinite(logits).all()


# ------------------------------------------------------------------------------------- a plug-in family

PLUGIN = "tests.llamafamily"


def test_a_plugin_family_exports_with_families_and_loads_in_transformers(gpt_shards, wiki_text_dir, tmp_path):
    """A family from outside the package that wraps a ``transformers`` model (tests/llamafamily.py) trains
    through model.families (2 steps, 2 ranks, ZeRO-2). Its export is refused, naming the module the run's config
    lists, until ``--families`` names it (a checkpoint's list is never imported); then the export loads in
    ``transformers`` and gives the logits of the trained model: the family's own, with the checkpoint's
    weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.llamafamily import FAMILY
    from training.checkpoint import storage

    ckpt = _train(
        tmp_path / "run",
        2,
        f"model.families=[{PLUGIN}]",
        "model.name=hfllama-debug",
        f"data.train={gpt_shards['shards']}",
        f"data.eval={gpt_shards['shards']}",
        f"data.vocab={gpt_shards['tokenizer']}",
        "optimizer.name=adamw",
        "deepspeed.zero_stage=2",
        "train.global_batch=4",
        "train.micro_batch=2",
        FP32,
    )
    tag = (ckpt / "latest").read_text().strip()
    out = tmp_path / "hf"
    expect_error(
        _export(str(ckpt), "--out", str(out)),
        f"{ckpt / tag}: model family 'hfllama' is not registered (the run's config lists model.families=['{PLUGIN}'])",
        f"; pass --families {PLUGIN} to import",
    )
    assert not out.exists()
    res = _export(str(ckpt), "--out", str(out), "--families", PLUGIN)
    assert res.returncode == 0, res.stderr[-3000:]
    _assert_readable(out)

    exported = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(exported).__name__ == "LlamaForCausalLM"
    stored = storage.read_client_state(ckpt, tag)["model_spec"]
    trained = FAMILY.build(FAMILY.spec_class(**{k: v for k, v in stored.items() if k != "padded_vocab"}), "eager")
    states = torch.load(ckpt / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=True)
    trained.load_state_dict(states["module"])  # strict: every weight, each once
    trained.eval()
    ids = AutoTokenizer.from_pretrained(out)(_sample_sentences(wiki_text_dir)[0], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = exported(input_ids=ids).logits
        assert torch.equal(logits, trained.hf(input_ids=ids).logits)
    assert logits.shape == (1, ids.shape[1], trained.spec.padded_vocab) and torch.isfinite(logits).all()


# ---------------------------------------------------------------- tokenizer writers, without a checkpoint


@pytest.mark.parametrize("lowercase", [True, False])
def test_bert_tokenizer_files_for_the_sample_vocab(wiki_vocab, wiki_text_dir, tmp_path, lowercase):
    from transformers import AutoTokenizer

    from data.tokenizer import bert_tokenizer
    from model.registry import FAMILIES, get_spec

    ids = FAMILIES["bert"].save_tokenizer(Path(wiki_vocab), tmp_path, get_spec("bert-debug"), {"lowercase": lowercase})
    assert ids == {"pad_token_id": 0}
    tok = AutoTokenizer.from_pretrained(tmp_path)
    training = bert_tokenizer(wiki_vocab, lowercase)
    for sentence in [*_sample_sentences(wiki_text_dir), ACCENTED]:
        assert tok(sentence, add_special_tokens=False)["input_ids"] == training.encode(sentence).ids[1:-1]
    assert tok.model_max_length == 512
    assert (tok("Zürich")["input_ids"] == tok("zurich")["input_ids"]) is lowercase


def test_bert_tokenizer_files_for_the_real_vocab(shared_bert_vocab, tmp_path):
    from transformers import AutoTokenizer

    from model.registry import FAMILIES, get_spec

    FAMILIES["bert"].save_tokenizer(shared_bert_vocab, tmp_path, get_spec("bert-base"), {"lowercase": True})
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == 30522 and tok.mask_token_id == 103
    # bert-base-uncased's own ids for this sentence
    ids = tok("The history of Paris is long.")["input_ids"]
    assert ids == [101, 1996, 2381, 1997, 3000, 2003, 2146, 1012, 102]


def test_neox_tokenizer_files_for_the_real_tokenizer(shared_neox_tokenizer, tmp_path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from model.registry import FAMILIES, get_spec

    spec = get_spec("neox-20b")
    ids = FAMILIES["neox"].save_tokenizer(shared_neox_tokenizer, tmp_path, spec, {"eod_id": 0})
    assert ids == {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 1}
    tok, ref = AutoTokenizer.from_pretrained(tmp_path), Tokenizer.from_file(str(shared_neox_tokenizer))
    assert tok(ACCENTED)["input_ids"] == ref.encode(ACCENTED).ids
    assert len(tok) == ref.get_vocab_size()
