"""What names a model's tokenizer and weights in the store's keys: their files' content, not where they lie."""

from kvreuse.model import identity
from kvreuse.model.identity import cached_file_digest, file_digest, tokenizer_identity, weights_identity


def write_model(folder, tokenizer_text: str, weights: bytes):
    folder.mkdir()
    (folder / "tokenizer.json").write_text(tokenizer_text)
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(weights)
    return folder


def test_the_same_files_at_two_paths_have_one_identity(tmp_path, monkeypatch):
    monkeypatch.setenv("KVREUSE_CACHE_DIR", str(tmp_path / "cache"))
    a = write_model(tmp_path / "a", '{"vocab": 1}', b"weights")
    b = write_model(tmp_path / "b", '{"vocab": 1}', b"weights")
    other = write_model(tmp_path / "other", '{"vocab": 2}', b"other weights")
    assert tokenizer_identity(a) == tokenizer_identity(b) != tokenizer_identity(other)
    assert weights_identity(a) == weights_identity(b) != weights_identity(other)


def test_a_tokenizer_named_by_a_hub_id_is_its_name_and_revision(tmp_path):
    assert tokenizer_identity("org/model", "v2") == "org/model@v2"
    assert tokenizer_identity("org/model") == "org/model@main"
    assert tokenizer_identity(tmp_path) == f"{tmp_path}@main"  # a folder without tokenizer files


def test_a_damaged_digest_cache_is_computed_again(tmp_path, monkeypatch):
    monkeypatch.setenv("KVREUSE_CACHE_DIR", str(tmp_path / "cache"))
    model = write_model(tmp_path / "model", "{}", b"weights")
    digest = weights_identity(model)
    [cached] = (tmp_path / "cache" / "fingerprints").iterdir()
    for damage in ("{half", "[]", '{"stamp": 1}', "\xff"):
        cached.write_text(damage, encoding="latin-1")
        assert weights_identity(model) == digest, damage


def test_a_file_s_digest_is_kept_until_its_size_or_mtime_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("KVREUSE_CACHE_DIR", str(tmp_path / "cache"))
    hashed = []
    monkeypatch.setattr(identity, "file_digest", lambda path: hashed.append(path) or file_digest(path))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF one")
    first = cached_file_digest(gguf)
    assert cached_file_digest(gguf) == first == file_digest(gguf) and hashed == [gguf]
    gguf.write_bytes(b"GGUF, another")
    assert cached_file_digest(gguf) == file_digest(gguf) != first and hashed == [gguf, gguf]
