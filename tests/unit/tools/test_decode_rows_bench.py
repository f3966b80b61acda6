"""bench.decode_rows runs the decode rows' host work end to end and reports each part."""
from __future__ import annotations

import json

from bench import decode_rows


def test_decode_rows_bench_reports_every_part(capsys):
    assert decode_rows.main(["--rows", "8", "--steps", "40"]) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert report["rows"] == 8 and report["steps"] == 40
    assert set(report["median_us"]) == {"delete", "append", "advance", "accept", "pack"}
    assert all(us > 0 for us in report["median_us"].values())
