"""Learning-rate schedules against points computed by hand from the recipes' formulas."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from common.errors import UserError
from training.optim.schedules import SCHEDULES, build_scheduler, cosine_warmup, poly_warmup, warmup_constant_decay


@pytest.mark.parametrize(
    ("step", "expected"),
    [
        (1, 0.1),  # 0.01 / 0.1
        (5, 0.5),
        (10, math.sqrt(0.9)),  # NVIDIA: progress counts from 0, so warmup ends at (1 - 0.1)^0.5
        (19, 0.9),  # (1 - 0.19)^0.5
        (64, 0.6),  # (1 - 0.64)^0.5
        (100, 0.0),
        (150, 0.0),  # past the end: stays at 0
    ],
)
def test_poly_warmup(step: int, expected: float) -> None:
    assert poly_warmup(step, total_steps=100, warmup=0.1, degree=0.5) == pytest.approx(expected, abs=1e-12)


def test_poly_warmup_degree_one_is_linear() -> None:
    assert poly_warmup(75, total_steps=100, warmup=0.1, degree=1.0) == pytest.approx(0.25)


@pytest.mark.parametrize(
    ("step", "min_ratio", "expected"),
    [
        (5, 0.0, 0.5),  # warmup: 10 steps
        (10, 0.0, 1.0),
        (60, 0.0, 1.0),  # constant until 10 + 50
        (130, 0.0, 0.5),  # halfway through the 140 decay steps
        (130, 0.1, 0.55),
        (200, 0.0, 0.0),
        (200, 0.1, 0.1),
        (260, 0.1, 0.1),
    ],
)
def test_warmup_constant_decay(step: int, min_ratio: float, expected: float) -> None:
    got = warmup_constant_decay(step, total_steps=200, warmup=0.05, constant=0.25, min_ratio=min_ratio)
    assert got == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    ("step", "expected"),
    [
        (5, 0.5),
        (10, 1.0),
        (40, 0.775),  # 30/90 of the cosine: 0.1 + 0.9 * 0.5 * (1 + cos(pi/3))
        (55, 0.55),  # halfway: 0.1 + 0.9 * 0.5
        (100, 0.1),
        (120, 0.1),
    ],
)
def test_cosine_warmup(step: int, expected: float) -> None:
    assert cosine_warmup(step, total_steps=100, warmup=0.1, min_ratio=0.1) == pytest.approx(expected, abs=1e-12)


def test_build_scheduler_steps_and_state_round_trip() -> None:
    w = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([w], lr=2.0)
    sched = build_scheduler(opt, "poly_warmup", total_steps=100, warmup=0.1)
    seen = []
    for _ in range(12):
        seen.append(opt.param_groups[0]["lr"])  # the lr the optimizer step would use
        opt.step()
        sched.step()
    expected = [2.0 * poly_warmup(k, total_steps=100, warmup=0.1) for k in range(1, 13)]
    assert seen == pytest.approx(expected)
    # resume: a fresh scheduler loaded from the state dict continues with the same learning rates
    state = sched.state_dict()
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    sched2 = build_scheduler(opt2, "poly_warmup", total_steps=100, warmup=0.1)
    sched2.load_state_dict(state)
    sched.step()
    sched2.step()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == pytest.approx(2.0 * 0.86**0.5)


def test_bad_arguments_are_user_errors() -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(UserError, match="kind"):
        build_scheduler(opt, "linear-ish", total_steps=10, warmup=0.1)
    with pytest.raises(UserError, match="total_steps"):
        build_scheduler(opt, "cosine_warmup", total_steps=0, warmup=0.1)
    with pytest.raises(UserError, match="warmup"):
        build_scheduler(opt, "poly_warmup", total_steps=10, warmup=1.5)
    with pytest.raises(UserError, match="warmup \\+ constant"):
        build_scheduler(opt, "warmup_constant_decay", total_steps=10, warmup=0.5, constant=0.6)
    with pytest.raises(UserError, match="cosine_warmup"):
        build_scheduler(opt, "cosine_warmup", total_steps=10, warmup=0.1, degree=2.0)


def test_plot_all_three(tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image
    import matplotlib.pyplot as plt

    total = 1000
    kw = {
        "poly_warmup": {"warmup": 0.1},
        "warmup_constant_decay": {"warmup": 0.05, "constant": 0.25},
        "cosine_warmup": {"warmup": 0.01, "min_ratio": 0.1},
    }
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for kind, fn in SCHEDULES.items():
        ys = [fn(s, total_steps=total, **kw[kind]) for s in range(1, total + 1)]
        assert max(ys) == pytest.approx(1.0, abs=0.02) and min(ys) >= 0.0
        ax.plot(range(1, total + 1), ys, label=kind)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("lr / peak lr")
    ax.legend()
    out = tmp_path / "schedules.png"
    fig.savefig(out, dpi=80)
    plt.close(fig)
    assert out.exists() and out.stat().st_size > 1000
    assert matplotlib.image.imread(out).shape[:2] == (280, 480)
