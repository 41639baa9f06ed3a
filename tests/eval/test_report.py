import json

from PIL import Image

from kvreuse.eval.report import _styles, markdown_table, write_report
from kvreuse.eval.runner import MethodSummary, RunSettings

SETTINGS = RunSettings(model="fake-model", dataset="toy", chunking="passage", max_tokens=8, store="memory")
SUMMARIES = [
    MethodSummary("full", 2, 0.5, 1.0, -1.2, 0.0, 1.0, 0.4, 0.4, 0.45, 1.0, 1.0, 0.0),
    MethodSummary("naive", 2, 0.25, 0.5, -2.0, 0.6, None, 0.1, 0.1, 0.12, 4.0, 4.5, 0.5),
]


def test_markdown_table_has_a_row_per_method():
    lines = markdown_table(SUMMARIES, "qa").splitlines()
    assert "| F1 |" in lines[0] and set(lines[1]) == {"|", "-"}
    assert lines[1].count("|") == lines[0].count("|")
    assert "| KL > 0.15 |" in lines[0]
    assert lines[2] == "| full | 2 | 0.500 | 1.000 | 0.000 | 0% | -1.200 | 1.00 | 400.0 / 400.0 / 450.0 | 1.00x, 1.00x |"
    assert lines[3] == "| naive | 2 | 0.250 | 0.500 | 0.600 | 50% | -2.000 | n/a | 100.0 / 100.0 / 120.0 | 4.50x, 4.00x |"
    assert "| KL > 0.1 |" in markdown_table(SUMMARIES, "qa", floor=0.1).splitlines()[0]


def test_write_report_writes_json_markdown_and_a_plot(tmp_path):
    paths = write_report(tmp_path / "out", SETTINGS, "summary", SUMMARIES, results=[])
    document = json.loads(paths[0].read_text())
    assert [m["method"] for m in document["methods"]] == ["full", "naive"] and document["score"] == "Rouge-L"
    assert document["machine"]["cpus"] >= 1 and len(document["machine"]["load_average"]) == 3
    assert "| Rouge-L |" in paths[1].read_text()
    with Image.open(paths[2]) as image:
        assert image.format == "PNG" and image.size[0] > image.size[1] > 300


def test_a_family_shares_a_colour_and_its_settings_differ_by_marker():
    full, blend15, naive, blend05 = _styles(["full", "cacheblend:0.15", "naive", "cacheblend:0.05"])
    assert blend15["color"] == blend05["color"] and blend15["marker"] != blend05["marker"]
    assert len({full["color"], naive["color"], blend15["color"]}) == 3
