"""`kvreuse cache ...` through a local argparse runner (the main CLI calls the same add_arguments)."""

from __future__ import annotations

import argparse
import json

import pytest

from kvreuse.cli import main
from kvreuse.cli.cache import add_arguments
from kvreuse.store.disk import DiskTier
from kvreuse.store.spec import open_store

from ..store.conftest import make_entry  # noqa: F401, F811  (the store tests' entry fixture)


def run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="kvreuse")
    add_arguments(parser.add_subparsers(dest="command", required=True).add_parser("cache"))
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.fixture
def disk_store(tmp_path, make_entry):  # noqa: F811
    spec = f"disk:{tmp_path}/store"
    store = open_store(spec)
    entries = [make_entry(extras=True) for _ in range(3)]
    for e in entries:
        store.put(e)
    store.close()
    return spec, entries


def test_ls_stats_rm_clear(disk_store, capsys, monkeypatch):
    spec, entries = disk_store
    assert run("cache", "ls", "--store", spec) == 0
    out = capsys.readouterr().out
    assert all(e.key in out for e in entries) and "test-model" in out
    monkeypatch.setenv("KVREUSE_STORE", spec)  # the default store
    assert run("cache", "stats") == 0
    assert "disk:" in capsys.readouterr().out
    assert run("cache", "rm", entries[0].key) == 0
    assert run("cache", "rm", entries[0].key) == 1 and "not found" in capsys.readouterr().err
    assert run("cache", "clear") == 0 and "deleted 2 entries" in capsys.readouterr().out
    assert list(open_store(spec).keys()) == []


def test_clear_that_deletes_nothing_says_so_and_fails(disk_store, capsys, monkeypatch):
    """A read-only folder: every delete fails; `clear` said "deleted 0 entries" and succeeded."""
    spec, entries = disk_store

    def read_only(self, key):
        raise PermissionError(13, "Read-only file system")

    monkeypatch.setattr(DiskTier, "_remove", read_only)
    assert run("cache", "clear", "--store", spec) == 1
    assert f"{len(entries)} entries could not be deleted" in capsys.readouterr().err
    monkeypatch.undo()
    assert sorted(open_store(spec).keys()) == sorted(e.key for e in entries)


def test_inspecting_a_disk_folder_that_does_not_exist_does_not_create_it(tmp_path, capsys):
    """A mistyped path would be created and shown as an empty store."""
    missing = tmp_path / "nodir" / "sub"
    for command in ("ls", "stats", "clear"):
        assert main(["cache", command, "--store", f"memory:1GB,throttled:ssd:disk:{missing}:1GB"]) == 2
        assert f"kvreuse: error: {missing}: no such folder" in capsys.readouterr().err
    assert not (tmp_path / "nodir").exists()


def test_commands_name_bad_input_and_exit_2_as_every_command(capsys, monkeypatch):
    monkeypatch.delenv("KVREUSE_STORE", raising=False)
    assert main(["cache", "ls"]) == 2
    assert capsys.readouterr().err.startswith("kvreuse: error: no store given")
    assert main(["cache", "ls", "--store", "nowhere"]) == 2
    assert "kvreuse: error: bad store spec 'nowhere'" in capsys.readouterr().err


def test_rm_checks_every_key_before_deleting_any(disk_store, capsys):
    """An invalid key among several stopped `rm` half way, the keys before it deleted and those after it kept."""
    spec, entries = disk_store
    with pytest.raises(SystemExit) as exit_info:
        run("cache", "rm", "--store", spec, entries[0].key, "../escape", entries[1].key)
    assert exit_info.value.code == 2 and "invalid store key '../escape'" in capsys.readouterr().err
    assert sorted(open_store(spec).keys()) == sorted(e.key for e in entries)


@pytest.mark.parametrize("option, value", [("--emulate", "ssd,floppy"), ("--layers", "-1"), ("--dtype", "float64x")])
def test_bench_refuses_bad_shapes_and_devices_before_measuring(option, value, capsys):
    with pytest.raises(SystemExit):
        run("cache", "bench", option, value)
    assert option in capsys.readouterr().err


def test_bench_prints_measured_and_emulated_tiers(tmp_path, redis_server, capsys):
    out_json = tmp_path / "bench.json"
    assert run("cache", "bench", "--entries", "2", "--layers", "2", "--tokens", "32", "--dir", str(tmp_path),
               "--redis", redis_server.url, "--emulate", "ssd", "--json", str(out_json)) == 0
    out = capsys.readouterr().out
    assert "write GB/s" in out and "ssd (emulated)" in out and "EMULATED over memory: 0.5 GB/s" in out
    [ssd_row] = [line for line in out.splitlines() if "ssd (emulated)" in line]
    assert ssd_row.split("│")[2].strip() == "-"  # only reads are emulated: no write speed under its name
    results = json.loads(out_json.read_text())["results"]
    assert [r["tier"] for r in results] == ["memory", "disk", "disk", "disk int8", "redis", "ssd (emulated)"]
    assert all(r["read_gbps"] > 0 and r["write_gbps"] > 0 for r in results)


def test_a_redis_tier_that_cannot_be_reached_is_named_not_taken_for_empty(
        own_redis_server, make_entry, capsys):  # noqa: F811
    spec = own_redis_server.url
    entry = make_entry()
    store = open_store(spec)
    assert store.put(entry)
    store.close()
    own_redis_server.stop()
    for command in ("ls", "clear"):
        with pytest.raises(SystemExit, match="^kvreuse: error: .*cannot list its entries"):
            run("cache", command, "--store", spec)
    assert run("cache", "rm", "--store", spec, entry.key) == 1
    assert "a tier could not be reached" in capsys.readouterr().err
    assert run("cache", "stats", "--store", spec) == 1
    assert f"{spec}: could not be reached" in capsys.readouterr().err.replace("\n", "")
