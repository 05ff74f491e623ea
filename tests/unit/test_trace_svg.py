"""The profiler's timeline (titanext.components.trace_svg) on tiny synthetic traces."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

from titanext.components.trace_svg import trace_svg, write_timeline

SVG = "{http://www.w3.org/2000/svg}"
MAIN, GLOO = 10, 11  # the training thread, a gloo thread


def _x(name: str, ts: float, dur: float, tid: int = MAIN) -> dict:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1}


def _trace(rank: int) -> dict:
    """One pipelined step of rank ``rank``: the phases, an F, I and W chunk, a send issued
    from inside a pipeline action and run on a gloo thread; ranks are 50 us apart."""
    t = 50 * rank
    return {"baseTimeNanoseconds": 0, "traceEvents": [
        _x("ProfilerStep#4", t, 1000),
        _x("titanext:data", t + 10, 40),
        _x("titanext:pipeline", t + 60, 700),
        _x(f"titanext:pp_F/s{rank}", t + 70, 150),
        _x("PP:SEND_F", t + 230, 20),
        _x("c10d::send", t + 232, 10),
        _x(f"titanext:pp_I/s{rank}", t + 300, 200),
        _x(f"titanext:pp_W/s{rank}", t + 520, 100),
        _x("titanext:optimizer", t + 800, 150),
        _x("gloo:send", t + 240, 60, tid=GLOO),
        {"ph": "M", "name": "thread_name", "tid": GLOO, "args": {"name": "gloo"}},
    ]}


def _tips(group: ET.Element) -> list[str]:
    """The name in each rect's tooltip ("titanext:data: 0.04 ms" -> "titanext:data")."""
    tips = [r.findtext(f"{SVG}title") or "" for r in group.iter(f"{SVG}rect")]
    return [t.rsplit(":", 1)[0] for t in tips]


def test_one_block_per_rank_and_a_box_per_named_range():
    root = ET.fromstring(trace_svg({0: _trace(0), 1: _trace(1)}, title="step 5"))  # parses
    blocks = {g.get("id"): g for g in root.iter(f"{SVG}g")}
    assert sorted(blocks) == ["rank0", "rank1"]
    for rank in (0, 1):
        tips = _tips(blocks[f"rank{rank}"])
        names = ["step 5", "titanext:data", "titanext:pipeline", "titanext:optimizer",
                 f"titanext:pp_F/s{rank}", f"titanext:pp_I/s{rank}", f"titanext:pp_W/s{rank}",
                 "gloo:send"]  # the step band, the phases, the chunks, the send (comm lane)
        assert sorted(tips) == sorted(names), (rank, tips)
        texts = {t.text.strip() for t in blocks[f"rank{rank}"].iter(f"{SVG}text")}
        assert {f"rank {rank}", "pp chunks", "comm"} <= texts, texts  # its lanes' names
        assert f"rank {1 - rank}" not in texts
    legend = [t.text for t in root.iter(f"{SVG}text")]
    for entry in ("data", "pipeline", "optimizer", "F: forward", "I: input grad",
                  "W: weight grad", "comm: PP send/recv"):
        assert entry in legend, (entry, legend)


def test_boxes_sit_on_the_shared_clock():
    """Rank 1's trace starts 50 us after rank 0's: its step band starts that much later."""
    root = ET.fromstring(trace_svg({0: _trace(0), 1: _trace(1)}))
    bands = [r for r in root.iter(f"{SVG}rect")
             if (r.findtext(f"{SVG}title") or "").startswith("step")]
    x0, x1 = (float(b.get("x")) for b in bands)
    width = float(bands[0].get("width"))  # 1000 us
    assert abs((x1 - x0) - width * 50 / 1000) < 0.2


def test_write_timeline_draws_the_ranks_present_and_names_the_missing(tmp_path):
    (tmp_path / "rank0_trace.json").write_text(json.dumps(_trace(0)))
    path, missing = write_timeline(str(tmp_path), range(2), "step 5")
    assert missing == [1]
    svg = (tmp_path / "timeline.svg").read_text()
    assert path.endswith("timeline.svg") and "rank 0" in svg and "rank 1" not in svg
