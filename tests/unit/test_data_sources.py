"""The streaming text source, pre-tokenized shards, the tokenize CLI and document ids.

References are the simplest possible: the whole corpus read into memory with load_documents and
packed by hand, and several simulated data-parallel ranks called in lockstep.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from titanext.data import (
    build_dataloader,
    check_dataset,
    document_ids,
    document_positions,
    load_documents,
    readers,
)
from titanext.data.pretokenize import tokenize_corpus
from titanext.data.tokenizer import ByteTokenizer
from titanext.data.tokens import permute
from titanext.errors import ConfigError
from titanext.launch.data import main

TOK = ByteTokenizer()
EOS, BOS = TOK.eos_id, TOK.bos_id
SEQ = 8


def make(dataset, path, *, batch=2, rank=0, degree=1, seed=0, shuffle=True, block_tokens=40,
         **kw):
    return build_dataloader(dataset=dataset, dataset_path=str(path), tokenizer=TOK, seq_len=SEQ,
                            local_batch_size=batch, dp_rank=rank, dp_degree=degree, seed=seed,
                            shuffle=shuffle, block_tokens=block_tokens, **kw)


def global_stream(loaders, steps):
    """Lockstep batches of ``loaders`` (one per dp rank), concatenated in rank order:
    [steps * global_batch, 2, seq]."""
    rows = []
    for _ in range(steps):
        for loader in loaders:
            inputs, labels = loader.next_batch()[:2]
            rows.append(torch.stack([inputs, labels], dim=1))
    return torch.cat(rows)


def ranks(dataset, path, degree, batch, **kw):
    return [make(dataset, path, batch=batch, rank=r, degree=degree, **kw) for r in range(degree)]


def packed(path, field="text"):
    """The unshuffled token stream, the simple way."""
    docs = load_documents("text", str(path), field)
    return [t for doc in docs for t in TOK.encode(doc, eos=True)]


def reference_windows(tokens, epochs):
    n = (len(tokens) - 1) // SEQ
    one = [tokens[i * SEQ : i * SEQ + SEQ + 1] for i in range(n)]
    return torch.tensor(one * epochs)


@pytest.fixture
def small_chunks(monkeypatch):
    """Cut .txt files into ~64-byte units, so one file spans many units and blocks."""
    monkeypatch.setattr(readers, "TXT_CHUNK_BYTES", 64)


@pytest.fixture
def corpus(tmp_path, small_chunks):
    """A folder with a jsonl, a long multi-chunk txt (with multi-byte characters), a parquet file
    when pyarrow is installed, and a file of another suffix that is skipped."""
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    docs = [{"text": f"doc {i}: " + "xyz" * (i % 5), "id": i} for i in range(12)]
    (root / "a.jsonl").write_text("\n".join(json.dumps(d) for d in docs) + "\n\n", encoding="utf-8")
    lines = [f"line {i} {'é' * (i % 3)} {'w' * (i % 7)}" + ("\n  indented" if i % 4 == 0 else "")
             for i in range(40)]
    (root / "b.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (root / "notes.md").write_text("skipped", encoding="utf-8")
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        (root / "sub" / "c.txt").write_text("no parquet here", encoding="utf-8")
    else:
        table = pa.table({"text": [f"row {i} " + "q" * i for i in range(9)] + [None, "  "],
                          "n": list(range(11))})
        pq.write_table(table, root / "sub" / "c.parquet", row_group_size=4)
    return root


# -- readers -----------------------------------------------------------------------------------
def test_long_txt_files_are_cut_at_line_starts_and_resume_at_any_chunk(tmp_path, small_chunks):
    text = "".join(f"{'ü' * (i % 4)} line {i}\n" + ("\n   \n" if i % 5 == 0 else "")
                   for i in range(60)) + "x" * 150  # and one line longer than a chunk
    path = tmp_path / "long.txt"
    path.write_text(text, encoding="utf-8")
    units = list(readers.read_units(path))
    assert len(units) > 10 and "".join(u.text for u in units) == text
    assert [u.ends_document for u in units] == [False] * (len(units) - 1) + [True]
    for u in units[1:]:
        before = text.encode()[: u.offset]
        if before.endswith(b"\n"):  # a cut at a line start: the next line starts with a word
            assert not u.text[0].isspace()
    for k, u in enumerate(units):
        assert list(readers.read_units(path, offset=u.offset)) == units[k:]


def test_a_jsonl_file_reads_the_configured_field(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"body": "one"}\n{"body": "two!", "text": "not this"}\n', encoding="utf-8")
    assert load_documents("text", str(path), "body") == ["one", "two!"]
    loader = make("text", path, shuffle=False, batch=1, text_field="body")
    assert loader.next_batch()[0].tolist() == [[*b"one", EOS, *b"two!"]]


# -- the streaming text source ----------------------------------------------------------------
def test_unshuffled_stream_is_the_packed_corpus_cut_into_windows_each_epoch(corpus):
    tokens = packed(corpus)
    n = (len(tokens) - 1) // SEQ
    assert n > 20  # many blocks of 5 windows, and a dropped tail
    got = global_stream([make("text", corpus, shuffle=False, batch=7)], 2 * n // 7 + 3)
    expected = reference_windows(tokens, 3)[: len(got)]
    assert torch.equal(got[:, 0], expected[:, :-1]) and torch.equal(got[:, 1], expected[:, 1:])


def test_each_shuffled_epoch_is_a_reordering_of_the_same_windows(corpus):
    # One file (of many units and blocks): with several, each epoch also reorders the files.
    corpus = corpus / "b.txt"
    tokens = packed(corpus)
    n = (len(tokens) - 1) // SEQ
    loader = make("text", corpus, batch=1, seed=3)
    epochs = [global_stream([loader], n) for _ in range(2)]
    plain = reference_windows(tokens, 1)[:, :-1]

    def rows(x):
        return sorted(map(tuple, x.tolist()))

    assert rows(epochs[0][:, 0]) == rows(epochs[1][:, 0]) == rows(plain)
    assert not torch.equal(epochs[0][:, 0], plain) and not torch.equal(epochs[0], epochs[1])
    assert torch.equal(global_stream([make("text", corpus, batch=n, seed=3)], 1), epochs[0])


@pytest.mark.parametrize("dataset", ["text", "tokens"])
@pytest.mark.parametrize("resume_degree", [1, 4])
def test_a_state_saved_at_dp2_resumes_the_same_global_stream_at_another_dp(
        corpus, tmp_path, dataset, resume_degree):
    path = corpus
    if dataset == "tokens":
        path = tmp_path / "tokens"
        tokenize_corpus(str(corpus), str(path), tokenizer_spec=("name", "byte"), workers=1,
                        progress=False)
    kw = dict(seed=5)
    total_steps, saved_after = 30, 11  # 240 windows: several epochs and blocks
    expected = global_stream(ranks(dataset, path, 1, 8, **kw), total_steps)

    before = ranks(dataset, path, 2, 4, **kw)
    head = global_stream(before, saved_after)
    state = json.loads(json.dumps(before[0].state_dict()))  # plain values survive JSON
    assert all(loader.state_dict() == state for loader in before)  # one state for all ranks
    if dataset == "text":
        assert state["stream"]["cursor"] != [0, 0, 0, 0]  # mid-corpus: seek, don't re-read

    batch = 8 // resume_degree
    after = ranks(dataset, path, resume_degree, batch, **kw)
    for loader in after:
        loader.load_state_dict(state)
    tail = global_stream(after, total_steps - saved_after)
    assert torch.equal(torch.cat([head, tail]), expected)


def test_a_resume_seeks_to_the_saved_unit_instead_of_rereading(corpus, monkeypatch):
    loader = make("text", corpus, batch=8, seed=1)
    for _ in range(4):
        loader.next_batch()
    state = loader.state_dict()
    file_pos, offset = state["stream"]["cursor"][:2]
    assert offset > 0
    calls = []
    real = readers.read_units

    def spy(path, field="text", offset=0, line=0, **kw):
        calls.append((path.name, offset))
        return real(path, field, offset, line, **kw)

    fresh = make("text", corpus, batch=8, seed=1)
    monkeypatch.setattr("titanext.data.streaming.read_units", spy)
    fresh.load_state_dict(state)
    assert calls[0][1] == offset  # the first read starts at the saved unit
    assert torch.equal(fresh.next_batch()[0], loader.next_batch()[0])


def test_streaming_state_refuses_another_corpus_seed_or_block(corpus, tmp_path):
    loader = make("text", corpus)
    loader.next_batch()
    state = loader.state_dict()
    with pytest.raises(ValueError, match=r"seed = 0 but this run has 1; set training\.seed = 0"):
        make("text", corpus, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match=r"block_windows = 5 but this run has 10"):
        make("text", corpus, block_tokens=80).load_state_dict(state)
    (corpus / "a.jsonl").write_text('{"text": "edited"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"read another corpus.*corpus changed"):
        make("text", corpus).load_state_dict(state)


# -- pre-tokenized shards ---------------------------------------------------------------------
def test_tokenize_writes_the_stream_the_text_source_reads(corpus, tmp_path):
    out = tmp_path / "tok"
    manifest = tokenize_corpus(str(corpus), str(out), tokenizer_spec=("name", "byte"), workers=2,
                               progress=False)
    tokens = packed(corpus)
    assert manifest["tokens"] == len(tokens) and manifest["dtype"] == "uint16"
    assert [s["source"] for s in manifest["shards"]][:2] == ["a.jsonl", "b.txt"]
    shards = [np.load(out / s["file"]) for s in manifest["shards"]]
    assert np.concatenate(shards).tolist() == tokens
    assert manifest["documents"] == tokens.count(EOS)
    steps = 12
    text = global_stream([make("text", corpus, shuffle=False, batch=8)], steps)
    assert torch.equal(global_stream([make("tokens", out, shuffle=False, batch=8)], steps), text)
    shuffled = make("tokens", out, batch=1, seed=2)
    n = shuffled.num_windows
    assert n == (len(tokens) - 1) // SEQ
    epoch = global_stream([shuffled], n)[:, 0]
    plain = reference_windows(tokens, 1)[:, :-1]
    assert sorted(map(tuple, epoch.tolist())) == sorted(map(tuple, plain.tolist()))
    assert not torch.equal(epoch, plain)


def test_the_keyed_permutation_is_a_bijection_for_any_size():
    for n in (1, 2, 3, 10, 255, 256, 1000, 4097):
        out = permute(np.arange(n), n, key=n)
        assert sorted(out.tolist()) == list(range(n))
    assert not np.array_equal(permute(np.arange(1000), 1000, 1), permute(np.arange(1000), 1000, 2))


def test_token_shards_whose_dtype_cannot_hold_the_vocab_are_named(tmp_path):
    np.save(tmp_path / "00000.npy", np.arange(100, dtype=np.uint16))
    np.save(tmp_path / "00001.npy", np.arange(100, dtype=np.uint8))
    with pytest.raises(ConfigError, match=r"00001\.npy' has dtype uint8, which cannot hold.*257"):
        make("tokens", tmp_path)

    class BigVocab(ByteTokenizer):
        vocab_size = 70_000

    np.save(tmp_path / "00001.npy", np.arange(100, dtype=np.uint16))
    with pytest.raises(ConfigError, match=r"00000\.npy' has dtype uint16.*vocab 70000.*uint32"):
        build_dataloader(dataset="tokens", dataset_path=str(tmp_path), tokenizer=BigVocab(),
                         seq_len=8, local_batch_size=1, dp_rank=0, dp_degree=1)
    (tmp_path / "tokens.json").write_text(json.dumps({"vocab_size": 50_000, "eos_id": 0}))
    with pytest.raises(ConfigError, match=r"tokens\.json' was written by a tokenizer with vocab "
                                          r"50000 and EOS 0.*vocab 258 and EOS 257"):
        make("tokens", tmp_path)


# -- bad input ----------------------------------------------------------------------------------
def test_parquet_without_the_text_column_or_with_a_non_string_one_is_named(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["alpha beta", "gamma"], "n": [1, 2]}),
                   tmp_path / "x.parquet")
    with pytest.raises(ConfigError,
                       match=r"x\.parquet' has no column 'text'.*its columns: body, n"):
        make("text", tmp_path)
    with pytest.raises(ConfigError, match=r"x\.parquet': column 'n' has type int64, expected a "
                                          r"string column"):
        make("text", tmp_path, text_field="n")
    inputs = make("text", tmp_path, text_field="body", shuffle=False, batch=1).next_batch()[0]
    assert inputs.tolist() == [list(b"alpha be")]


def _save_to_disk_split(folder, texts, shards=2, column="text"):
    """A split folder as Hugging Face datasets' save_to_disk writes it: Arrow IPC *stream*
    shards data-0000i-of-0000n.arrow next to dataset_info.json and state.json."""
    pa = pytest.importorskip("pyarrow")
    folder.mkdir(parents=True)
    per = -(-len(texts) // shards)
    for i in range(shards):
        table = pa.table({column: texts[i * per:(i + 1) * per], "id": list(range(len(texts)))[
            i * per:(i + 1) * per]})
        with pa.ipc.new_stream(str(folder / f"data-{i:05d}-of-{shards:05d}.arrow"),
                               table.schema) as w:
            for batch in table.to_batches(max_chunksize=2):  # several record batches a shard
                w.write_batch(batch)
    (folder / "dataset_info.json").write_text("{}")
    (folder / "state.json").write_text(json.dumps({"_data_files": [
        {"filename": f"data-{i:05d}-of-{shards:05d}.arrow"} for i in range(shards)]}))
    return folder


def test_a_datasets_save_to_disk_split_streams_like_the_same_jsonl(tmp_path):
    texts = [f"doc {i}: " + "ab " * (i % 4) for i in range(11)] + ["  ", "last"]
    split = _save_to_disk_split(tmp_path / "ds" / "train", texts)
    (tmp_path / "ds" / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    jsonl = tmp_path / "same.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    assert packed(split) == packed(jsonl)  # blank rows skipped alike
    a, b = make("text", split, shuffle=False), make("text", jsonl, shuffle=False)
    for _ in range(4):
        assert torch.equal(a.next_batch()[0], b.next_batch()[0])
    # resume at row 3 of the second shard (rows are per file), inside its second record batch
    from pathlib import Path

    from titanext.data.readers import read_units
    second = sorted(Path(split).glob("*.arrow"))[1]
    assert [u.text for u in read_units(second, "text", offset=3)] == ["doc 10: ab ab ", "last"]
    with pytest.raises(ConfigError, match=r"is a datasets DatasetDict saved with save_to_disk; "
                                          r"point it at one split folder \(train, test\)"):
        make("text", tmp_path / "ds")
    with pytest.raises(ConfigError, match=r"has no column 'body'.*its columns: text, id"):
        make("text", split, text_field="body")
    with pytest.raises(ConfigError, match=r"column 'id' has type int64, expected a string"):
        make("text", split, text_field="id")


def test_an_arrow_ipc_file_in_file_format_reads_too_and_garbage_is_named(tmp_path):
    pa = pytest.importorskip("pyarrow")
    table = pa.table({"text": ["alpha beta", "gamma"]})
    with pa.ipc.new_file(str(tmp_path / "x.arrow"), table.schema) as w:
        w.write_table(table)
    inputs = make("text", tmp_path / "x.arrow", shuffle=False, batch=1).next_batch()[0]
    assert inputs.tolist() == [list(b"alpha be")]
    (tmp_path / "bad.arrow").write_bytes(b"not arrow at all")
    with pytest.raises(ConfigError, match=r"bad\.arrow' is not a readable Arrow IPC"):
        make("text", tmp_path / "bad.arrow")


def test_missing_pyarrow_names_the_data_extra(tmp_path, monkeypatch):
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import fails like a missing one
    with pytest.raises(ConfigError, match=r"needs pyarrow.*pip install 'titanext\[data\]'"):
        make("text", tmp_path)


def test_check_dataset_lists_problems_before_training(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"body": "x"}\n', encoding="utf-8")
    assert check_dataset("text", str(tmp_path / "nope")) == [
        f"training.dataset_path = {str(tmp_path / 'nope')!r} does not exist; give a .txt or "
        ".jsonl or .parquet or .arrow file or a folder of them"]
    [problem] = check_dataset("text", str(tmp_path))
    assert "a.jsonl' line 1 has no \"text\" field" in problem
    assert check_dataset("text", str(tmp_path), text_field="body") == []
    [problem] = check_dataset("text", str(tmp_path), section="validation")
    assert problem.startswith(f"validation.dataset_path file {str(tmp_path / 'a.jsonl')!r}")
    np.save(tmp_path / "t.npy", np.zeros(4, dtype=np.uint8))
    [problem] = check_dataset("tokens", str(tmp_path), vocab_size=258)
    assert "t.npy' has dtype uint8" in problem


@pytest.mark.parametrize("args, message", [
    (["--tokenizer", "byte", "MISSING", "OUT"], "SRC = 'MISSING' does not exist"),
    (["--tokenizer", "byte", "bad.jsonl", "OUT"], "bad.jsonl' line 1 has no \"text\" field"),
])
def test_the_tokenize_cli_exits_2_naming_the_file(tmp_path, args, message, monkeypatch, capsys):
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n', encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    assert main(["tokenize", "--no-progress", *args]) == 2
    assert message in capsys.readouterr().err


def test_the_tokenize_cli_reads_the_tokenizer_and_text_field_from_a_config(tmp_path, capsys):
    (tmp_path / "d.jsonl").write_text('{"body": "hello"}\n', encoding="utf-8")
    config = tmp_path / "c.toml"
    config.write_text('[model]\ntokenizer = "byte"\n', encoding="utf-8")
    code = main(["tokenize", "--no-progress", "--config", str(config), "--text-field", "body",
                 str(tmp_path / "d.jsonl"), str(tmp_path / "out")])
    assert code == 0 and "wrote 1 shards, 6 tokens (uint16)" in capsys.readouterr().out
    assert np.load(tmp_path / "out" / "00000.npy").tolist() == [*b"hello", EOS]


# -- document masking -------------------------------------------------------------------------
def test_document_ids_count_eos_and_bos_boundaries_and_positions_restart():
    x = torch.tensor([[1, EOS, 2, 3, EOS, BOS, 4, EOS],
                      [BOS, 5, 6, BOS, 7, EOS, EOS, 8]])
    ids = document_ids(x, EOS, BOS)
    assert ids.dtype == torch.int64
    assert ids.tolist() == [[0, 0, 1, 1, 1, 2, 2, 2], [0, 0, 0, 1, 1, 1, 2, 3]]
    assert document_positions(ids).tolist() == [[0, 1, 0, 1, 2, 0, 1, 2],
                                                [0, 1, 2, 0, 1, 2, 0, 0]]
    assert document_ids(x, EOS, EOS).tolist()[1] == [0, 0, 0, 0, 0, 0, 1, 2]


@pytest.mark.parametrize("dataset", ["text", "tokens", "shakespeare"])
def test_document_masking_adds_ids_and_leaves_inputs_and_labels_alone(corpus, tmp_path, dataset):
    path = corpus
    if dataset == "tokens":
        path = tmp_path / "tok"
        tokenize_corpus(str(corpus), str(path), tokenizer_spec=("name", "byte"), workers=1,
                        progress=False)
    kw = {} if dataset != "shakespeare" else {"block_tokens": None}
    if dataset == "shakespeare":
        plain = build_dataloader(dataset="shakespeare", dataset_path=None, tokenizer=TOK,
                                 seq_len=64, local_batch_size=4, dp_rank=0, dp_degree=1)
        masked = build_dataloader(dataset="shakespeare", dataset_path=None, tokenizer=TOK,
                                  seq_len=64, local_batch_size=4, dp_rank=0, dp_degree=1,
                                  document_masking=True)
    else:
        plain, masked = make(dataset, path, **kw), make(dataset, path, document_masking=True, **kw)
    for _ in range(3):
        inputs, labels = plain.next_batch()
        m_inputs, m_labels, ids = masked.next_batch()
        assert torch.equal(inputs, m_inputs) and torch.equal(labels, m_labels)
        assert ids.shape == inputs.shape and ids.dtype == torch.int64
        for row, row_ids in zip(inputs.tolist(), ids.tolist()):
            assert row_ids[0] == 0
            for t in range(1, len(row)):
                assert row_ids[t] - row_ids[t - 1] == (row[t - 1] == EOS)


def test_hf_tokenizer_shards_match_the_text_stream_and_refuse_the_byte_tokenizer(corpus, tmp_path):
    from tests.hf_artifacts import make_bpe_tokenizer
    from titanext.data.hf_tokenizer import HFTokenizer

    hf_dir = make_bpe_tokenizer(str(tmp_path / "hf"))
    hf = HFTokenizer(hf_dir)
    out = tmp_path / "tok"
    manifest = tokenize_corpus(str(corpus), str(out), tokenizer_spec=("path", hf_dir), workers=1,
                               progress=False)
    assert (manifest["vocab_size"], manifest["eos_id"]) == (hf.vocab_size, hf.eos_id)
    kw = dict(tokenizer=hf, seq_len=SEQ, local_batch_size=4, dp_rank=0, dp_degree=1,
              shuffle=False)
    text = build_dataloader(dataset="text", dataset_path=str(corpus), **kw)
    tokens = build_dataloader(dataset="tokens", dataset_path=str(out), **kw)
    for _ in range(5):
        assert torch.equal(text.next_batch()[0], tokens.next_batch()[0])
    with pytest.raises(ConfigError, match=r"tokens\.json' was written by a tokenizer with vocab "
                                          rf"{hf.vocab_size} and EOS {hf.eos_id}"):
        make("tokens", out)


# -- config rules at load -----------------------------------------------------------------------
def _problems(args):
    from titanext.config import load_config

    try:
        load_config(None, args)
    except ConfigError as e:
        return e.problems
    return []


def test_config_load_names_bad_data_files_before_anything_starts(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"body": "x"}\n', encoding="utf-8")
    text = ["--training.dataset=text", f"--training.dataset_path={tmp_path}"]
    [problem] = _problems(text)
    assert problem.startswith(f"training.dataset_path file {str(tmp_path / 'a.jsonl')!r} line 1 "
                              'has no "text" field')
    assert _problems([*text, "--training.dataset_text_field=body"]) == []
    [problem] = _problems([*text, "--training.dataset_text_field="])
    assert problem.startswith("training.dataset_text_field = '' ")
    shards = tmp_path / "shards"
    shards.mkdir()
    np.save(shards / "00000.npy", np.zeros(16, dtype=np.uint8))
    [problem] = _problems(["--training.dataset=tokens", f"--training.dataset_path={shards}"])
    assert "00000.npy' has dtype uint8, which cannot hold" in problem
    [problem] = _problems(["--training.dataset=tokens"])
    assert problem.startswith("training.dataset = 'tokens' needs training.dataset_path")


def test_validation_keys_are_checked_only_when_enabled(tmp_path):
    assert _problems(["--validation.dataset_path=/no/such/dir"]) == []
    on = ["--validation.enable=true"]
    [problem] = _problems(on)
    assert problem.startswith("validation.dataset = 'text' needs validation.dataset_path")
    [problem] = _problems([*on, "--validation.dataset_path=/no/such/dir"])
    assert problem.startswith("validation.dataset_path = '/no/such/dir' does not exist")
    assert _problems([*on, "--validation.dataset=shakespeare"]) == []
    [problem] = _problems([*on, "--validation.dataset=shakespeare", "--validation.freq=0"])
    assert problem.startswith("validation.freq = 0 is out of range")
    (tmp_path / "v.jsonl").write_text('{"body": "x"}\n', encoding="utf-8")
    [problem] = _problems([*on, f"--validation.dataset_path={tmp_path / 'v.jsonl'}"])
    assert problem.startswith("validation.dataset_path file") and '"text" field' in problem
