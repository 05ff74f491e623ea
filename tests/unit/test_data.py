"""The data loader: packing, windows, the global order contract, resume, sources and errors.

References are computed the simplest way: slicing the packed token list by hand, and
concatenating the batches of several simulated data-parallel ranks called in lockstep.
"""

from __future__ import annotations

import json
import pickle
from collections import defaultdict

import pytest
import torch

from titanext.data import build_dataloader, load_documents, pack_documents
from titanext.data.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
EOS = TOK.eos_id


def make(dataset: str = "shakespeare", dataset_path=None, *, seq_len: int = 8, batch: int = 2,
         rank: int = 0, degree: int = 1, seed: int = 0, shuffle: bool = True):
    return build_dataloader(dataset=dataset, dataset_path=dataset_path, tokenizer=TOK,
                            seq_len=seq_len, local_batch_size=batch, dp_rank=rank,
                            dp_degree=degree, seed=seed, shuffle=shuffle)


def global_stream(loaders, steps: int) -> torch.Tensor:
    """Run ``loaders`` (one per dp rank) in lockstep; the rank-ordered concatenation of inputs
    and labels, as [steps * global_batch, 2, seq_len]."""
    rows = []
    for _ in range(steps):
        for loader in loaders:
            inputs, labels = loader.next_batch()
            rows.append(torch.stack([inputs, labels], dim=1))
    return torch.cat(rows)


def ranks(degree: int, batch: int, **kw):
    return [make(rank=r, degree=degree, batch=batch, **kw) for r in range(degree)]


@pytest.fixture
def small_corpus(tmp_path):
    """A .txt corpus of 118 tokens: 14 windows of seq_len 8, so a global batch of 8 crosses
    the epoch boundary on the second step."""
    path = tmp_path / "small.txt"
    path.write_text("".join(chr(ord("a") + (i * 7) % 26) for i in range(117)), encoding="utf-8")
    return str(path)


# -- packing and windows -------------------------------------------------------------------------
def test_documents_are_packed_with_eos_after_each():
    assert pack_documents(["ab", "", "c"], TOK).tolist() == [97, 98, 257, 257, 99, 257]
    assert pack_documents(["ab", "c"], TOK).dtype == torch.int16  # byte ids fit: compact storage


def test_windows_are_consecutive_seq_len_plus_one_slices_and_labels_are_shifted(small_corpus):
    tokens = pack_documents(load_documents("text", small_corpus), TOK).tolist()
    loader = make("text", small_corpus, seq_len=8, batch=3, shuffle=False)
    assert (len(tokens) - 1) // 8 == 14
    assert loader.num_windows is None  # a stream does not know its length ahead
    assert loader.tokens_per_window == 9
    inputs, labels = loader.next_batch()
    assert inputs.dtype == labels.dtype == torch.long
    assert inputs.shape == labels.shape == (3, 8)
    for i in range(3):
        window = tokens[i * 8 : i * 8 + 9]
        assert inputs[i].tolist() == window[:-1]
        assert labels[i].tolist() == window[1:]


def test_an_unshuffled_loader_wraps_to_window_zero_after_an_epoch(small_corpus):
    loader = make("text", small_corpus, seq_len=8, batch=7, shuffle=False)
    first, _ = loader.next_batch()
    loader.next_batch()  # windows 7..13: the epoch is exhausted
    again, _ = loader.next_batch()
    assert torch.equal(first, again)
    assert loader.epoch == 1


def test_each_shuffled_epoch_is_a_seeded_permutation_of_all_windows(small_corpus):
    n = 14
    plain = make("text", small_corpus, batch=n, shuffle=False).next_batch()[0]
    shuffled = make("text", small_corpus, batch=n, seed=3)
    epoch0, epoch1 = shuffled.next_batch()[0], shuffled.next_batch()[0]

    def as_sorted(x):
        return sorted(map(tuple, x.tolist()))

    assert as_sorted(epoch0) == as_sorted(epoch1) == as_sorted(plain)
    assert not torch.equal(epoch0, plain) and not torch.equal(epoch0, epoch1)
    assert torch.equal(make("text", small_corpus, batch=n, seed=3).next_batch()[0], epoch0)
    assert not torch.equal(make("text", small_corpus, batch=n, seed=4).next_batch()[0], epoch0)


# -- the global order contract -------------------------------------------------------------------
@pytest.mark.parametrize("shuffle", [True, False])
def test_four_ranks_of_two_see_what_one_rank_of_eight_sees_across_epochs(small_corpus, shuffle):
    kw = dict(dataset="text", dataset_path=small_corpus, seq_len=8, shuffle=shuffle, seed=1)
    steps = 5  # 40 global windows: almost three epochs of 14
    expected = global_stream(ranks(1, 8, **kw), steps)
    assert torch.equal(global_stream(ranks(4, 2, **kw), steps), expected)
    assert torch.equal(global_stream(ranks(2, 4, **kw), steps), expected)


def test_rank_r_takes_global_windows_pos_plus_r_times_b(small_corpus):
    kw = dict(dataset="text", dataset_path=small_corpus, seq_len=8)
    single = global_stream(ranks(1, 1, **kw), 16)  # global windows 0..15, one per call
    loaders = ranks(4, 2, **kw)
    for step in range(2):
        for r, loader in enumerate(loaders):
            inputs, _ = loader.next_batch()
            first = step * 8 + r * 2
            assert torch.equal(inputs, single[first : first + 2, 0])
        assert all(loader.position == (step + 1) * 8 for loader in loaders)


def test_the_contract_holds_on_the_shakespeare_corpus():
    expected = global_stream(ranks(1, 8, seq_len=16), 2)
    assert torch.equal(global_stream(ranks(4, 2, seq_len=16), 2), expected)


# -- checkpoint state ----------------------------------------------------------------------------
def test_state_is_plain_picklable_values_and_only_the_global_position(small_corpus):
    loader = make("text", small_corpus, seq_len=8, batch=2, rank=1, degree=4)
    loader.next_batch()
    state = pickle.loads(pickle.dumps(loader.state_dict()))
    stream = state.pop("stream")
    assert state == {"position": 8, "dataset": "text", "seq_len": 8, "num_windows": None}
    # the stream's cursor: the block start (file 0, offset 0, no skip) and what it refers to
    assert stream["cursor"] == [0, 0, 0, 0] and stream["block_first"] == 0
    shakespeare = make("shakespeare", seq_len=8, batch=2, rank=1, degree=4)
    shakespeare.next_batch()
    assert shakespeare.state_dict() == {"position": 8, "dataset": "shakespeare", "seq_len": 8,
                                        "num_windows": shakespeare.num_windows}


@pytest.mark.parametrize("dataset", ["text", "synthetic"])
def test_resume_under_another_dp_layout_continues_the_same_global_stream(small_corpus, dataset):
    kw = dict(dataset=dataset, dataset_path=small_corpus if dataset == "text" else None, seed=2)
    expected = global_stream(ranks(1, 8, **kw), 6)

    before = ranks(4, 2, **kw)  # saved with dp_degree=4, B=2 ...
    head = global_stream(before, 3)
    state = before[0].state_dict()
    assert all(loader.state_dict() == state for loader in before)

    after = ranks(2, 4, **kw)  # ... resumed with dp_degree=2, B=4
    for loader in after:
        loader.load_state_dict(state)
    tail = global_stream(after, 3)
    assert torch.equal(torch.cat([head, tail]), expected)


def test_loading_state_from_another_seq_len_dataset_or_corpus_is_refused(small_corpus, tmp_path):
    state = make("text", small_corpus, seq_len=8).state_dict()
    with pytest.raises(ValueError, match=r"seq_len = 8 but this run has 4.*training\.seq_len"):
        make("text", small_corpus, seq_len=4).load_state_dict(state)
    with pytest.raises(ValueError, match=r"dataset = 'text' but this run has 'synthetic'"):
        make("synthetic", seq_len=8).load_state_dict(state)
    other = tmp_path / "other.txt"
    other.write_text("x" * 500, encoding="utf-8")
    with pytest.raises(ValueError, match=r"read another corpus.*corpus changed"):
        make("text", str(other), seq_len=8).load_state_dict(state)
    state = make("shakespeare", seq_len=8).state_dict()
    with pytest.raises(ValueError, match=r"had \d+ windows per epoch.*corpus changed"):
        make("shakespeare", seq_len=8).load_state_dict({**state, "num_windows": 14})
    for bad in (-1, "3", None):
        with pytest.raises(ValueError, match=r"position = .*non-negative int"):
            make("text", small_corpus, seq_len=8).load_state_dict({**state, "position": bad})


# -- sources ---------------------------------------------------------------------------------
def test_shakespeare_loads_into_compact_storage():
    loader = make("shakespeare", seq_len=256)
    assert loader.source.tokens.dtype == torch.int16
    assert loader.num_windows == (len(loader.source.tokens) - 1) // 256 > 3000
    docs = load_documents("shakespeare")
    assert docs[0].startswith("First Citizen:") and len(docs) > 1000
    assert int((loader.source.tokens == EOS).sum()) == len(docs)  # EOS between speeches


def test_a_txt_file_is_one_document(tmp_path):
    path = tmp_path / "one.txt"
    path.write_text("line one\n\nline two\n", encoding="utf-8")
    assert load_documents("text", str(path)) == ["line one\n\nline two\n"]


def test_a_jsonl_file_is_one_document_per_line_with_eos_between(tmp_path):
    path = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": "héllo", "id": 1}), "", json.dumps({"text": "world"})]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert load_documents("text", str(path)) == ["héllo", "world"]
    loader = make("text", str(path), seq_len=4, batch=2, shuffle=False)
    inputs, labels = loader.next_batch()
    stream = [*"héllo".encode(), EOS, *b"world", EOS]
    assert inputs.tolist() == [stream[0:4], stream[4:8]]
    assert labels.tolist() == [stream[1:5], stream[5:9]]


def test_a_folder_is_read_recursively_in_sorted_order_skipping_other_files(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("B", encoding="utf-8")
    (tmp_path / "a.jsonl").write_text('{"text": "A1"}\n{"text": "A2"}\n', encoding="utf-8")
    (tmp_path / "sub" / "c.txt").write_text("C", encoding="utf-8")
    (tmp_path / "notes.md").write_text("ignored", encoding="utf-8")
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")  # empty documents are dropped
    assert load_documents("text", str(tmp_path)) == ["A1", "A2", "B", "C"]
    tokens = pack_documents(load_documents("text", str(tmp_path)), TOK).tolist()
    assert tokens == [65, 49, EOS, 65, 50, EOS, 66, EOS, 67, EOS]


def test_synthetic_windows_depend_only_on_seed_and_global_index():
    kw = dict(dataset="synthetic", seq_len=16, seed=5)
    expected = global_stream(ranks(1, 8, **kw), 3)
    assert torch.equal(global_stream(ranks(1, 8, **kw), 3), expected)  # deterministic
    assert torch.equal(global_stream(ranks(4, 2, **kw), 3), expected)  # layout-independent
    assert not torch.equal(global_stream(ranks(1, 8, **{**kw, "seed": 6}), 3), expected)
    late = make(**kw, batch=3)
    late.load_state_dict({**late.state_dict(), "position": 10})
    assert torch.equal(late.next_batch()[0], expected[10:13, 0])  # window g is f(seed, g)
    assert make(**kw).num_windows is None


def test_synthetic_tokens_follow_a_sparse_bigram_table_so_they_are_learnable():
    inputs, labels = make("synthetic", seq_len=256, batch=16, seed=0).next_batch()
    assert int(inputs.min()) >= 0 and int(inputs.max()) < TOK.vocab_size
    successors = defaultdict(set)
    for a, b in zip(inputs.flatten().tolist(), labels.flatten().tolist()):
        successors[a].add(b)
    assert max(len(s) for s in successors.values()) <= 4  # vs 258 for uniform noise
    assert len(successors) > 100  # yet the chain visits much of the vocabulary


# -- errors a user can cause -----------------------------------------------------------------
def test_an_unknown_dataset_names_the_value_and_the_choices():
    allowed = r"'shakespeare', 'text', 'tokens', 'synthetic'"
    with pytest.raises(ValueError, match=r"training\.dataset = 'wiki'.*" + allowed):
        make("wiki")
    with pytest.raises(ValueError, match=r"training\.dataset = 'synthetic' has no documents"):
        load_documents("synthetic")


def test_path_errors_name_the_path_and_what_is_allowed(tmp_path):
    with pytest.raises(ValueError,
                       match=r"needs training\.dataset_path.*\.txt.*\.jsonl.*\.parquet"):
        make("text", None)
    with pytest.raises(ValueError, match=r"dataset_path = '.*nope\.txt' does not exist"):
        make("text", str(tmp_path / "nope.txt"))
    csv = tmp_path / "data.csv"
    csv.write_text("a,b", encoding="utf-8")
    with pytest.raises(ValueError,
                       match=r"suffix '\.csv'; allowed: '\.txt', '\.jsonl', '\.parquet'"):
        make("text", str(csv))
    folder = tmp_path / "folder"
    folder.mkdir()
    with pytest.raises(ValueError,
                       match=r"folder with no \.txt or \.jsonl or \.parquet or \.arrow files"):
        make("text", str(folder))
    with pytest.raises(ValueError,
                       match=r"only read with dataset = 'text', 'tokens' or 'hf'.*'shakespeare'"):
        make("shakespeare", str(csv))


def test_empty_and_too_short_corpora_are_refused(tmp_path):
    blank = tmp_path / "blank.txt"
    blank.write_text("  \n\n ", encoding="utf-8")
    with pytest.raises(ValueError, match=r"blank\.txt' holds no text"):
        make("text", str(blank))
    short = tmp_path / "short.txt"
    short.write_text("abc", encoding="utf-8")  # 4 tokens with EOS
    with pytest.raises(ValueError, match=r"has 4 tokens, fewer than training\.seq_len \+ 1 = 9"):
        make("text", str(short), seq_len=8)
    # exactly seq_len + 1 tokens is one window, which each epoch repeats
    inputs = make("text", str(short), seq_len=3, batch=2).next_batch()[0]
    assert inputs.tolist() == [[97, 98, 99]] * 2


@pytest.mark.parametrize("line, problem", [
    ("{not json", "is not valid JSON"),
    ('{"body": "x"}', 'has no "text" field'),
    ('["text"]', 'has no "text" field'),
    ('{"text": 3}', '"text" is a int, expected a string'),
])
def test_a_bad_jsonl_line_names_the_file_and_line(tmp_path, line, problem):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n\n' + line + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl' line 3") as err:
        make("text", str(path))
    assert problem in str(err.value)


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("café".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.txt' is not valid UTF-8 \(byte 3\)"):
        make("text", str(path))


@pytest.mark.parametrize("kw, message", [
    (dict(seq_len=0), r"training\.seq_len = 0; expected a positive int"),
    (dict(batch=0), r"training\.local_batch_size = 0; expected a positive int"),
    (dict(degree=0), r"dp_degree = 0; expected a positive int"),
    (dict(rank=2, degree=2), r"dp_rank = 2; expected 0 <= dp_rank < dp_degree = 2"),
])
def test_bad_sizes_and_ranks_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        make("synthetic", **kw)
