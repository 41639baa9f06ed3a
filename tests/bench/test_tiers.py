"""The tiers a benchmark or profile names on its command line are checked when it starts, before the model loads."""

import pytest

from kvreuse.bench.tiers import check_tiers, tier_spec
from kvreuse.cli import main


def test_names_and_store_specs_pass():
    assert check_tiers(" memory, disk,redis,ssd ,memory:20KB") == ["memory", "disk", "redis", "ssd", "memory:20KB"]
    assert check_tiers("hdd,net10g", redis=False) == ["hdd", "net10g"]


@pytest.mark.parametrize("text, redis, message", [
    ("memory,memroy", True, "unknown tier 'memroy'"),
    ("redis", False, "unknown tier 'redis'"),  # profile costs starts no private server
    (" , ", True, "no tier named"),
    ("memory,disk:/kv:5XB", True, "bad size '5XB'"),  # a store spec's own mistake, before the model loads
    ("throttled:floppy:memory:1GB", False, "DEVICE in"),
    ("memory,disk,memory", True, "tier 'memory' is named twice"),  # its rows would be printed twice
])
def test_a_misspelt_or_missing_tier_is_named(text, redis, message):
    with pytest.raises(ValueError, match=message):
        check_tiers(text, redis)


@pytest.mark.parametrize("command", [
    ["bench", "ttft", "--peers", "none"], ["bench", "fusion", "--dataset", "x.jsonl"], ["profile", "costs"]])
def test_commands_refuse_an_unknown_tier_before_any_work(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--tiers", "memory,nonsense"])
    assert exit_info.value.code == 2 and "unknown tier 'nonsense'" in capsys.readouterr().err


def test_a_store_spec_is_taken_as_it_is_braces_and_all():
    assert tier_spec("disk", "/tmp/run") == "disk:/tmp/run/disk"
    assert tier_spec("disk:/tmp/kv{x}", "/tmp/run") == "disk:/tmp/kv{x}"  # a KeyError once the model had loaded
