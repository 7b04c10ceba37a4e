"""Typed configuration: precedence, type checks, batch arithmetic, one-line errors, every shipped recipe."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
from pathlib import Path

import pytest

import training.config
from common.errors import UserError
from tests.conftest import run_python
from training.config import CONFIG_DIR, Config, gradient_accumulation, load_config
from training.engine import deepspeed_config


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_precedence_cli_over_file_over_defaults(tmp_path):
    p = write(tmp_path, "optimizer:\n  lr: 6e-3\n  name: lamb\ntrain:\n  steps: 7\n")
    cfg = load_config(str(p), ["optimizer.lr=3e-3"])
    assert cfg.optimizer.lr == pytest.approx(3e-3)  # command line wins
    assert cfg.optimizer.name == "lamb" and cfg.train.steps == 7  # file wins over defaults
    assert cfg.optimizer.weight_decay == Config().optimizer.weight_decay  # default kept
    assert isinstance(load_config(str(p)).optimizer.lr, float)  # YAML 1.1 reads 6e-3 as a string


def test_base_include(tmp_path):
    write(tmp_path, "train:\n  steps: 100\n  global_batch: 64\n", "base.yaml")
    p = write(tmp_path, "base: base.yaml\ntrain:\n  steps: 5\n")
    cfg = load_config(str(p))
    assert (cfg.train.steps, cfg.train.global_batch) == (5, 64)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["optimizer.lrr=1"], "unknown key optimizer.lrr"),
        (["bogus.x=1"], "unknown key bogus"),
        (["train.steps=ten"], "train.steps: expected int, got 'ten'"),
        (["deepspeed.zero_stage=4"], "deepspeed.zero_stage: expected one of 0 | 1 | 2 | 3, got 4"),
        (
            ["deepspeed.nccl_async_error_handling=5"],
            "deepspeed.nccl_async_error_handling: expected one of 0 | 1 | 2 | 3, got 5",
        ),
        (
            ["train.global_batch=30", "train.micro_batch=8"],
            "train.global_batch=30 is not a multiple of train.micro_batch=8",
        ),
        (["deepspeed.offload_param=true"], "deepspeed.offload_param needs deepspeed.zero_stage=3"),
        (["train.steps"], "not of the form section.key=value"),
        (
            ["deepspeed.zero_stage=3"],
            "optimizer.name=lans keeps per-tensor trust ratios under ZeRO stages 0-2",
        ),
        (["data.kind=toy"], r"^unknown shard format 'toy' \(known: bert, gpt\)$"),
        (["data.formats=[tests.no_such_format]"], "^data.formats: cannot import 'tests.no_such_format'"),
        (["data.formats=[common.errors]"], "^data.formats: module 'common.errors' defines no FORMAT"),
    ],
)
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(UserError, match=message.replace("|", r"\|")):
        load_config(None, overrides)


def test_a_format_module_registers_its_format():
    """``data.formats`` registers a format from outside the package (tests/toyformat.py), which ``data.kind`` may
    then name."""
    from data.formats import FORMATS

    try:
        cfg = load_config(None, ["data.formats=[tests.toyformat]", "data.kind=toy"])
        assert cfg.data.kind == "toy" and FORMATS["toy"].format_attr == "wikipretrain-toy"
    finally:  # the rest of the session sees the built-in formats only
        FORMATS.pop("toy", None)


def test_gradient_accumulation_reconciled_once():
    cfg = load_config(None, ["train.global_batch=65536", "train.micro_batch=64"])
    assert gradient_accumulation(cfg.train, 8) == 128
    assert gradient_accumulation(cfg.train, 128 * 8) == 1
    with pytest.raises(
        UserError,
        match=r"train.global_batch=65536 is not divisible by train.micro_batch=64 x data-parallel world "
        r"size 3 \(= 192\)",
    ):
        gradient_accumulation(cfg.train, 3)
    cfg = load_config(None, ["train.global_batch=64", "train.micro_batch=8", "train.grad_accum=2"])
    with pytest.raises(UserError, match="train.grad_accum=2 contradicts"):
        gradient_accumulation(cfg.train, 2)


def test_deepspeed_json_generated_from_typed_config():
    cfg = load_config(None, ["deepspeed.zero_stage=2", "deepspeed.precision=bf16", "train.global_batch=64"])
    ds = deepspeed_config(cfg, gradient_accumulation(cfg.train, 2), "runs/x")
    assert ds["train_batch_size"] == 64 and ds["gradient_accumulation_steps"] == 4
    assert ds["zero_optimization"]["stage"] == 2 and ds["bf16"] == {"enabled": True, "immediate_grad_update": True}
    assert ds["data_types"] == {"grad_accum_dtype": "fp32"}
    stage0 = load_config(None, ["deepspeed.zero_stage=0"])
    assert deepspeed_config(stage0, 4, "runs/x")["zero_optimization"]["stage"] == 1  # BF16 master-weight path
    fp32 = load_config(None, ["deepspeed.zero_stage=0", "deepspeed.precision=fp32"])
    assert "bf16" not in deepspeed_config(fp32, 4, "runs/x")


RECIPES = sorted(CONFIG_DIR.glob("*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_shipped_recipe_validates(path):
    from model.registry import get_spec

    cfg = load_config(str(path))
    get_spec(cfg.model.name)
    assert cfg.train.global_batch % cfg.train.micro_batch == 0


def run_train(*args: str) -> subprocess.CompletedProcess:
    return run_python(["train.py", *args], timeout=120)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--config", "configs/nope.yaml"], "error: config file configs/nope.yaml does not exist"),
        (["--config", "smoke", "optimizer.lrr=1"], "error: unknown key optimizer.lrr"),
        (["--config", "smoke", "train.steps=abc"], "error: train.steps: expected int, got 'abc'"),
        (["--config", "smoke", "train.global_batch=33"], "error: train.global_batch=33 is not a multiple"),
        (
            ["--config", "smoke", "model.name=bert-huge", "data.train=/nonexistent"],
            "error: unknown model 'bert-huge'",
        ),
        (["--config", "smoke", "deepspeed.precision=fp16"], "error: deepspeed.precision=fp16 needs a GPU"),
    ],
)
def test_cli_config_errors_are_one_line(args, message):
    out = run_train(*args)
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip() and "Warning" not in line and "warn" not in line]
    assert lines[-1].startswith(message), out.stderr
    assert "Traceback" not in out.stderr


def test_print_config_shows_deepspeed_json():
    out = run_train("--config", "smoke", "--print-config", "train.steps=3")
    assert out.returncode == 0, out.stderr
    assert '"gradient_accumulation_steps": 4' in out.stdout and '"steps": 3' in out.stdout


def test_nccl_without_cuda_is_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: nccl is valid here")
    out = run_train("--config", "smoke", "deepspeed.backend=nccl")
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: deepspeed.backend=nccl needs a CUDA device, but this torch has no CUDA; "
        "use deepspeed.backend=gloo on CPU"
    ], out.stderr
    assert "Traceback" not in out.stderr


def test_wandb_set_but_not_installed_is_refused_before_anything_starts(monkeypatch):
    """``logging.wandb.project`` without the wandb extra: the set-up check (every rank, before the process group)
    refuses it in one line. The package is hidden from this process as an uninstalled one is."""
    import sys

    from training.engine import check_setup

    cfg = load_config("smoke", ["logging.wandb.project=p"])
    monkeypatch.setitem(sys.modules, "wandb", None)  # what importlib finds for a package that is not there
    with pytest.raises(UserError, match="logging.wandb.project is set but wandb is not installed"):
        check_setup(cfg)
    check_setup(load_config("smoke", []))  # without the key, nothing is asked of wandb


def _field_docstrings(source: str) -> dict[str, dict[str, str | None]]:
    """Per dataclass in ``source``: each annotated field and the string literal right after it (None when
    there is none)."""
    out: dict[str, dict[str, str | None]] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields: dict[str, str | None] = {}
        for stmt, after in zip(node.body, [*node.body[1:], None]):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                doc = None
                if (
                    isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)
                ):
                    doc = after.value.value.strip() or None
                fields[stmt.target.id] = doc
        out[node.name] = fields
    return out


def test_field_docstring_check_sees_a_missing_one():
    found = _field_docstrings('class S:\n    a: int = 1\n    """A."""\n    b: int = 2\n    c: int = 3\n    """C."""\n')
    assert found == {"S": {"a": "A.", "b": None, "c": "C."}}


def test_every_config_field_has_a_docstring():
    """Every field of every section (``Config``'s own fields are the sections) says what it means, right
    where it is declared, as a string literal after it."""
    found = _field_docstrings(Path(training.config.__file__).read_text())
    sections = {
        name: cls
        for name, cls in vars(training.config).items()
        if dataclasses.is_dataclass(cls) and isinstance(cls, type) and cls is not Config
    }
    assert {"RunSection", "OptimizerSection", "WandbSection"} <= set(sections)
    missing = []
    for name, cls in sections.items():
        declared = [f.name for f in dataclasses.fields(cls)]
        assert list(found[name]) == declared, f"{name}: fields seen in the source differ from the dataclass's"
        missing += [f"{name}.{f}" for f in declared if found[name][f] is None]
    assert not missing, f"fields without a docstring (a string literal right after the field): {missing}"


def test_deterministic_runs_do_not_fill_new_memory() -> None:
    """train.deterministic: deterministic algorithms on, and new tensors not filled with NaN (torch's default
    under deterministic algorithms: a 3.2x slower CPU step, and no more deterministic)."""
    import torch

    from training.engine import set_determinism

    before = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    try:
        set_determinism()
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.utils.deterministic.fill_uninitialized_memory
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.utils.deterministic.fill_uninitialized_memory = before[1]
