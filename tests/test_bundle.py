"""``python -m launch bundle``: an offline install bundle, installed with ``pip --no-index`` in a fresh venv.

The end-to-end test builds a bundle for this machine's Python and platform, for a target that already has
most of what this test environment has (its own ``pip freeze`` less the project, DeepSpeed and three small
packages), so the bundle holds the project wheel, a DeepSpeed wheel built from its sdist, and a few small
wheels. A fresh venv stands in for the target: what the target "already has" is made visible to it through a
``.pth`` file naming a folder of links to this environment's packages, minus the ones the bundle must bring.
Then ``pip install --no-index --find-links BUNDLE`` installs the project there, with every pip configuration
file and PIP_* variable switched off, and a one-process CPU training run (train.py on real shards of the
enwiki sample) runs from that install.

The bundle step needs the package index (or pip's cache) for the three small wheels and the DeepSpeed sdist.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from importlib.metadata import distribution, distributions
from pathlib import Path

import pytest

from launch.bundle import MANIFEST, check_platforms, parse_have_line, read_have
from tests.conftest import REPO, data_bert, run_python

# Packages the target lacks: the bundle must carry these (plus the project).
MISSING = ["deepspeed", "hjson", "tqdm", "einops"]


def bundle_cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return run_python(["-m", "launch", "bundle", *args], timeout=timeout)


def one_line_error(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip() and " INFO " not in ln]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.stderr
    return lines[0]


# --------------------------------------------------------------------------- input checks (no network)


def test_have_lines():
    assert parse_have_line("Torch==2.11.0+cu128", "x") == ("torch", "2.11.0+cu128")
    assert parse_have_line("typing_extensions == 4.16.0", "x") == ("typing-extensions", "4.16.0")
    assert parse_have_line("-e /work/main", "x") is None
    assert parse_have_line("# Editable Git install", "x") is None
    assert parse_have_line("foo @ file:///tmp/foo.whl", "x") == ("foo", None)
    with pytest.raises(Exception, match=r"f:3: 'torch==two' has an invalid version 'two'"):
        parse_have_line("torch==two", "f:3")
    with pytest.raises(Exception, match=r"--have torch>=2: 'torch>=2' is neither NAME==VERSION nor NAME"):
        parse_have_line("torch>=2", "--have torch>=2")


def test_read_have_takes_this_machines_version_for_a_bare_name(tmp_path):
    import numpy

    freeze = tmp_path / "freeze.txt"
    freeze.write_text("h5py==3.0.0\n-e /somewhere\nnot-installed-anywhere @ file:///x.whl\n")
    have = read_have(str(freeze), ["numpy"])
    assert have == {"h5py": "3.0.0", "numpy": numpy.__version__}
    with pytest.raises(Exception, match="no version given and not-installed-anywhere is not installed here"):
        read_have(None, ["not-installed-anywhere"])


def test_platform_tags():
    check_platforms(["manylinux_2_28_x86_64", "manylinux2014_x86_64", "linux_x86_64"])
    check_platforms(["macosx_11_0_arm64"])
    with pytest.raises(Exception, match="--platform linux-x86_64: unknown wheel platform tag"):
        check_platforms(["linux-x86_64"])
    with pytest.raises(Exception, match="tags for different operating systems"):
        check_platforms(["manylinux2014_x86_64", "win_amd64"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--platform", "manylinux_x86_64"],
            "error: --platform manylinux_x86_64: unknown wheel platform tag",
        ),
        (["--python-version", "312"], "error: --python-version 312: expected MAJOR.MINOR such as 3.12"),
        (
            ["--target-freeze", "/nonexistent/freeze.txt"],
            "error: --target-freeze /nonexistent/freeze.txt: no such",
        ),
        (
            ["--have", "torch>=2.4"],
            "error: --have torch>=2.4: 'torch>=2.4' is neither NAME==VERSION nor NAME",
        ),
    ],
)
def test_bad_input_is_one_line(tmp_path, args, message):
    line = one_line_error(bundle_cli("--out", str(tmp_path / "b"), *args))
    assert line.startswith(message), line
    assert not (tmp_path / "b").exists()


def test_refuses_a_folder_that_is_not_a_bundle(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    line = one_line_error(bundle_cli("--out", str(tmp_path)))
    assert line == f"error: --out {tmp_path}: folder is not empty and holds no {MANIFEST}; give a new or empty folder"
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_unknown_extra_is_one_line(tmp_path):
    line = one_line_error(bundle_cli("--out", str(tmp_path / "b"), "--extras", "wandb,nosuch"))
    assert line.startswith("error: --extras nosuch: wikipretrain has no such extra (it has: "), line
    assert "wandb" in line and "datasets" in line


@pytest.mark.slow
def test_requirement_without_a_wheel_is_one_line(tmp_path):
    """No pyyaml wheel for RISC-V on the index (and sdists are not bundled): one line naming it."""
    have = [
        "--have",
        "torch",
        "--have",
        "numpy",
        "--have",
        "h5py",
        "--have",
        "transformers",
        "--have",
        "tokenizers",
    ]
    res = bundle_cli("--out", str(tmp_path / "b"), "--platform", "manylinux_2_28_riscv64", *have)
    line = one_line_error(res)
    assert "pyyaml>=6.0 has no wheel for this target on the package index (sdists cannot be bundled)" in line
    assert not list((tmp_path / "b").glob("*"))


# --------------------------------------------------------------------------- build, offline install, CPU run


def target_has_folder(root: Path, missing: list[str]) -> Path:
    """Links to this environment's site-packages entries, less the distributions in ``missing``."""
    site = Path(distribution("pip").locate_file(""))
    skip = set()
    for dist in distributions(path=[str(site)]):
        if dist.metadata["Name"].lower() in missing:
            skip.update(f.parts[0] for f in dist.files or [] if not str(f).startswith(".."))
    assert len(skip) >= 2 * len(missing)
    out = root / "target-has"
    out.mkdir()
    for entry in site.iterdir():
        if entry.name in skip or entry.suffix == ".pth" or entry.name.startswith("__editable__"):
            continue
        (out / entry.name).symlink_to(entry)
    return out


def offline_env() -> dict[str, str]:
    """No pip configuration file, no PIP_* variable, no PYTHONPATH: only what the command line says."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bundle")
    res = run_python(["-m", "pip", "freeze"], env=dict(os.environ), fresh=True)
    assert res.returncode == 0, res.stderr[-3000:]
    freeze = res.stdout.splitlines()
    drop = {"wikipretrain", *MISSING}
    kept = [ln for ln in freeze if ln.split("==")[0].split(" @ ")[0].strip().lower() not in drop]
    assert len(kept) < len(freeze) and any(ln.startswith("torch==") for ln in kept)
    (root / "freeze.txt").write_text("\n".join(kept) + "\n")
    out = root / "wheels"
    res = bundle_cli("--out", str(out), "--target-freeze", str(root / "freeze.txt"), "--sample", "--build-backend")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "pip install --no-index --find-links" in res.stdout
    assert f"checked: pip --no-index --find-links {out} installs" in res.stderr
    return out


@pytest.mark.slow
def test_bundle_holds_what_the_target_lacks(bundle):
    manifest = json.loads((bundle / MANIFEST).read_text())
    names = {f["name"]: f for f in manifest["files"]}
    assert set(names) == {"wikipretrain", *MISSING, "enwiki-sample", "setuptools"}, sorted(names)
    assert names["setuptools"]["source"] == "build-backend"
    assert names["wikipretrain"]["source"] == "built" and names["deepspeed"]["source"] == "built"
    assert names["deepspeed"]["file"].endswith("-py3-none-any.whl")
    assert names["deepspeed"]["version"] == distribution("deepspeed").version.split("+")[0]
    assert names["hjson"]["source"] == "index"
    for f in manifest["files"]:
        data = (bundle / f["file"]).read_bytes()
        assert len(data) == f["size"] and hashlib.sha256(data).hexdigest() == f["sha256"], f["file"]
    assert manifest["total_bytes"] == sum(f["size"] for f in manifest["files"]) < 16 * 2**20
    assert manifest["target_has"]["torch"].startswith("2.")


@pytest.mark.slow
def test_offline_install_and_cpu_run(bundle, tmp_path, wiki_text_dir, wiki_vocab):
    env = offline_env()
    venv = tmp_path / "venv"
    res = run_python(["-m", "venv", "--without-pip", str(venv)], env=env, fresh=True)
    assert res.returncode == 0, res.stderr[-3000:]
    py = venv / "bin" / "python"
    res = run_python(
        ["-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], env=dict(os.environ), python=py
    )
    assert res.returncode == 0, res.stderr[-3000:]
    site = Path(res.stdout.strip())
    (site / "target_has.pth").write_text(str(target_has_folder(tmp_path, ["wikipretrain", *MISSING])) + "\n")
    pip = ["-m", "pip", "--python", str(py)]  # this interpreter's pip, installing into the venv

    # With no bundle and no index the project cannot be installed: nothing else is reachable.
    res = run_python([*pip, "install", "--no-index", "wikipretrain"], env=env, fresh=True)
    assert res.returncode != 0 and "No matching distribution found for wikipretrain" in res.stderr

    res = run_python([*pip, "install", "--no-index", "--find-links", str(bundle), "wikipretrain"], env=env, fresh=True)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    installed = {p.name.split("-")[0].lower() for p in site.glob("*.dist-info")}
    assert installed == {"wikipretrain", *MISSING}, sorted(installed)

    app = tmp_path / "app"  # train.py alone: everything it imports must come from the venv
    app.mkdir()
    shutil.copy2(REPO / "train.py", app / "train.py")
    code = "import training, deepspeed, hjson, data; print('FROM', training.__file__, deepspeed.__file__)"
    res = run_python(["-c", code], env=env, cwd=app, python=py)
    assert res.returncode == 0, res.stderr[-3000:]
    paths = res.stdout.split("FROM", 1)[1].split()
    assert len(paths) == 2 and all(p.startswith(str(site)) for p in paths), res.stdout
    res = run_python(["-m", "model", "list"], env=env, cwd=app, python=py)
    assert res.returncode == 0 and "bert-debug" in res.stdout, res.stderr[-3000:]

    text = tmp_path / "text"
    text.mkdir()
    first = sorted(Path(wiki_text_dir).glob("*.txt"))[0]
    shutil.copy2(first, text / first.name)
    shards = tmp_path / "shards"
    res = run_python(
        data_bert(text, wiki_vocab, shards, "--seq-len", "128", "--max-pred", "20", "--dupe-factor", "1"),
        env=env,
        cwd=app,
        python=py,
    )
    assert res.returncode == 0, res.stderr[-3000:]

    # The LANS C++ sources ship in the wheel (built on first use; AdamW below keeps this run compile-free).
    assert sorted(p.name for p in (site / "training" / "optim" / "csrc").glob("*.cpp")) == sorted(
        p.name for p in (REPO / "training" / "optim" / "csrc").glob("*.cpp")
    )
    # A private extension cache: the shared one is keyed by name, and this install's sources live elsewhere.
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "torch_extensions")
    run_dir = tmp_path / "run"
    res = run_python(
        [
            "train.py",
            "--config",
            str(REPO / "configs" / "smoke.yaml"),
            f"run.dir={run_dir}",
            f"data.train={shards}",
            f"data.eval={shards}",
            f"data.vocab={wiki_vocab}",
            "train.steps=2",
            "train.global_batch=4",
            "train.micro_batch=4",
            "logging.every=1",
            "checkpoint.every=0",
            "train.eval_every=0",
            "train.eval_samples=8",
            "optimizer.name=adamw",
        ],
        env=env,
        cwd=app,
        python=py,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["world_size"] == 1 and summary["model"] == "bert-debug"
    losses = [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert len(losses) == 2 and all(0 < v < 100 for v in losses)

    # scripts/gpu.sh's `pip install --no-deps -e .` of a checkout, offline: setuptools comes from the bundle.
    checkout = tmp_path / "checkout"
    shutil.copytree(
        REPO,
        checkout,
        ignore=shutil.ignore_patterns(".git", ".venv", "runs", "build", "*.egg-info", "__pycache__"),
    )
    res = run_python(
        [*pip, "install", "--no-index", "--find-links", str(bundle), "--no-deps", "-e", str(checkout)],
        env=env,
        fresh=True,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    res = run_python(["-c", "import training; print('FROM', training.__file__)"], env=env, cwd=app, python=py)
    assert res.returncode == 0 and res.stdout.split("FROM", 1)[1].strip() == str(checkout / "training" / "__init__.py")
