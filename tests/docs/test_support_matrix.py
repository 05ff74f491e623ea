"""The support matrix is the config validation's own verdict, and docs/support_matrix.md shows it
as is."""

from __future__ import annotations

import pytest

from tests import REPO_ROOT
from titanext.config.support_matrix import (
    BEGIN_MARK,
    END_MARK,
    UPDATE_COMMAND,
    check,
    main,
    support_matrix,
    to_markdown,
    to_text,
    update_page,
)

PAGE = str(REPO_ROOT / "docs" / "support_matrix.md")


@pytest.fixture(scope="module")
def matrix():
    return support_matrix()


def _cell(m, row, col):
    return m.cells[m.rows.index(row)][m.columns.index(col)]


def test_docs_table_is_the_generated_one(matrix):
    with open(PAGE, encoding="utf-8") as f:
        text = f.read()
    assert BEGIN_MARK in text and END_MARK in text
    expected = update_page(text, to_markdown(matrix))
    assert text == expected, ("docs/support_matrix.md is stale: run "
                              f"`{UPDATE_COMMAND}`")


def test_cells_follow_the_validation(matrix):
    assert _cell(matrix, "CP zigzag, p2p", "PP ZBV").supported           # CP x PP
    assert _cell(matrix, "TP + SP", "PP ZBH1").supported                 # TP/SP x PP
    assert _cell(matrix, "float8 tensorwise", "PP DualPipeV").supported
    zero1 = _cell(matrix, "ZeRO-1 (DDP + sharded optimizer)", "PP 1F1B")
    assert not zero1.supported and "zero_stage = 1" in zero1.reasons[0]
    # op-level SAC runs under split schedules with deferred weight gradients (the default)
    assert _cell(matrix, "AC selective, op level", "PP ZBH1").supported
    assert _cell(matrix, "AC selective, op level", "PP 1F1B").supported
    two_schedules = _cell(matrix, "PP ZBH2", "PP ZBV")
    assert not two_schedules.applicable
    # Every rejection carries the validation's message, and the markdown numbers them.
    md = to_markdown(matrix)
    for line in matrix.cells:
        for cell in line:
            if cell.applicable and not cell.supported:
                assert cell.reasons and all(r in md for r in cell.reasons)


def test_a_cell_is_exactly_load_config():
    assert check({"parallelism.tensor_parallel_degree": "2"}).supported
    bad = check({"parallelism.tensor_parallel_degree": "3"})
    assert not bad.supported and "tensor_parallel_degree = 3" in " ".join(bad.reasons)


def test_update_page_needs_the_markers():
    with pytest.raises(ValueError, match="support-matrix"):
        update_page("no markers here", "| t |\n")
    assert update_page(f"a\n{BEGIN_MARK}\nold\n{END_MARK}\nb", "new\n") == \
        f"a\n{BEGIN_MARK}\n\nnew\n\n{END_MARK}\nb"


def test_cli_and_text_table(capsys, matrix):
    assert main(["--markdown"]) == 0
    assert capsys.readouterr().out == to_markdown(matrix)
    text = to_text(matrix)
    assert "PP DualPipeV" in text.splitlines()[0] and "✗" in text
