"""Model registry, parameter counts, FLOPs convention, and parity with the ``transformers`` reference
models."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import BertForPreTraining, GPTNeoXForCausalLM

from model.build import build_model, count_parameters
from model.flops import training_flops_per_token
from model.registry import FAMILIES, REGISTRY, get_spec
from tests.conftest import run_python

# Published sizes; counts must be within 3%. neox-125m is nominal under the tied convention (GPT-NeoX's own
# count with untied embeddings is 162M); the others are GPT-NeoX's own (untied) counts.
EXPECTED_PARAMS = {
    "bert-base": ("params", 110e6),
    "bert-large": ("params", 335e6),
    "bert-1.5b": ("params", 1.5e9),
    "bert-5b": ("params", 5.0e9),
    "neox-125m": ("params_tied", 125e6),
    "neox-1.3b": ("params", 1.4e9),
    "neox-20b": ("params", 20.6e9),
}


@pytest.fixture(scope="module")
def listing() -> list[dict]:
    out = run_python(["-m", "model", "list", "--json"])
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("name", sorted(EXPECTED_PARAMS))
def test_parameter_counts_within_3_percent(listing, name):
    row = next(r for r in listing if r["name"] == name)
    key, expected = EXPECTED_PARAMS[name]
    assert abs(row[key] - expected) / expected < 0.03, (name, row[key], expected)


def test_listing_covers_registry_and_conventions(listing):
    assert [r["name"] for r in listing] == list(REGISTRY)
    neox125 = next(r for r in listing if r["name"] == "neox-125m")
    assert abs(neox125["params"] - 162e6) / 162e6 < 0.03  # untied, as GPT-NeoX counts it
    for r in listing:
        assert {"name", "family", "params"} <= set(r)
        assert r["family"] in FAMILIES


def test_shapes_match_published_configs():
    large, b5, n20 = get_spec("bert-large"), get_spec("bert-5b"), get_spec("neox-20b")
    assert (large.layers, large.hidden, large.heads, large.ffn, large.padded_vocab) == (
        24,
        1024,
        16,
        4096,
        30528,
    )
    assert (b5.layers, b5.hidden, b5.heads, b5.ffn, b5.pre_layernorm) == (63, 2560, 40, 10240, True)
    assert (n20.layers, n20.hidden, n20.heads, n20.rotary_pct, n20.parallel_residual) == (
        44,
        6144,
        64,
        0.25,
        True,
    )
    assert n20.padded_vocab == 50432


def test_meta_device_allocates_nothing():
    model = build_model("neox-20b", device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())


def test_unknown_model_is_a_user_error():
    from common.errors import UserError

    with pytest.raises(UserError, match="unknown model 'bert-huge'"):
        get_spec("bert-huge")


def _bert_batch(spec, batch=3, seq=32, max_pred=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, spec.vocab_size, (batch, seq), generator=g)
    attention = torch.ones(batch, seq, dtype=torch.long)
    attention[0, 20:] = 0  # padding in one row
    types_ = torch.zeros(batch, seq, dtype=torch.long)
    types_[:, seq // 2 :] = 1
    positions = torch.zeros(batch, max_pred, dtype=torch.long)
    labels = torch.zeros(batch, max_pred, dtype=torch.long)
    weights = torch.zeros(batch, max_pred)
    for b in range(batch):
        n = max_pred if b else 3  # row 0 has fewer predictions: zero-padded like NVIDIA's shards
        pos = torch.sort(torch.randperm(18, generator=g)[:n] + 1).values
        positions[b, :n] = pos
        labels[b, :n] = torch.randint(5, spec.vocab_size, (n,), generator=g)
        weights[b, :n] = 1.0
    nsp = torch.tensor([0, 1, 1][:batch])
    return dict(
        input_ids=ids,
        token_type_ids=types_,
        attention_mask=attention,
        masked_lm_positions=positions,
        masked_lm_ids=labels,
        masked_lm_weights=weights,
        next_sentence_labels=nsp,
    )


@pytest.mark.parametrize("unpad", [True, False], ids=["unpadded", "padded"])
@pytest.mark.parametrize("pre_ln", [False, True])
def test_sparse_mlm_loss_equals_bert_for_pretraining(pre_ln, unpad):
    """Sparse-MLM loss == the dense reference loss on the same weights and inputs (fp32, rtol 1e-5)."""
    torch.manual_seed(0)
    spec = get_spec("bert-debug", vocab_size=1000, pre_layernorm=pre_ln, dropout=0.0)
    ours = build_model(spec, unpad=unpad).eval()
    batch = _bert_batch(spec)
    reference = ours.hf  # BertForPreTraining / MegatronBertForPreTraining with the same weights
    if not pre_ln:
        assert isinstance(reference, BertForPreTraining)

    def dense(batch):
        labels = torch.full_like(batch["input_ids"], -100)
        for b in range(labels.size(0)):
            n = int(batch["masked_lm_weights"][b].sum())
            labels[b, batch["masked_lm_positions"][b, :n]] = batch["masked_lm_ids"][b, :n]
        inputs = {k: batch[k] for k in ("input_ids", "token_type_ids", "attention_mask")}
        return labels, reference(**inputs, labels=labels, next_sentence_label=batch["next_sentence_labels"])

    # every other masked token's label is what the model predicts there, so the accuracy is not 0
    _, ref = dense(batch)
    top = ref.prediction_logits.argmax(-1).gather(1, batch["masked_lm_positions"])
    batch["masked_lm_ids"][:, ::2] = top[:, ::2]
    labels, ref = dense(batch)
    out = ours(**batch)
    torch.testing.assert_close(out["loss"], ref.loss, rtol=1e-5, atol=1e-6)
    # the accuracy's counts, from the head's chunks (no logits), equal the dense logits' argmax
    counted = labels != -100
    assert int(out["mlm_count"]) == int(counted.sum())
    assert int(out["mlm_correct"]) == int(((ref.prediction_logits.argmax(-1) == labels) & counted).sum()) > 0


def test_padded_path_passes_no_mask_when_no_row_is_padded():
    """The loader's host ``min_seqlen`` tells the padded path (``model.unpad=false``) that no row is padded: it
    calls ``transformers`` without an attention mask, so its mask code has nothing to check on the device (a
    host sync on an accelerator), and the loss is the one with the all-ones mask. A padded row keeps the mask."""
    torch.manual_seed(0)
    spec = get_spec("bert-debug", vocab_size=1000, dropout=0.0)
    model = build_model(spec, unpad=False).eval()
    seen: list = []
    model.hf.bert.register_forward_pre_hook(
        lambda _, args, kwargs: seen.append(kwargs["attention_mask"]), with_kwargs=True
    )
    full = _bert_batch(spec)
    full["attention_mask"] = torch.ones_like(full["attention_mask"])
    with_mask = model(**full)["loss"]
    without = model(**full, min_seqlen=torch.tensor(32))["loss"]
    assert seen[0] is full["attention_mask"] and seen[1] is None
    torch.testing.assert_close(without, with_mask, rtol=1e-6, atol=0)
    padded = _bert_batch(spec)
    model(**padded, min_seqlen=padded["attention_mask"].sum(1).min())
    assert seen[2] is padded["attention_mask"]


def test_megatron_sdpa_matches_eager_attention():
    torch.manual_seed(0)
    spec = get_spec("bert-debug", vocab_size=1000, pre_layernorm=True, dropout=0.0)
    sdpa = build_model(spec, attention="sdpa", unpad=False).eval()  # the unpadded model has its own kernels
    eager = build_model(spec, attention="eager", unpad=False).eval()
    eager.load_state_dict(sdpa.state_dict())
    batch = _bert_batch(spec)
    torch.testing.assert_close(sdpa(**batch)["loss"], eager(**batch)["loss"], rtol=1e-5, atol=1e-6)


def test_neox_loss_equals_gpt_neox_for_causal_lm():
    torch.manual_seed(0)
    spec = get_spec("neox-debug", vocab_size=512)
    ours = build_model(spec).eval()
    assert isinstance(ours.hf, GPTNeoXForCausalLM)
    assert ours.hf.config.tie_word_embeddings is False
    # An independently constructed reference with the same config and weights.
    reference = GPTNeoXForCausalLM(ours.hf.config).eval()
    reference.load_state_dict(ours.hf.state_dict())
    ids = torch.randint(0, 500, (2, 33))
    ref = reference(input_ids=ids[:, :-1], labels=ids[:, :-1])  # HF shifts internally: loses the last target
    ref_logits = reference(input_ids=ids[:, :-1]).logits
    ours_logits = ours.hf(input_ids=ids[:, :-1]).logits
    torch.testing.assert_close(ours_logits, ref_logits, rtol=1e-5, atol=1e-5)
    full = torch.nn.functional.cross_entropy(ref_logits.reshape(-1, ref_logits.size(-1)), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(ours(input_ids=ids)["loss"], full, rtol=1e-5, atol=1e-6)
    assert not torch.isclose(ref.loss, full)  # the packed convention keeps the window's last target


@pytest.mark.parametrize("unpad", [True, False], ids=["unpadded", "padded"])
def test_activation_checkpointing_gives_same_gradients(unpad):
    torch.manual_seed(0)
    spec = get_spec("bert-debug", vocab_size=1000, dropout=0.0)
    plain = build_model(spec, unpad=unpad)
    ckpt = build_model(spec, activation_checkpointing=True, unpad=unpad)
    ckpt.load_state_dict(plain.state_dict())
    batch = _bert_batch(spec)
    calls = {"plain": 0, "ckpt": 0}

    def counter(key):
        def hook(*_):
            calls[key] += 1

        return hook

    plain.hf.bert.encoder.layer[0].attention.output.register_forward_hook(counter("plain"))
    ckpt.hf.bert.encoder.layer[0].attention.output.register_forward_hook(counter("ckpt"))
    plain(**batch)["loss"].backward()
    ckpt(**batch)["loss"].backward()
    assert ckpt.hf.is_gradient_checkpointing
    assert (calls["plain"], calls["ckpt"]) == (1, 2)  # inside the layer, work is recomputed in backward
    for (n, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_flops_per_token_convention():
    spec = get_spec("neox-1.3b")
    n = count_parameters(spec)
    non_input_embedding = n["total"] - n["input_embedding"]
    expected = 6 * non_input_embedding + 12 * spec.layers * spec.hidden * 2048
    assert training_flops_per_token(spec, 2048) == pytest.approx(expected, rel=1e-9)
    # BERT: the MLM head counts max_pred/seq of a token's share, so phase 2 (80/512) > phase 1 (20/128) per
    # token
    large = get_spec("bert-large")
    assert training_flops_per_token(large, 512, 80) > training_flops_per_token(large, 128, 20)
    assert training_flops_per_token(large, 128, 20) < 6 * count_parameters(large)["total"] + 12 * 24 * 1024 * 128


# ----------------------------------------------------------------------------- one record per model family


def test_every_size_has_its_family_record():
    import dataclasses

    from common.errors import UserError
    from data.formats import BERT, FORMATS, GPT
    from data.h5format import SCHEMAS
    from model.registry import FAMILIES, family_of

    for spec in REGISTRY.values():
        family = family_of(spec)
        assert family is FAMILIES[spec.family] and type(spec) is family.spec_class
        assert family.shard_format in SCHEMAS and family.format is FORMATS[family.shard_format]  # a data layer format
        model = family.build(spec, "sdpa") if spec.layers <= 4 else build_model(spec, device="meta")
        assert model.spec is spec and type(model) is type(build_model(spec, device="meta"))
    assert {f.spec_class for f in FAMILIES.values()} == {type(s) for s in REGISTRY.values()}
    # the two names of one family ("neox" model, "gpt" shards) live in one record; the data's facts in the format's
    assert (FAMILIES["bert"].format, FAMILIES["neox"].format) == (BERT, GPT)
    assert FAMILIES["neox"].format.hash_key == "tokenizer_sha256" and FAMILIES["bert"].format.uses_max_pred
    with pytest.raises(dataclasses.FrozenInstanceError):
        FAMILIES["bert"].shard_format = "gpt"  # type: ignore[misc]
    # the fields the record held before it named its format: reading one fails; setting one is refused, in a line
    # naming the family, the field and what to set instead
    assert not hasattr(FAMILIES["bert"], "shard_kind") and not hasattr(FAMILIES["bert"], "uses_max_pred")
    for field, value in (("shard_kind", "gpt"), ("hash_key", "tokenizer_sha256"), ("uses_max_pred", False)):
        with pytest.raises(
            UserError, match=rf"^model family 'neox' sets {field}, which the Family record no longer has: set shard_f"
        ):
            dataclasses.replace(FAMILIES["neox"], **{field: value})
    unknown = dataclasses.replace(FAMILIES["neox"], shard_format="nowhere")  # looked up when asked: one line
    with pytest.raises(UserError, match=r"^model family 'neox' trains on shard format 'nowhere', which is not reg"):
        _ = unknown.format


def test_the_family_hook_and_the_unpad_question():
    """``model.families``' hook refuses, in one line, a module it cannot import or one without a FAMILY record,
    and a second record under a registered name; whether a run unpads is the record's answer to model.unpad."""
    import dataclasses

    from common.errors import UserError
    from model.registry import FAMILIES, load_families, register

    with pytest.raises(UserError, match="model.families: cannot import 'tests.no_such_family'"):
        load_families(["tests.no_such_family"])
    with pytest.raises(UserError, match="module 'common.errors' defines no FAMILY"):
        load_families(["common.errors"])
    load_families(["model.bert"])  # a registered record again: nothing changes
    with pytest.raises(UserError, match="'bert' is already registered"):
        register(dataclasses.replace(FAMILIES["bert"], title="another"))
    bert, neox = FAMILIES["bert"], FAMILIES["neox"]
    assert (bert.unpadded(True), bert.unpadded(False), neox.unpadded(True)) == (True, False, False)
    assert build_model(get_spec("bert-debug"), device="meta", unpad=False).unpad is False
    with pytest.raises(ValueError, match="do not unpad"):
        neox.build(get_spec("neox-debug"), unpad=True)


def test_a_family_without_a_transformers_model_refuses_what_needs_one():
    """The toy family (tests/toyfamily.py) names no transformers model: activation checkpointing is refused in
    one line naming the key."""
    from common.errors import UserError
    from model.registry import FAMILIES, REGISTRY, load_families

    load_families(["tests.toyfamily"])
    try:
        assert build_model("toy-debug", device="meta").spec.family == "toy"
        with pytest.raises(UserError, match="^model.activation_checkpointing: Toy models have no transformers model"):
            build_model("toy-debug", device="meta", activation_checkpointing=True)
    finally:  # the rest of the session sees the built-in families only
        FAMILIES.pop("toy")
        REGISTRY.pop("toy-debug")


def test_head_rules():
    from model.registry import FAMILIES

    bert, neox = FAMILIES["bert"].head_weights, FAMILIES["neox"].head_weights
    assert bert(1000, 64, 20) == (0, 1000 * 20 + 64)  # per sequence: MLM at 20 positions, NSP once
    assert neox(1000, 0, None) == (1000, 0)  # the LM head at every position
    with pytest.raises(ValueError, match="max_pred"):
        bert(1000, 64, None)


@pytest.mark.parametrize("name", ["bert-base", "bert-1.5b", "neox-125m", "neox-20b"])
def test_flops_equal_the_family_head_rule(name):
    """model.flops agrees with the Family rule fed with head weights counted here, a tied decoder included."""
    from model.registry import family_of

    spec = get_spec(name)
    hf = build_model(spec, device="meta").hf
    layers = pred = seq = 0
    for n, p in hf.named_parameters():
        if n.endswith(
            (
                "embeddings.word_embeddings.weight",
                "position_embeddings.weight",
                "token_type_embeddings.weight",
                "embed_in.weight",
            )
        ):
            continue  # lookups, not matmuls
        if n.startswith("cls.predictions.") or n.startswith("embed_out."):
            pred += p.numel()
        elif n.startswith(("bert.pooler.", "cls.seq_relationship.")):
            seq += p.numel()
        else:
            layers += p.numel()
    if hf.get_output_embeddings().weight is hf.get_input_embeddings().weight:
        pred += hf.get_output_embeddings().weight.numel()  # BERT's decoder: the tied embedding matrix
    seq_len, max_pred = (128, 20) if spec.family == "bert" else (2048, None)
    per_token, per_sequence = family_of(spec).head_weights(pred, seq, max_pred)
    expected = 6 * (layers + per_token + per_sequence / seq_len) + 12 * spec.layers * spec.hidden * seq_len
    assert training_flops_per_token(spec, seq_len, max_pred) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_spec_round_trips_through_a_checkpoint(name):
    from model.registry import spec_from_dict, spec_to_dict

    spec = get_spec(name, vocab_size=8000)
    stored = json.loads(json.dumps({**spec_to_dict(spec), "padded_vocab": spec.padded_vocab}))  # train.py
    assert spec_from_dict(stored) == spec


def test_spec_from_dict_errors_name_the_problem():
    from common.errors import UserError
    from model.registry import spec_from_dict, spec_to_dict

    d = spec_to_dict(get_spec("neox-debug"))
    with pytest.raises(UserError, match="model spec has family 'gpt'; known families: bert, neox"):
        spec_from_dict({**d, "family": "gpt"})
    with pytest.raises(UserError, match="model spec 'neox-debug' has unknown field\\(s\\) pre_layernorm"):
        spec_from_dict({**d, "pre_layernorm": True})
    with pytest.raises(UserError, match="model spec 'neox-debug': .*rotary_pct"):
        spec_from_dict({**d, "rotary_pct": 2.0})
