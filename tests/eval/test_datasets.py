import json
import re

import pytest

from kvreuse.eval.datasets import (
    QA_INSTRUCTION,
    SAMSUM_SHOTS,
    Chunking,
    DatasetError,
    fixed_chunks,
    load_dataset,
)

from .support import DATASETS


class WordTokenizer:
    """Stands in for a fast tokenizer: one token per whitespace-separated word, with character offsets."""

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
        return {"offset_mapping": [m.span() for m in re.finditer(r"\S+", text)]}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_qa_prompt_follows_the_fixed_convention():
    data = load_dataset(f"{DATASETS}/2wikimqa.jsonl", limit=2)
    assert (data.name, data.task, data.max_tokens, data.first_line) == ("2wikimqa", "qa", 32, True)
    prompt = data.prompts[0]
    row = json.loads(open(f"{DATASETS}/2wikimqa.jsonl").readline())
    assert prompt.id == row["id"] and prompt.answers == row["answers"]
    assert len(prompt.chunks) == len(row["passages"])
    first = row["passages"][0]
    assert prompt.chunks[0] == f"Passage 1: {first['title']}\n{first['text']}"
    assert prompt.chunks[-1].startswith(f"Passage {len(row['passages'])}: ")
    assert prompt.question == f"{QA_INSTRUCTION}\n\nQuestion: {row['question']}\nAnswer:"


def test_samsum_few_shot_chunks_come_from_train_and_validation():
    data = load_dataset(f"{DATASETS}/samsum.jsonl", limit=3)
    assert (data.task, [p.id for p in data.prompts]) == ("summary", ["samsum-100", "samsum-101", "samsum-102"])
    first, second = data.prompts[0], data.prompts[1]
    assert len(first.chunks) == SAMSUM_SHOTS
    assert all(c.startswith("Dialogue: ") and "\nSummary: " in c for c in first.chunks)
    assert set(first.chunks).isdisjoint(second.chunks)  # each test dialogue gets its own shots
    assert first.question.endswith("\nSummary:") and "Dialogue: " in first.question


def test_multinews_passage_chunking_keeps_the_document_whole():
    data = load_dataset(f"{DATASETS}/multinews.jsonl", limit=1)
    assert data.task == "summary" and not data.first_line
    assert len(data.prompts[0].chunks) == 1


def test_fixed_chunks_cut_every_n_tokens_without_losing_text():
    text = "one two three four five six seven"
    assert fixed_chunks(text, 3, WordTokenizer()) == ["one two three", "four five six", "seven"]


def test_fixed_chunking_of_qa_passages():
    data = load_dataset(f"{DATASETS}/2wikimqa.jsonl", Chunking.parse("fixed:50"), WordTokenizer(), limit=1)
    chunks = data.prompts[0].chunks
    assert all(len(c.split()) <= 50 for c in chunks) and len(chunks[0].split()) == 50
    assert chunks[0].startswith("Passage 1: ")


def test_chunking_parse():
    assert Chunking.parse("passage") == Chunking()
    assert Chunking.parse("fixed:512").size == 512
    for bad in ["fixed", "fixed:0", "fixed:-3", "words:10", ""]:
        with pytest.raises(DatasetError, match="chunking"):
            Chunking.parse(bad)


def test_fixed_chunking_needs_a_tokenizer():
    with pytest.raises(DatasetError, match="tokenizer"):
        load_dataset(f"{DATASETS}/2wikimqa.jsonl", Chunking(64), None, limit=1)


def test_bad_files_are_named(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        load_dataset(tmp_path / "nope.jsonl")
    with pytest.raises(DatasetError, match="unknown dataset schema"):
        load_dataset(write_jsonl(tmp_path / "odd.jsonl", [{"id": "1", "prompt": "x"}]))
    (tmp_path / "broken.jsonl").write_text('{"id": 1,\n')
    with pytest.raises(DatasetError, match="broken.jsonl:1: not valid JSON"):
        load_dataset(tmp_path / "broken.jsonl")
    rows = [{"id": "1", "document": "d", "summary": "s"}, {"id": "2", "document": "d"}]
    with pytest.raises(DatasetError, match="mixed.jsonl:2: row lacks field"):
        load_dataset(write_jsonl(tmp_path / "mixed.jsonl", rows))


QA_ROW = {"id": "q1", "question": "Who?", "answers": ["Ada"], "passages": [{"title": "T", "text": "Ada wrote."}]}


@pytest.mark.parametrize("field, value, message", [
    ("answers", [], "answers must be a non-empty list of non-empty texts"),
    ("answers", [""], "answers must be a non-empty list"),
    ("answers", "Free Guy", "answers must be a non-empty list"),  # split into characters before
    ("passages", "abc", "passages must be a non-empty list of"),
    ("passages", [{"text": "no title"}], "passages must be"),
    ("question", None, "question must be non-empty text"),
    ("id", {"a": 1}, "id must be a string or number"),
])
def test_a_row_of_the_wrong_types_is_named_by_its_line(tmp_path, field, value, message):
    rows = [QA_ROW, {**QA_ROW, "id": "q2", field: value}]
    with pytest.raises(DatasetError, match=f"bad.jsonl:2: {re.escape(message)}"):
        load_dataset(write_jsonl(tmp_path / "bad.jsonl", rows))


def test_lines_are_counted_in_the_file_blank_ones_included(tmp_path):
    path = tmp_path / "gaps.jsonl"
    path.write_text("\n" + json.dumps(QA_ROW) + "\n\n" + json.dumps({"id": "q2"}) + "\n" + "5\n")
    with pytest.raises(DatasetError, match="gaps.jsonl:4: row lacks field"):
        load_dataset(path)
    path.write_text(json.dumps(QA_ROW) + "\n5\n")
    with pytest.raises(DatasetError, match="gaps.jsonl:2: a row must be a JSON object"):
        load_dataset(path)


def test_a_line_that_is_not_utf8_or_nested_too_deeply_is_named_by_its_line(tmp_path):
    """Python's own errors named no file nor line (UnicodeDecodeError) or were a traceback (RecursionError)."""
    path = tmp_path / "odd.jsonl"
    path.write_bytes((json.dumps(QA_ROW) + "\n").encode() + b'{"id": "caf\xe9"}\n')
    with pytest.raises(DatasetError, match="odd.jsonl:2: not UTF-8 text"):
        load_dataset(path)
    path.write_text(json.dumps(QA_ROW) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(DatasetError, match="odd.jsonl:2: JSON nested too deeply"):
        load_dataset(path)


def test_a_folder_given_as_the_dataset_is_named_a_folder(tmp_path):
    with pytest.raises(DatasetError, match="is a folder: name a JSONL file in it"):
        load_dataset(tmp_path)


def test_a_byte_order_mark_before_the_first_row_is_read_past(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + (json.dumps(QA_ROW) + "\n").encode())
    assert [p.id for p in load_dataset(path).prompts] == ["q1"]


def test_an_id_used_twice_is_refused(tmp_path):
    """Results are cached by id: a second row of the same id would never run, its twin counted twice."""
    rows = [QA_ROW, {**QA_ROW, "question": "Who else?"}]
    with pytest.raises(DatasetError, match="dup.jsonl:2: id 'q1' is already the id of line 1"):
        load_dataset(write_jsonl(tmp_path / "dup.jsonl", rows))


def test_a_samsum_file_without_test_rows_has_nothing_to_evaluate(tmp_path):
    rows = [{"id": str(i), "split": "train", "dialogue": "A: hi", "summary": "A greets."} for i in range(12)]
    with pytest.raises(DatasetError, match="no examples to evaluate \\(no test rows\\)"):
        load_dataset(write_jsonl(tmp_path / "samsum.jsonl", rows))
