"""[training] dataset = "hf": a datasets split streamed through load_dataset(streaming=True).

The reference is the simplest possible: the documents packed by hand (each one's ids, then EOS)
and cut into windows, and several simulated data-parallel ranks called in lockstep.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("datasets")

from tests.unit.test_data import global_stream  # noqa: E402
from tests.unit.test_data_sources import _problems  # noqa: E402
from titanext.data import build_dataloader  # noqa: E402
from titanext.data.tokenizer import ByteTokenizer  # noqa: E402
from titanext.errors import ConfigError  # noqa: E402

TOK = ByteTokenizer()
SEQ = 8
DOCS = [f"document {i} " + "xyz" * (i % 5) for i in range(60)]


def write(folder, kind, docs=DOCS, field="text"):
    """``docs`` as a .jsonl file or as two .parquet files in a folder (datasets reads the
    folder's files in order); returns the dataset_path."""
    if kind == "jsonl":
        path = folder / "corpus.jsonl"
        path.write_text("".join(json.dumps({field: d, "id": i}) + "\n"
                                for i, d in enumerate(docs)), encoding="utf-8")
        return path
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = folder / "parquet"
    path.mkdir()
    half = len(docs) // 2
    for n, part in enumerate((docs[:half], docs[half:])):
        pq.write_table(pa.table({field: part}), path / f"part-{n}.parquet")
    return path


def make(path, *, batch=2, rank=0, degree=1, seed=0, shuffle=True, **kw):
    return build_dataloader(dataset="hf", dataset_path=str(path), tokenizer=TOK, seq_len=SEQ,
                            local_batch_size=batch, dp_rank=rank, dp_degree=degree, seed=seed,
                            shuffle=shuffle, block_tokens=40, **kw)


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_an_unshuffled_split_is_the_documents_packed_and_cut_into_windows(tmp_path, kind):
    path = write(tmp_path, kind)
    stream = [t for d in DOCS for t in TOK.encode(d, eos=True)]
    per_epoch = (len(stream) - 1) // SEQ
    windows = [stream[w * SEQ:w * SEQ + SEQ + 1] for w in range(per_epoch)]
    expected = torch.tensor(windows + windows[:10])  # into the second epoch
    got = global_stream([make(path, batch=per_epoch + 10, shuffle=False)], 1)
    assert torch.equal(got[:, 0], expected[:, :-1]) and torch.equal(got[:, 1], expected[:, 1:])


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_state_saved_at_dp2_resumes_the_same_global_stream_at_dp1_and_dp4(tmp_path, kind):
    path = write(tmp_path, kind)
    total_steps, saved_after = 14, 5  # 8 windows a step, ~70 a epoch: past an epoch's end
    expected = global_stream([make(path, batch=8, seed=3)], total_steps)

    before = [make(path, batch=4, rank=r, degree=2, seed=3) for r in range(2)]
    head = global_stream(before, saved_after)
    state = json.loads(json.dumps(before[0].state_dict()))  # plain values survive JSON
    assert before[1].state_dict() == state  # one state for all ranks
    assert state["stream"]["cursor"][1] > 0  # mid-split: the resume skips to an example
    for degree in (1, 4):
        after = [make(path, batch=8 // degree, rank=r, degree=degree, seed=3)
                 for r in range(degree)]
        for loader in after:
            loader.load_state_dict(state)
        tail = global_stream(after, total_steps - saved_after)
        assert torch.equal(torch.cat([head, tail]), expected), degree


def test_the_state_refuses_another_split_or_corpus(tmp_path):
    folder = tmp_path / "splits"  # datasets names a folder's splits after its files
    folder.mkdir()
    for split, docs in (("train", DOCS), ("test", DOCS[:-1])):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n"
                                                       for d in docs), encoding="utf-8")
    loader = make(folder)
    loader.next_batch()
    state = loader.state_dict()
    for other in (make(folder, dataset_split="test"), make(write(tmp_path, "jsonl", DOCS[:-1]))):
        with pytest.raises(ValueError, match="another corpus"):
            other.load_state_dict(state)


def test_the_config_picks_the_training_and_validation_splits(tmp_path):
    from titanext.config import load_config
    from titanext.data import dataloader_from_config

    folder = tmp_path / "splits"
    folder.mkdir()
    for split, docs in (("train", DOCS[:30]), ("test", DOCS[30:])):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps({"body": d}) + "\n"
                                                       for d in docs), encoding="utf-8")
    cfg = load_config(None, [f"--training.seq_len={SEQ}", "--training.dataset=hf",
                             f"--training.dataset_path={folder}", "--training.shuffle=false",
                             "--training.dataset_text_field=body", "--validation.enable=true",
                             "--validation.dataset=hf", f"--validation.dataset_path={folder}",
                             "--validation.dataset_split=test", "--validation.local_batch_size=3"])
    for docs, loader in ((DOCS[:30], dataloader_from_config(cfg.training, TOK, 0, 1)),
                         (DOCS[30:], dataloader_from_config(cfg.training, TOK, 0, 1,
                                                            validation=cfg.validation))):
        stream = [t for d in docs for t in TOK.encode(d, eos=True)][:3 * SEQ + 1]
        inputs, _ = loader.next_batch()
        assert inputs[:3].flatten().tolist() == stream[:3 * SEQ]


def test_a_missing_text_field_or_split_is_one_line_before_training(tmp_path):
    path = write(tmp_path, "jsonl", field="body")
    with pytest.raises(ConfigError, match=r"example 0 has no 'text' field \(it has 'body', "
                                          r"'id'\); set training.dataset_text_field") as e:
        make(path)
    assert "\n" not in str(e.value)
    make(path, text_field="body")
    numbers = tmp_path / "numbers.jsonl"
    numbers.write_text('{"text": null}\n{"text": 7}\n', encoding="utf-8")
    with pytest.raises(ConfigError, match=r"example 1 field 'text' is a int, not text"):
        make(numbers)  # the null example 0 is skipped, as the text source skips it
    with pytest.raises(ConfigError, match=r"split 'test': datasets.load_dataset failed: .*test"
                       ) as e:
        make(path, text_field="body", dataset_split="test")
    assert "\n" not in str(e.value)


# -- config rules at load -----------------------------------------------------------------------


def test_config_load_names_a_missing_path_or_a_missing_datasets_package(tmp_path, monkeypatch):
    path = write(tmp_path, "parquet")
    hf = ["--training.dataset=hf", f"--training.dataset_path={path}"]
    assert _problems(hf) == []
    assert _problems([*hf, "--training.dataset_name=en", "--training.dataset_split=validation"]
                     ) == []
    missing = str(tmp_path / "nope.jsonl")
    [problem] = _problems(["--training.dataset=hf", f"--training.dataset_path={missing}"])
    assert problem.startswith(f"training.dataset_path = {missing!r} does not exist")
    [problem] = _problems(["--training.dataset=hf"])
    assert problem.startswith("training.dataset = 'hf' needs training.dataset_path")
    assert _problems(["--training.dataset=hf", "--training.dataset_path=allenai/c4"]) == []
    [problem] = _problems(["--training.dataset_name=en"])
    assert problem == ("training.dataset_name = 'en' is only read with dataset = 'hf', but "
                       "training.dataset = 'shakespeare'; set dataset = 'hf' or "
                       'dataset_name = ""')

    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "datasets" else real(name, *a))
    assert _problems(hf) == ["training.dataset = 'hf' needs the datasets package, which is not "
                             "installed; pip install 'titanext[datasets]'"]
