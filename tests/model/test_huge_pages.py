import os
import subprocess
import sys

import pytest

from kvreuse.model import huge_pages
from kvreuse.model.huge_pages import heap_environment
from tests.conftest import mapping_flags

GLIBC = (2, 36)


def test_the_heap_is_advised_where_linux_waits_for_advice_and_glibc_reads_the_tunable():
    assert heap_environment({"PATH": "/bin"}, "madvise", GLIBC) == {"PATH": "/bin",
                                                                   "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert heap_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "madvise", (2, 35)) == {
        "GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}  # the caller's tunables kept


@pytest.mark.parametrize("environ, thp, glibc", [
    ({}, "always", GLIBC),  # every page huge already: nothing to advise
    ({}, "never", GLIBC),
    ({}, None, GLIBC),  # not Linux
    ({}, "madvise", (2, 34)),  # a glibc without the tunable
    ({}, "madvise", None),  # not glibc
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "madvise", GLIBC),  # chosen by whoever started the command
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}, "madvise", GLIBC),  # a restarted one
])
def test_the_heap_is_left_alone_where_advice_changes_nothing_or_was_chosen(environ, thp, glibc):
    assert heap_environment(environ, thp, glibc) is None


def test_the_command_restarts_itself_with_its_own_arguments_and_the_tunable(monkeypatch):
    monkeypatch.setattr(huge_pages, "thp_setting", lambda: "madvise")
    monkeypatch.setattr(huge_pages, "glibc_version", lambda: GLIBC)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    calls = []
    monkeypatch.setattr(os, "execve", lambda *call: calls.append(call))
    huge_pages.exec_with_huge_page_heap()
    [(path, argv, environ)] = calls
    assert path == sys.executable and argv == sys.orig_argv and environ["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    monkeypatch.setattr(huge_pages, "thp_setting", lambda: "always")
    huge_pages.exec_with_huge_page_heap()
    assert len(calls) == 1


def test_a_command_that_cannot_restart_runs_on_as_it_was_started(monkeypatch, caplog):
    monkeypatch.setattr(huge_pages, "thp_setting", lambda: "madvise")
    monkeypatch.setattr(huge_pages, "glibc_version", lambda: GLIBC)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)

    def refused(*call):
        raise PermissionError("exec refused")

    monkeypatch.setattr(os, "execve", refused)
    huge_pages.exec_with_huge_page_heap()
    assert "4 KB pages" in caplog.text


def test_only_the_executable_restarts_a_program_calling_main_is_left_alone(monkeypatch):
    import kvreuse.cli as cli

    restarts = []
    monkeypatch.setattr(cli, "exec_with_huge_page_heap", lambda: restarts.append(1))
    monkeypatch.setattr(sys, "argv", ["kvreuse", "cache", "--help"])
    with pytest.raises(SystemExit):
        cli.main()
    assert restarts == []
    with pytest.raises(SystemExit):
        cli.command()
    assert restarts == [1]


def test_the_glibc_version_is_the_running_one():
    name, number = os.confstr("CS_GNU_LIBC_VERSION").split()
    expected = tuple(int(part) for part in number.split(".")) if name == "glibc" else None
    assert huge_pages.glibc_version() == expected


# The kvreuse command in a fresh process: a buffer malloc'ed before the command runs, then the command. It prints its
# GLIBC_TUNABLES and the buffer's address, and waits for a line, once as started and once as restarted.
COMMAND = """
import ctypes, os, sys
from kvreuse.cli import command
buffer = bytearray(8 << 20)
print(os.environ.get("GLIBC_TUNABLES"), ctypes.addressof(ctypes.c_char.from_buffer(buffer)), flush=True)
sys.stdin.readline()
sys.argv[:] = ["kvreuse", "cache", "--help"]
sys.exit(command())
"""


@pytest.mark.skipif(heap_environment({}, huge_pages.thp_setting(), huge_pages.glibc_version()) is None,
                    reason="THP not waiting for advice, or no glibc that reads its tunable")
def test_the_kvreuse_command_runs_with_its_heap_advised_for_huge_pages():
    environ = {name: value for name, value in os.environ.items() if name != "GLIBC_TUNABLES"}
    with subprocess.Popen([sys.executable, "-c", COMMAND], env=environ, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as command:
        seen = []
        for _ in range(2):
            tunables, address = command.stdout.readline().split()
            seen.append((tunables, "hg" in mapping_flags(int(address), command.pid)))
            command.stdin.write("\n")
            command.stdin.flush()
        usage = command.stdout.read()
    assert seen == [("None", False), ("glibc.malloc.hugetlb=1", True)]  # the same process (pid), restarted once
    assert command.returncode == 0 and usage.startswith("usage: kvreuse cache")
