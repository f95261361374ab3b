"""One parser for RAM budgets: the API, the bench CLIs and ``sizes.parse_budget`` give the same bytes or the same error.

A budget is bytes (``1024``, ``"8GiB"``) or a share of the optimizer state's
size (``"1/8"``, ``"12.5%"``, ``0.125``). ``TieredAdamW(ram_budget=)`` resolves a
share against its state (here fp32 moments: 8 bytes per parameter), ``tierstore
bench step --ram-budget`` against its estimate, ``bench/overlap.py --ram-budget``
against its MLP's moments, ``tierstore demo --ram-budget`` against its model's. The bench errors name the flag (``--ram-budget``)
instead of the argument (``ram_budget``); the rest of the message is the same.
"""

from __future__ import annotations

import pytest
import torch

from tierstore import TieredAdamW
from tierstore.cli import main
from tierstore.cli.bench import overlap, step
from tierstore.cli.demo.model import ModelConfig, TinyGPT
from tierstore.cli.demo.run import state_nbytes, train
from tierstore.errors import BudgetError, ConfigError
from tierstore.sizes import parse_budget

NUMEL = 1 << 16  # one fp32 parameter of 64 Ki elements: 512 KiB of moments, 1/8 of it holds the arena
STATE = NUMEL * 8

GOOD = [("1/8", STATE // 8), ("12.5%", STATE // 8), (0.125, STATE // 8), ("8GiB", 8 << 30), (1024, 1024)]
BAD = ["1/0", "-1", "150%", "abc", True]


def _through_bench(value: object) -> dict[str, int | str]:
    """The bench parsers' answers, each as bytes or its error message with the flag named as the API names it."""
    out: dict[str, int | str] = {}
    for name, parse in (("step", lambda v: step._parse_budget(v, STATE)), ("overlap", lambda v: overlap._budget(v, NUMEL))):
        try:
            out[name] = parse(value)
        except ConfigError as e:
            out[name] = str(e).replace("--ram-budget", "ram_budget", 1)
    return out


def _through_sizes(value: object) -> int | str:
    try:
        return parse_budget(value, state_bytes=STATE)
    except ConfigError as e:
        return str(e)


def _through_api(value: object) -> int | str:
    """The budget ``TieredAdamW`` resolved, or its error message (a budget too small to stream: its bytes)."""
    w = torch.nn.Parameter(torch.zeros(NUMEL))
    try:
        with TieredAdamW([w], ram_budget=value) as opt:
            return opt.plan.ram_budget
    except BudgetError as e:
        return f"too small: {e}"
    except ConfigError as e:
        return str(e)


@pytest.mark.parametrize(("value", "expected"), GOOD, ids=[repr(v) for v, _ in GOOD])
def test_every_entry_point_gives_the_same_bytes(value: object, expected: int) -> None:
    assert _through_sizes(value) == expected
    assert _through_bench(value) == {"step": expected, "overlap": expected}
    # The CLIs get text: the same value written on a command line is the same budget.
    assert _through_bench(str(value)) == {"step": expected, "overlap": expected}
    got = _through_api(value)
    if expected == 1024:  # too small for any arena: the constructor names the same bytes
        assert isinstance(got, str) and got.startswith("too small") and "(1024 bytes)" in got, got
    else:
        assert got == expected


@pytest.mark.parametrize("value", BAD, ids=[repr(v) for v in BAD])
def test_every_entry_point_gives_the_same_error(value: object) -> None:
    message = _through_sizes(value)
    assert isinstance(message, str) and f"ram_budget={value!r}" in message, message
    assert "give" in message or "write it like" in message, f"no fix in {message!r}"
    assert _through_api(value) == message
    assert _through_bench(value) == {"step": message, "overlap": message}


def test_a_share_that_divides_by_zero_is_a_config_error_in_the_overlap_bench() -> None:
    """bench/overlap.py raised a raw ZeroDivisionError on "1/0"."""
    with pytest.raises(ConfigError, match=r"--ram-budget='1/0' divides by zero; give a share in \(0, 1\]"):
        overlap._budget("1/0", NUMEL)
    assert overlap._budget("none", NUMEL) is None


@pytest.mark.parametrize("value", ["1/8", "12.5%", 0.125, "0.125"])
def test_the_demo_reads_a_share_of_its_model_state(value: object) -> None:
    """``tierstore demo --ram-budget 0.125`` was read as 0 bytes and ``1/8`` refused: its own parser."""
    config = ModelConfig(d_model=64, n_layer=1)
    r = train(steps=1, state_dir=None, ram_budget=value, config=config, batch_size=2)
    assert r.ram_budget == state_nbytes(TinyGPT(config)) // 8 > 0
    assert r.losses == r.reference_losses


@pytest.mark.parametrize("value", ["1/0", "-1", "150%", "abc"])
def test_the_demo_refuses_a_bad_budget_as_the_api_does(value: str, capsys: pytest.CaptureFixture, tmp_path) -> None:
    assert main(["demo", "--steps", "1", "--ram-budget", value, "--state-dir", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert _through_sizes(value).replace("ram_budget", "--ram-budget", 1) in err, err
    assert not (tmp_path / "s").exists()  # refused before anything was made
