"""MetricsLogger, the peak-FLOPs table and format_table: fast CPU specifications."""

from __future__ import annotations

import doctest
import io
import re
import types

import pytest
import torch

import titanext.components.metrics as metrics_mod
from titanext._text import format_table
from titanext.components.metrics import MetricsLogger, device_peak_flops, peak_flops_for_name

CPU = torch.device("cpu")


def make_logger(tmp_path, **kw) -> MetricsLogger:
    args = dict(job_dir=tmp_path, rank=0, is_logging_rank=True, log_freq=10, total_steps=100,
                enable_tensorboard=False, device=CPU, flops_per_token=6e6, num_devices=2)
    args.update(kw)
    return MetricsLogger(**args)


class FakeClock:
    """Stands in for ``time`` in titanext.components.metrics, so throughput is exact."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(metrics_mod, "time", types.SimpleNamespace(perf_counter=fake.perf_counter))
    return fake


class TtyStream(io.StringIO):
    def isatty(self) -> bool:
        return True


# -- the console line ---------------------------------------------------------------------------

def test_log_line_has_every_field(tmp_path, capsys, clock):
    logger = make_logger(tmp_path)
    clock.now = 2.0
    logger.record_tokens(8192)
    logger.log(1, loss=5.123456, grad_norm=0.98765, lr=3e-4, extra={"expert_load_max_mean": 1.3})
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.endswith("\n")
    assert re.search(r"step\s+1/100", out)
    assert "loss 5.1235" in out  # at least 4 significant digits
    assert "grad_norm 0.9877" in out
    assert "lr 3.000e-04" in out
    assert "tps 4,096 (2,048/device)" in out  # 8192 tokens in 2 s on 2 devices
    assert "mfu n/a" in out  # a CPU has no tabled peak
    assert re.search(r"memory rss \d+\.\d\d GiB", out)
    assert "expert_load_max_mean 1.3" in out
    assert "\033[" not in out and "\r" not in out  # not a terminal: plain text


def test_small_losses_keep_four_significant_digits(tmp_path, capsys):
    make_logger(tmp_path).log(1, loss=0.0012345, grad_norm=None, lr=None)
    out = capsys.readouterr().out
    assert "loss 1.2345e-03" in out
    assert "grad_norm" not in out and " lr " not in out


def test_lines_only_on_first_every_log_freq_and_last_step(tmp_path, capsys):
    logger = make_logger(tmp_path, log_freq=10, total_steps=25)
    logged = [s for s in range(1, 26)
              if logger.log(s, loss=1.0, grad_norm=1.0, lr=1e-3) is not None]
    assert logged == [1, 10, 20, 25]
    assert capsys.readouterr().out.count("\n") == 4


def test_tensor_values_are_accepted(tmp_path, capsys):
    out = make_logger(tmp_path).log(1, loss=torch.tensor(2.5), grad_norm=torch.tensor(1.0), lr=1e-3,
                                    extra={"aux": torch.tensor(0.25)})
    assert out["loss"] == 2.5 and out["aux"] == 0.25
    assert "loss 2.5000" in capsys.readouterr().out


def test_tb_extra_goes_to_tensorboard_only(tmp_path, capsys):
    """Per-layer scalars (e.g. moe_load/<block>) are written and returned but not printed."""
    out = make_logger(tmp_path).log(1, loss=1.0, extra={"moe_load": 1.5},
                                    tb_extra={"moe_load/layers.1.moe": torch.tensor(1.25)})
    assert out["moe_load/layers.1.moe"] == 1.25 and out["moe_load"] == 1.5
    line = capsys.readouterr().out
    assert "moe_load 1.5" in line and "layers.1" not in line


def test_a_nonzero_logging_rank_prefixes_its_lines(tmp_path, capsys):
    make_logger(tmp_path, rank=3).log(1, loss=1.0, grad_norm=1.0, lr=1e-3)
    assert capsys.readouterr().out.startswith("[rank 3] step")


def test_bad_log_freq_names_the_fix(tmp_path):
    with pytest.raises(ValueError, match="log_freq = 0: must be >= 1"):
        make_logger(tmp_path, log_freq=0)


# -- throughput and MFU -------------------------------------------------------------------------

def test_mfu_from_a_fake_peak(tmp_path, clock):
    logger = make_logger(tmp_path, flops_per_token=1e6, num_devices=2, peak_flops=1e9)
    clock.now = 2.0
    logger.record_tokens(1000)
    m = logger.log(1, loss=1.0, grad_norm=1.0, lr=1e-3)
    tps_per_device = 1000 / 2.0 / 2
    assert m["tps"] == 500 and m["tps_per_device"] == tps_per_device
    assert m["mfu_pct"] == pytest.approx(100 * 1e6 * tps_per_device / 1e9)  # 25 %


def test_throughput_is_per_log_window_so_warmup_stays_in_step_1(tmp_path, clock):
    logger = make_logger(tmp_path, log_freq=2, num_devices=1)
    clock.now = 10.0  # a slow first step: allocation, compilation
    logger.record_tokens(100)
    assert logger.log(1, loss=1.0, grad_norm=1.0, lr=1e-3)["tps"] == 10
    clock.now = 11.0
    logger.record_tokens(100)
    m = logger.log(2, loss=1.0, grad_norm=1.0, lr=1e-3)
    assert m["tps"] == 100 and m["step_time_s"] == 1.0


def test_no_mfu_without_flops_per_token(tmp_path):
    m = make_logger(tmp_path, flops_per_token=None, peak_flops=1e12).log(1, loss=1.0)
    assert "mfu_pct" not in m


def test_peak_table_by_device_name(monkeypatch):
    assert peak_flops_for_name("NVIDIA H100 80GB HBM3") == 989.4e12
    assert peak_flops_for_name("NVIDIA H100 PCIe") == 756.5e12
    assert peak_flops_for_name("NVIDIA H200") == 989.4e12
    assert peak_flops_for_name("NVIDIA H20") == 148e12  # not mistaken for an H200
    assert peak_flops_for_name("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_for_name("NVIDIA B200") == 2.25e15
    assert peak_flops_for_name("NVIDIA L40S") == 362.05e12
    assert peak_flops_for_name("NVIDIA A10G") is None  # no datasheet figure: unknown, not guessed
    assert peak_flops_for_name("Some Future GPU") is None
    assert peak_flops_for_name("NVIDIA H100 80GB HBM3", torch.float16) == 989.4e12
    assert peak_flops_for_name("NVIDIA H100 80GB HBM3", torch.float8_e4m3fn) == 2 * 989.4e12
    assert peak_flops_for_name("NVIDIA A100-SXM4-80GB", torch.float8_e4m3fn) is None  # no fp8 units
    monkeypatch.setattr(metrics_mod, "_tf32_enabled", lambda: False)
    assert peak_flops_for_name("NVIDIA A100-SXM4-80GB", torch.float32) is None
    monkeypatch.setattr(metrics_mod, "_tf32_enabled", lambda: True)
    assert peak_flops_for_name("NVIDIA A100-SXM4-80GB", torch.float32) == 156e12


def test_cpu_has_no_peak():
    assert device_peak_flops(CPU) is None
    assert device_peak_flops(CPU, torch.float32) is None


# -- TensorBoard and ranks ----------------------------------------------------------------------

def test_tensorboard_events_hold_every_scalar(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = make_logger(tmp_path, enable_tensorboard=True, tb_folder="tb", peak_flops=1e12,
                         log_freq=1, total_steps=3)
    for step in (1, 2, 3):
        logger.record_tokens(64)
        logger.log(step, loss=3.0 / step, grad_norm=1.0, lr=1e-3,
                   extra={"expert_load_max_mean": 1.3})
    logger.close()
    logger.close()  # idempotent
    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss", "grad_norm", "lr", "tps", "tps_per_device", "mfu_pct", "memory/rss_gib",
            "expert_load_max_mean"} <= tags
    assert [e.step for e in acc.Scalars("loss")] == [1, 2, 3]
    assert acc.Scalars("loss")[-1].value == pytest.approx(1.0)


def test_non_logging_rank_writes_and_prints_nothing(tmp_path, capsys):
    logger = make_logger(tmp_path, rank=1, is_logging_rank=False, enable_tensorboard=True,
                         log_freq=1, total_steps=2)
    for step in (1, 2):
        logger.record_tokens(64)
        assert logger.log(step, loss=1.0, grad_norm=1.0, lr=1e-3) is None
    logger.close()
    assert list(tmp_path.iterdir()) == []
    assert capsys.readouterr() == ("", "")


# -- progress bar -------------------------------------------------------------------------------

def test_no_progress_bar_when_stdout_is_not_a_tty(tmp_path, capsys):
    logger = make_logger(tmp_path, log_freq=5, total_steps=10)
    for step in range(1, 5):  # step 1 logs, 2..4 would only draw the bar
        logger.log(step, loss=1.0, grad_norm=1.0, lr=1e-3)
    logger.close()
    out = capsys.readouterr().out
    assert "\r" not in out and "ETA" not in out and "\033" not in out
    assert out.count("\n") == 1


def test_progress_bar_on_a_terminal_is_cleared_before_each_line(tmp_path, clock, monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    stream = TtyStream()
    logger = make_logger(tmp_path, log_freq=3, total_steps=6, stream=stream)
    for step in range(1, 7):
        clock.now = float(step)
        logger.log(step, loss=1.0, grad_norm=1.0, lr=1e-3)
    logger.close()
    text = stream.getvalue()
    assert "ETA 0m03s" in text  # one second a step, measured from step 1, three steps left at 3
    assert "ETA ?" in text  # after the first step there is no rate yet
    lines = text.split("\n")
    # Every log line starts on a cleared line, after the bar that was on it.
    assert all(line.startswith("\r[") for line in lines[1:-1])
    assert lines[0].startswith("\033[36mstep 1/6")  # no bar yet, nothing to clear
    assert sum("\r\033[K\033[36mstep" in line for line in lines) == 2  # steps 3 and 6
    assert text.endswith("\n")  # no bar after the last step
    assert "\033[32mloss" in text  # coloured on a terminal


def test_color_false_keeps_the_bar_but_drops_colours(tmp_path):
    stream = TtyStream()
    logger = make_logger(tmp_path, log_freq=3, total_steps=6, stream=stream, color=False)
    for step in range(1, 3):
        logger.log(step, loss=1.0, grad_norm=1.0, lr=1e-3)
    logger.close()
    text = stream.getvalue()
    assert "ETA" in text and "\033[3" not in text
    assert text.endswith("\r\033[K")  # close() wipes the bar it left mid-run


# -- format_table -------------------------------------------------------------------------------

def test_format_table_aligns_numbers_right_and_text_left():
    rows = [{"config": "fsdp", "tps": 123456.7, "mfu": 41.234, "ok": True},
            {"config": "fsdp+tp+cp", "tps": 9.5, "mfu": None, "ok": False}]
    lines = format_table(rows).splitlines()
    assert lines[0].split() == ["config", "tps", "mfu", "ok"]
    assert set(lines[1]) == {"-", " "}
    assert lines[2].startswith("fsdp        ")  # text: left-aligned
    tps_end = lines[0].index("tps") + len("tps")
    assert all(line[:tps_end].endswith(v) for line, v in zip(lines[2:], ("123457", "9.500")))
    assert lines[3].split() == ["fsdp+tp+cp", "9.500", "False"]  # None is an empty cell
    # Every row's columns start at the header's column starts.
    starts = [m.start() for m in re.finditer(r"-+", lines[1])]
    assert starts == [0, 12, 20, 27]


def test_format_table_column_choice_and_union_of_keys():
    rows = [{"a": 1}, {"b": "x", "a": 22}]
    assert format_table(rows).splitlines() == [" a  b", "--  -", " 1", "22  x"]
    assert format_table(rows, columns=["b"]).splitlines() == ["b", "-", "", "x"]
    assert format_table([]) == ""


def test_format_table_markdown():
    table = format_table([{"name": "fsdp", "tps": 10}], markdown=True)
    assert table.splitlines() == ["| name | tps |", "|:-----|----:|", "| fsdp |  10 |"]


def test_docstring_examples_run():
    result = doctest.testmod(metrics_mod, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
