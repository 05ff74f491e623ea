"""[metrics] enable_wandb: the TensorBoard scalars, read back from wandb's offline run files.

wandb runs offline (WANDB_MODE=offline) into tmp_path; the run file (``run-<id>.wandb``) is
read back record by record and its history compared with the TensorBoard event file that the
same logger wrote: same names, same steps, same values (TensorBoard keeps float32).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("wandb")

from titanext.components.metrics import MetricsLogger  # noqa: E402


@pytest.fixture
def offline(tmp_path, monkeypatch):
    folder = tmp_path / "wandb_dir"
    for key, value in (("WANDB_MODE", "offline"), ("WANDB_DIR", str(folder)),
                       ("WANDB_SILENT", "true"), ("WANDB_PROJECT", "titanext-tests")):
        monkeypatch.setenv(key, value)
    return folder


def wandb_history(folder: Path, run: str = "offline-run-*") -> dict[int, dict[str, float]]:
    """step -> scalars of the one offline ``run`` under ``folder``, from its .wandb file: a W&B
    header (7 bytes) then LevelDB-log records (crc, length, type) in 32 KiB blocks, each a
    ``Record`` protobuf. wandb's service process may still be writing the file when
    ``finish()`` returns (seen under load), so read until its closing ``exit`` record is there."""
    [path] = folder.glob(f"wandb/{run}/run-*.wandb")
    deadline = time.monotonic() + 60
    while True:
        records = _records(path.read_bytes())
        if any(r.WhichOneof("record_type") == "exit" for r in records) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    history: dict[int, dict[str, float]] = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                   for item in record.history.item}
            history.setdefault(int(row["_step"]), {}).update(
                {k: v for k, v in row.items() if not k.startswith("_")})
    return history


def _records(data: bytes) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    assert data[:4] == b":W&B"
    records = []
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if pos + 7 + length > len(data):
            break  # a record still being written
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk  # FULL / FIRST, then MIDDLE ... LAST
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            records.append(record)
    return records


def tensorboard_scalars(folder: Path) -> dict[int, dict[str, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    out: dict[int, dict[str, float]] = {}
    for tag in events.Tags()["scalars"]:
        for e in events.Scalars(tag):
            out.setdefault(e.step, {})[tag] = e.value
    return out


def log_a_run(tmp_path, *, active: bool) -> None:
    logger = MetricsLogger(job_dir=tmp_path / "job", rank=0 if active else 1,
                           is_logging_rank=active, log_freq=2, total_steps=5,
                           enable_tensorboard=True, enable_wandb=True, device=torch.device("cpu"),
                           wandb_config={"training": {"steps": 5}}, stream=open(os.devnull, "w"))
    for step in range(1, 6):
        logger.record_tokens(1000)
        logger.log(step, loss=torch.tensor(5.0 / step), grad_norm=1.5 + step / 7, lr=1e-3 * step,
                   extra={"mtp_loss": 0.25 * step}, tb_extra={"moe/layer0": step / 3})
        if step == 4:  # as the trainer does: after the step's line (wandb steps never go back)
            logger.log_validation(4, loss=2.5, perplexity=12.18, tokens=64, seconds=0.1)
    logger.close()
    logger.close()  # twice is safe


def test_wandb_gets_the_tensorboard_scalars_at_the_same_steps(tmp_path, offline):
    log_a_run(tmp_path, active=True)
    tb = tensorboard_scalars(tmp_path / "job" / "tb")
    wb = wandb_history(offline)
    assert sorted(tb) == sorted(wb) == [1, 2, 4, 5]
    assert {"loss", "grad_norm", "lr", "tps", "mtp_loss", "moe/layer0",
            "validation/loss"} <= set(tb[4])
    for step in tb:
        assert set(wb[step]) == set(tb[step]), step
        for name, value in tb[step].items():  # TensorBoard stores float32
            assert value == torch.tensor(wb[step][name], dtype=torch.float32).item(), (step, name)
    assert wb[5]["loss"] == 1.0 and wb[4]["validation/perplexity"] == 12.18


def test_only_the_logging_rank_starts_a_run(tmp_path, offline):
    log_a_run(tmp_path, active=False)
    assert not offline.exists() or not list(offline.rglob("*.wandb"))
    assert not (tmp_path / "job").exists()


def test_wandb_files_go_under_the_job_folder_without_wandb_dir(tmp_path, offline, monkeypatch):
    monkeypatch.delenv("WANDB_DIR")
    log_a_run(tmp_path, active=True)
    assert list((tmp_path / "job").glob("wandb/offline-run-*/run-*.wandb"))


def test_a_missing_wandb_is_one_config_line_and_exit_2(monkeypatch, capsys):
    import importlib.util

    from titanext.config import ConfigError, load_config
    from titanext.train import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--metrics.enable_wandb=true"])
    assert e.value.problems == ["metrics.enable_wandb = True needs the wandb package, which is "
                                "not installed; pip install 'titanext[wandb]' or set "
                                "enable_wandb = false"]
    assert main(["--metrics.enable_wandb=true", "--training.steps=1"]) == 2
    assert "pip install 'titanext[wandb]'" in capsys.readouterr().err
